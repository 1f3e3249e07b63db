"""IncrementalDetokenizer on the embedded model's tokenizer (Gemma 3 SentencePiece, byte fallback).

The reference for the streamed text is the tokenizer's own full decode; the reference for stop
strings is a character-by-character scan written here independently of the implementation.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest
import regex
from tokenizers import Tokenizer, decoders

from actors.tokenizer.detokenizer import (
    HARD_PENDING_LIMIT,
    SOFT_PENDING_LIMIT,
    DetokDelta,
    IncrementalDetokenizer,
)

# ---------------------------------------------------------------- the real tokenizer


@pytest.fixture(scope="module")
def tok(tokenizer) -> Tokenizer:
    return tokenizer.tokenizer  # the embedded model's tokenizer (cached tokenizer.json)


@pytest.fixture(scope="module")
def llama_style(tok: Tokenizer) -> Tokenizer:
    """Same vocabulary with Llama's SentencePiece decoder, which strips the text's first space."""
    tokenizer = Tokenizer.from_str(tok.to_str())
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tokenizer


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    """A small byte-level BPE (GPT-2 style: no byte-fallback tokens, lossy UTF-8 decode)."""
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|end|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS] * 3, trainer)
    return tokenizer


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    return [tok.token_to_id(f"<0x{b:02X}>") for b in data]


# ---------------------------------------------------------------- helpers


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], sizes: Sequence[int]
) -> list[DetokDelta]:
    """Push `ids` in chunks of the given sizes (cycled), then flush unless finished."""
    deltas: list[DetokDelta] = []
    start, k = 0, 0
    while start < len(ids) and not detok.finished:
        size = sizes[k % len(sizes)]
        deltas.append(detok.push(ids[start : start + size]))
        start += size
        k += 1
    if not detok.finished:
        deltas.append(detok.flush())
    return deltas


def joined(deltas: Sequence[DetokDelta]) -> str:
    return "".join(d.text for d in deltas)


def expected_text(
    tok: Tokenizer, prompt: Sequence[int], out: Sequence[int], skip: bool = True
) -> str:
    """The output's part of the in-context decode (the plain decode when there is no prompt)."""
    if not prompt:
        return tok.decode(list(out), skip_special_tokens=skip)
    before = tok.decode(list(prompt), skip_special_tokens=skip)
    full = tok.decode(list(prompt) + list(out), skip_special_tokens=skip)
    assert full.startswith(before)
    return full[len(before) :]


def grapheme_boundaries(text: str) -> set[int]:
    return {m.start() for m in regex.finditer(r"\X", text)} | {len(text)}


def reference_stop(text: str, stops: Sequence[str]) -> tuple[str, int] | None:
    """Scan `text` one character at a time; the first stop to be complete wins (ties: longer)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return stop, end - len(stop)
    return None


CORPUS = (
    "The quick brown fox jumps over the lazy dog. Voilà: naïve café, crème brûlée, façade. "
    "日本語のテキストと中文文本, 한국어 문장. Emoji 😀🎉 👍🏽 👨‍👩‍👧 🇯🇵🇫🇷 and e\u0301 a\u0308 "
    "Ελληνικά κείμενα, русский текст, עברית, العربية. def f(x):\n    return x ** 2\n\t"
    "Rare glyphs 𓀀𓀁 ꙮ 🧌 \U0001facf 𝔘𝔫𝔦𝔠𝔬𝔡𝔢. Math ∑∫√∞ ≤ ≥. "
)
EXTENDERS = "\u0301\u0308\u0323\u200d\ufe0f\U0001f3fd\U0001f1ef\U0001f1f5"


def random_output_ids(tok: Tokenizer, rng: random.Random, length: int) -> list[int]:
    """A mix of real text tokens, byte-fallback characters, stray bytes, combining marks, ZWJ,
    regional indicators, special tokens and arbitrary vocabulary ids. Byte runs stay short
    (< SOFT_PENDING_LIMIT) so the tokenizer's whole-run decode is the exact reference."""
    corpus_ids = ids_of(tok, CORPUS)
    extender_ids = [i for c in EXTENDERS for i in ids_of(tok, c)]
    specials = [1, 2, 105, 106]
    vocab = tok.get_vocab_size()
    out: list[int] = []
    run = 0  # byte tokens at the end of `out`
    while len(out) < length:
        roll = rng.random()
        if roll < 0.45:
            piece = [rng.choice(corpus_ids)]
        elif roll < 0.57 and run < SOFT_PENDING_LIMIT - 8:
            code = rng.choice([0xE9, 0x4E2D, 0xA66E, 0x13000, 0x1FACF, 0x1F9CC, 0x1D518])
            piece = byte_ids(tok, chr(code).encode())
        elif roll < 0.60 and run < SOFT_PENDING_LIMIT - 8:
            piece = byte_ids(tok, bytes([rng.randrange(256)]))
        elif roll < 0.75:
            piece = [rng.choice(extender_ids)]
        elif roll < 0.82:
            piece = [rng.choice(specials)]
        else:
            piece = [rng.randrange(vocab)]
        for i in piece:
            out.append(i)
            if tok.id_to_token(i).startswith("<0x"):
                run += 1
            elif i not in specials:  # skipped specials do not close a run
                run = 0
    return out[:length]


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("hold_glyph_tail", [True, False])
def test_random_round_trips_equal_full_decode(
    tok: Tokenizer, skip_special: bool, hold_glyph_tail: bool
) -> None:
    rng = random.Random(1234 + 2 * skip_special + hold_glyph_tail)
    chat_prompt = [2, 105] + ids_of(tok, "user\nhi")
    prompts = [None, ids_of(tok, "Translate to French: the cat"), chat_prompt]
    for trial in range(40):
        out = random_output_ids(tok, rng, rng.randrange(1, 300))
        prompt = prompts[trial % len(prompts)]
        sizes = [rng.randrange(1, 9) for _ in range(7)]
        detok = IncrementalDetokenizer(
            tok, prompt, skip_special_tokens=skip_special, hold_glyph_tail=hold_glyph_tail
        )
        deltas = stream(detok, out, sizes)
        want = expected_text(tok, prompt or [], out, skip_special)
        assert joined(deltas) == want, (trial, out)
        assert detok.output_text == want
        assert detok.output_ids == out
        assert all(d.finished_by_stop is None for d in deltas)
        if hold_glyph_tail:
            bounds = grapheme_boundaries(want)
            emitted = 0
            for d in deltas:
                emitted += len(d.text)
                assert emitted in bounds, (trial, out, emitted)


def test_text_round_trip_multilingual_one_token_at_a_time(tok: Tokenizer) -> None:
    prompt = ids_of(tok, "Réponds en japonais, s'il te plaît: 日本語で答えて 🙂")
    out = ids_of(tok, CORPUS * 3)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, out, [1])
    assert joined(deltas) == expected_text(tok, prompt, out)
    # No delta carries a broken character: the corpus has no U+FFFD of its own.
    assert all("\ufffd" not in d.text for d in deltas)


def test_first_output_token_keeps_its_leading_space_in_context(
    tok: Tokenizer, llama_style: Tokenizer
) -> None:
    prompt = ids_of(tok, "The capital of France is")
    out = ids_of(tok, " Paris, of course.")
    for tokenizer in (tok, llama_style):
        detok = IncrementalDetokenizer(tokenizer, prompt, hold_glyph_tail=False)
        assert detok.push(out[:1]).text == " Paris"
        assert detok.push(out[1:]).text == ", of course."
    # With Llama's decoder the space is stripped only at the very start of a text.
    assert llama_style.decode(out) == "Paris, of course."
    detok = IncrementalDetokenizer(llama_style, None, hold_glyph_tail=False)
    assert detok.push(out[:1]).text == "Paris"
    assert joined(stream(detok, out[1:], [2])) == ", of course."


def test_llama_style_random_round_trips_in_context(llama_style: Tokenizer) -> None:
    rng = random.Random(7)
    prompt = ids_of(llama_style, "Question: where is the cat")
    for trial in range(15):
        out = random_output_ids(llama_style, rng, rng.randrange(1, 200))
        detok = IncrementalDetokenizer(llama_style, prompt if trial % 2 else None)
        deltas = stream(detok, out, [rng.randrange(1, 5)])
        want = expected_text(llama_style, prompt if trial % 2 else [], out)
        assert joined(deltas) == want, (trial, out)


def test_byte_level_bpe_random_round_trips(byte_level: Tokenizer) -> None:
    """Characters split over byte-level pieces: held while the text ends in U+FFFD."""
    rng = random.Random(5)
    vocab = byte_level.get_vocab_size()
    text_ids = ids_of(byte_level, CORPUS)
    prompt = ids_of(byte_level, "Réponds: ")
    for trial in range(30):
        out = [
            rng.choice(text_ids) if rng.random() < 0.7 else rng.randrange(vocab)
            for _ in range(rng.randrange(1, 200))
        ]
        with_prompt = trial % 2 == 1
        detok = IncrementalDetokenizer(byte_level, prompt if with_prompt else None)
        deltas = stream(detok, out, [rng.randrange(1, 6)])
        assert joined(deltas) == expected_text(byte_level, prompt if with_prompt else [], out)
    # A character in pieces: nothing until it is whole.
    pieces = ids_of(byte_level, "日本")
    assert byte_level.decode(pieces[:1]).endswith("\ufffd")
    detok = IncrementalDetokenizer(byte_level, None, hold_glyph_tail=False)
    texts = [detok.push([i]).text for i in pieces]
    assert texts[0] == "" and "".join(texts) == "日本"


def test_byte_level_garbage_does_not_stall_forever(byte_level: Tokenizer) -> None:
    lead_byte = byte_level.token_to_id("ã")  # 0xE3 alone: a 3-byte lead that never completes
    out = [lead_byte] * (3 * HARD_PENDING_LIMIT)
    assert byte_level.decode(out) == "\ufffd" * len(out)
    detok = IncrementalDetokenizer(byte_level, None)
    texts = [detok.push([i]).text for i in out]
    assert sum(len(t) for t in texts[: HARD_PENDING_LIMIT + 2]) > 0
    assert "".join(texts) + detok.flush().text == byte_level.decode(out)


# ---------------------------------------------------------------- characters and glyphs


def test_byte_fallback_character_is_held_until_complete(tok: Tokenizer) -> None:
    hi, there = ids_of(tok, "Hi"), ids_of(tok, " there")
    troll = byte_ids(tok, "🧌".encode())
    assert tok.decode(troll[:2]) == "\ufffd\ufffd"  # what a naive per-token decode would emit
    detok = IncrementalDetokenizer(tok, None, hold_glyph_tail=False)
    texts = [detok.push([i]).text for i in hi + troll + there]
    assert texts[0] == "Hi"
    assert texts[1:4] == ["", "", ""]  # incomplete bytes: nothing
    # The complete run is sent once a text token closes it (one bad byte would spoil the run).
    assert texts[4] == ""
    assert texts[5] == "🧌 there"
    assert detok.flush().text == ""


def test_invalid_byte_run_matches_the_tokenizer(tok: Tokenizer) -> None:
    """A valid character followed by a stray lead byte: the tokenizer renders the whole run as
    replacement characters (tokenizers' DecodeStream raises here); the stream must agree."""
    out = ids_of(tok, "Hi") + byte_ids(tok, "🧌".encode() + b"\xf0") + ids_of(tok, " Hi")
    assert tok.decode(out) == "Hi\ufffd\ufffd\ufffd\ufffd\ufffd Hi"
    for sizes in ([1], [2], [3, 1], [len(out)]):
        detok = IncrementalDetokenizer(tok, None)
        assert joined(stream(detok, out, sizes)) == tok.decode(out)


def test_long_byte_run_is_emitted_at_character_boundaries(tok: Tokenizer) -> None:
    """Many rare characters in a row (one long run of byte tokens): text flows before the run
    ends, never with a broken character, and the decode window stays bounded."""
    text = "𓀀𓀁" * 20  # 160 byte tokens, no closing text token until the end
    out = ids_of(tok, text)
    assert len(out) == 160
    detok = IncrementalDetokenizer(tok, None, hold_glyph_tail=False)
    texts = [detok.push([i]).text for i in out]
    assert "".join(texts) == text  # everything flowed before flush
    assert all("\ufffd" not in t for t in texts)
    assert sum(1 for t in texts if t) >= len(out) // SOFT_PENDING_LIMIT
    assert detok.flush().text == ""


def test_garbage_bytes_do_not_stall_forever(tok: Tokenizer) -> None:
    out = byte_ids(tok, b"\x80" * (3 * HARD_PENDING_LIMIT))
    detok = IncrementalDetokenizer(tok, None)
    texts = [detok.push([i]).text for i in out]
    assert sum(len(t) for t in texts[: HARD_PENDING_LIMIT + 1]) > 0
    assert "".join(texts) + detok.flush().text == "\ufffd" * len(out)


@pytest.mark.parametrize(
    "glyph",
    ["e\u0301", "a\u0308\u0323", "👨\u200d👩\u200d👧", "🇯🇵", "👍🏽", "❤\ufe0f", "𝔘𝔫"],
)
def test_multi_token_glyph_is_never_split(tok: Tokenizer, glyph: str) -> None:
    text = f"Look: {glyph} ok"
    out = ids_of(tok, text)
    detok = IncrementalDetokenizer(tok, None, hold_glyph_tail=True)
    texts = [detok.push([i]).text for i in out] + [detok.flush().text]
    assert "".join(texts) == text
    assert any(glyph in t for t in texts), texts  # the glyph travels whole in one delta
    bounds = grapheme_boundaries(text)
    emitted = 0
    for t in texts:
        emitted += len(t)
        assert emitted in bounds


def test_newline_releases_the_glyph_tail_at_once(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, None, hold_glyph_tail=True)
    assert detok.push(ids_of(tok, "Hello")).text == "Hell"  # 'o' could still take a mark
    assert detok.push(ids_of(tok, "\n")).text == "o\n"  # nothing extends a cluster after LF


# ---------------------------------------------------------------- stop strings


def test_stop_string_spanning_tokens_is_never_partly_emitted(tok: Tokenizer) -> None:
    out = ids_of(tok, "Hello world. STOP here and more")
    stop = "ld. ST"  # spans '▁world', '.', '▁STOP'
    detok = IncrementalDetokenizer(tok, None, stop=[stop], hold_glyph_tail=False)
    deltas = [detok.push([i]) for i in out[:4]]
    assert [d.text for d in deltas] == ["Hello", " wor", "", ""]
    assert deltas[-1].finished_by_stop == stop
    assert detok.finished and detok.output_text == "Hello wor"
    assert detok.output_ids == out[:4]  # '▁STOP' completed the stop; later ids are not output
    with pytest.raises(RuntimeError):
        detok.push(out[4:5])


def test_stop_at_the_first_token(tok: Tokenizer) -> None:
    out = ids_of(tok, "Hello world")
    detok = IncrementalDetokenizer(tok, None, stop=["Hello"])
    delta = detok.push(out)
    assert delta == DetokDelta("", "Hello")
    assert detok.output_ids == out[:1]


def test_earliest_stop_wins_and_grouping_does_not_matter(tok: Tokenizer) -> None:
    out = ids_of(tok, "alpha beta gamma delta")
    for sizes in ([1], [2], [len(out)]):
        detok = IncrementalDetokenizer(tok, None, stop=["gamma", "beta"])
        deltas = stream(detok, out, sizes)
        assert joined(deltas) == "alpha "
        assert deltas[-1].finished_by_stop == "beta"
    # "ta g" ends before "gamma": it wins although "gamma" is listed first and both overlap.
    for sizes in ([1], [len(out)]):
        detok = IncrementalDetokenizer(tok, None, stop=["gamma", "ta g"])
        deltas = stream(detok, out, sizes)
        assert joined(deltas) == "alpha be" and deltas[-1].finished_by_stop == "ta g"


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    out = ids_of(tok, "one two three four")
    detok = IncrementalDetokenizer(tok, None, stop=["thr"], include_stop_str_in_output=True)
    deltas = stream(detok, out, [1])
    assert joined(deltas) == "one two thr" and deltas[-1].finished_by_stop == "thr"


def test_held_stop_prefix_is_released_when_it_cannot_match(tok: Tokenizer) -> None:
    out = ids_of(tok, "hello world peace")
    detok = IncrementalDetokenizer(tok, None, stop=["worldwide"], hold_glyph_tail=False)
    texts = [detok.push([i]).text for i in out]
    assert texts == ["hello", " ", "world peace"]
    assert detok.flush() == DetokDelta("", None)


def test_flush_releases_held_text_and_can_complete_a_stop(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, None, stop=["worldwide"], hold_glyph_tail=True)
    assert joined([detok.push(ids_of(tok, "hello world"))]) == "hello "
    assert detok.flush() == DetokDelta("world", None)
    assert detok.output_text == "hello world" and detok.finished
    # A stop made of byte-fallback bytes still open at the finish is found by flush.
    out = ids_of(tok, "see ") + byte_ids(tok, "🧌".encode())
    detok = IncrementalDetokenizer(tok, None, stop=["🧌"], hold_glyph_tail=True)
    assert joined([detok.push([i]) for i in out]) == "see"
    assert detok.flush() == DetokDelta(" ", "🧌")


def test_stop_token_ids(tok: Tokenizer) -> None:
    eos, end_of_turn = 1, 106
    words = ids_of(tok, "Sure, here it is")
    detok = IncrementalDetokenizer(tok, None, stop=["is it"], stop_token_ids={eos, end_of_turn})
    deltas = [detok.push(words[:-1]), detok.push(words[-1:] + [end_of_turn] + ids_of(tok, " more"))]
    assert joined(deltas) == "Sure, here it is"  # held " is"/"it" released at the stop id
    assert deltas[-1].finished_by_stop == end_of_turn
    assert detok.output_ids == words + [end_of_turn]
    # A stop id at the first token, and a stop id that is an ordinary text token ("\n").
    detok = IncrementalDetokenizer(tok, None, stop_token_ids={eos})
    assert detok.push([eos, *words]) == DetokDelta("", eos)
    newline = ids_of(tok, "\n")
    assert len(newline) == 1
    detok = IncrementalDetokenizer(
        tok, None, stop_token_ids=set(newline), skip_special_tokens=False
    )
    deltas = stream(detok, ids_of(tok, "line one\nline two"), [1])
    assert joined(deltas) == "line one" and deltas[-1].finished_by_stop == newline[0]


def test_stop_ids_close_an_open_byte_run(tok: Tokenizer) -> None:
    out = ids_of(tok, "a ") + byte_ids(tok, "🧌".encode())
    detok = IncrementalDetokenizer(tok, None, stop_token_ids={1})
    assert joined([detok.push(out), detok.push([1])]) == "a 🧌"


def test_random_stops_match_a_character_level_reference(tok: Tokenizer) -> None:
    rng = random.Random(99)
    for trial in range(40):
        out = random_output_ids(tok, rng, rng.randrange(5, 120))
        full = tok.decode(out)
        stops = []
        for _ in range(rng.randrange(1, 4)):
            if full and rng.random() < 0.8:
                a = rng.randrange(len(full))
                stops.append(full[a : a + rng.randrange(1, 6)])
            else:
                stops.append("zzq")  # never present
        ref = reference_stop(full, stops)
        include = rng.random() < 0.3
        results = set()
        for sizes in ([1], [rng.randrange(2, 6)], [len(out)]):
            detok = IncrementalDetokenizer(
                tok,
                None,
                stop=stops,
                include_stop_str_in_output=include,
                hold_glyph_tail=rng.random() < 0.5,
            )
            deltas = stream(detok, out, sizes)
            text, by = joined(deltas), deltas[-1].finished_by_stop
            results.add((text, by))
            if ref is None:
                assert (text, by) == (full, None), (trial, stops)
            else:
                stop, start = ref
                assert by == stop, (trial, stops, ref)
                assert text == full[: start + (len(stop) if include else 0)], (trial, stops)
            assert detok.output_text == text
        assert len(results) == 1


def test_bad_arguments(tok: Tokenizer) -> None:
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, None, stop=[""])
    with pytest.raises(TypeError):
        IncrementalDetokenizer(tok, None, stop="abc")  # type: ignore[arg-type]


# ---------------------------------------------------------------- cost per push


class _CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call is given."""

    def __init__(self, inner: Tokenizer) -> None:
        self._inner = inner
        self.decoded_lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(ids))
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def test_cost_per_push_does_not_grow_with_the_output(tok: Tokenizer) -> None:
    counting = _CountingTokenizer(tok)
    prompt = ids_of(tok, CORPUS * 20)  # a long prompt must not cost anything per step either
    out = ids_of(tok, CORPUS * 40)
    stops = ["never appears"]
    detok = IncrementalDetokenizer(counting, prompt, stop=stops)  # type: ignore[arg-type]
    counting.decoded_lengths.clear()
    started = time.perf_counter()
    for i in out:
        detok.push([i])
    per_push_us = (time.perf_counter() - started) / len(out) * 1e6
    assert detok.output_text + detok.flush().text == expected_text(tok, prompt, out)
    assert len(out) > 2000
    # Decode windows stay a few tokens long (byte runs are the longest: 4 per rare character).
    assert max(counting.decoded_lengths) <= 16
    print(f"per push: {per_push_us:.1f} us over {len(out)} tokens")
    assert per_push_us < 2000  # generous: a loaded 2-core box; measured ~tens of us
