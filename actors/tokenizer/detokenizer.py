"""Incremental detokenization of one request: token ids in, stable text deltas out.

Owns, per request: the decode window over the token ids (prefix/read offsets, as vLLM, SGLang and
TGI do), the text that is decoded but held back, the stop-string and stop-token checks, and the
record of what was emitted. The tokenizer actor keeps one `IncrementalDetokenizer` per request and
calls `push` once per step with that step's new ids, then `flush` at a normal finish.

Guarantees of the emitted text (every `DetokDelta.text`, in order):

* it never ends inside a UTF-8 character: a character spelled by several byte tokens
  (SentencePiece byte fallback `<0xF0><0x9F>...`, or byte-level BPE pieces) is held until complete;
* with `hold_glyph_tail` it never ends inside an extended grapheme cluster either (emoji ZWJ
  sequences, flags, a letter and its combining marks): the last cluster of the text is held until
  the next character shows it is complete, or until the finish. Off by default, and off in the
  server: there a delta must be exactly the text of the tokens it comes with (their logprobs ride
  in the same chunk, and clients check that they line up, as vLLM's tests do);
* it never ends with a prefix of a stop string, so a stop split across tokens is never partly sent;
* without a stop, the concatenation of all deltas equals `tokenizer.decode(output_ids)` when there
  is no prompt, and the output's part of `tokenizer.decode(prompt_ids + output_ids)` when there is
  one (so a SentencePiece leading space is kept, as in context). The one exception: ByteFallback
  decodes a run of byte tokens all at once and turns the whole run into U+FFFD if any byte is bad,
  so a run longer than SOFT_PENDING_LIMIT whose good characters were already sent, then spoiled
  by a bad byte, stays sent as good characters (the full decode shows U+FFFD for them).

Cost per `push`: two decodes of a window of a few tokens plus the new ones, and a scan of the held
text; nothing is proportional to the length of the prompt or of the output so far.
"""

from __future__ import annotations

import unicodedata
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import regex
from tokenizers import Tokenizer

# Prompt tokens kept as decode context: enough for a SentencePiece leading space and a byte run.
PROMPT_CONTEXT_TOKENS = 5
# Longest UTF-8 character, in bytes, hence the longest unfinished byte run worth waiting on.
_MAX_UTF8_BYTES = 4
# Open byte-fallback run length after which its complete characters are emitted before it closes.
SOFT_PENDING_LIMIT = 16
# Waiting ids (an open byte run, or ids whose text ends in U+FFFD) after which the text is emitted
# whatever it is: a model producing invalid bytes forever must not grow the decode window forever.
HARD_PENDING_LIMIT = 64

_REPLACEMENT = "\ufffd"
_GRAPHEME = regex.compile(r"\X")


@dataclass(frozen=True, slots=True)
class DetokDelta:
    """Text released by one `push` or `flush`, and what ended the request if something did."""

    text: str
    finished_by_stop: str | int | None = None  # the stop string, or the stop token id


@dataclass(frozen=True, slots=True)
class _TokenizerFacts:
    """What the detokenizer needs to know about a tokenizer, computed once per tokenizer."""

    special_ids: frozenset[int]  # dropped from the text when skip_special_tokens
    byte_fallback_ids: frozenset[int]  # `<0xNN>` tokens the decoder turns into raw bytes


_FACTS: weakref.WeakKeyDictionary[Tokenizer, _TokenizerFacts] = weakref.WeakKeyDictionary()


def _tokenizer_facts(tokenizer: Tokenizer) -> _TokenizerFacts:
    facts = _FACTS.get(tokenizer)
    if facts is None:
        added = tokenizer.get_added_tokens_decoder()
        special = frozenset(i for i, token in added.items() if token.special)
        byte_ids = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256)]
        byte_fallback: frozenset[int] = frozenset()
        if all(i is not None for i in byte_ids):
            # Byte tokens matter only if the decoder really fuses them into bytes (ByteFallback).
            smile = [byte_ids[b] for b in "😀".encode()]
            if tokenizer.decode(smile, skip_special_tokens=False) == "😀":
                byte_fallback = frozenset(i for i in byte_ids if i is not None)
        facts = _TokenizerFacts(special_ids=special, byte_fallback_ids=byte_fallback)
        _FACTS[tokenizer] = facts
    return facts


def _last_glyph_start(text: str) -> int:
    """Where the last extended grapheme cluster of `text` starts; len(text) if it surely ended.

    `text` must start at a cluster boundary: segmentation runs from its start (a scan from the
    middle could pair regional indicators wrongly). A cluster can always grow by a following
    combining mark, ZWJ or modifier, except after a control character, CR or LF (UAX #29 GB4/GB5),
    so only then is the end of the text certain.
    """
    if not text:
        return 0
    last = text[-1]
    if last in "\r\n" or unicodedata.category(last) == "Cc":
        return len(text)
    start = 0
    for match in _GRAPHEME.finditer(text):
        start = match.start()
    return start


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, applying stop strings and ids.

    `output_ids` are the generated ids accepted so far: a stop token id is included, ids after a
    stop (in the same push) are not. `output_text` is everything emitted so far.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        stop_token_ids: Collection[int] = (),
        include_stop_str_in_output: bool = False,
        hold_glyph_tail: bool = False,
    ) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a string")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self._tokenizer = tokenizer
        self._facts = _tokenizer_facts(tokenizer)
        self._skip_special = skip_special_tokens
        self._stops = tuple(dict.fromkeys(stop))
        self._stop_ids = frozenset(stop_token_ids)
        self._include_stop = include_stop_str_in_output
        self._hold_glyph_tail = hold_glyph_tail

        # Decode window: _ids[_prefix:_read] is context whose text is already accounted for,
        # _ids[_read:] are ids whose text is not yet decided. _ids starts with prompt context.
        context = self._prompt_context([] if prompt_ids is None else list(prompt_ids))
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._output_ids: list[int] = []
        # Generic tokenizers: whether _ids[_read:] were already held by an earlier push, and how
        # many ids arrived in later pushes while they stayed held.
        self._holding = False
        self._waited = 0

        # Decided text not yet emitted (held for a stop-string prefix or an open grapheme). It
        # starts where the emitted text ends, which is a grapheme cluster boundary.
        self._held = ""
        self._emitted: list[str] = []
        self._emitted_text = ""
        self._emitted_count = 0  # len(_emitted) when _emitted_text was last joined
        self._finished = False
        self._finished_by: str | int | None = None

    # ---------------------------------------------------------------- public surface

    @property
    def output_ids(self) -> list[int]:
        return list(self._output_ids)

    @property
    def output_count(self) -> int:
        """len(output_ids), without the copy."""
        return len(self._output_ids)

    @property
    def output_text(self) -> str:
        if self._emitted_count != len(self._emitted):
            self._emitted_text = "".join(self._emitted)
            self._emitted = [self._emitted_text]
            self._emitted_count = 1
        return self._emitted_text

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def finished_by_stop(self) -> str | int | None:
        return self._finished_by

    def push(self, new_ids: Sequence[int]) -> DetokDelta:
        """Accept one step's new ids; return the text that became safe to send."""
        if self._finished:
            raise RuntimeError("push() on a finished detokenizer")
        released: list[str] = []
        # With stop strings, ids are taken one at a time so the id that completes a stop is known
        # and later ids of the same push are not counted as output.
        step = 1 if self._stops else max(1, len(new_ids))
        start = 0
        while start < len(new_ids) and not self._finished:
            chunk = list(new_ids[start : start + step])
            start += len(chunk)
            stop_at = next((k for k, i in enumerate(chunk) if i in self._stop_ids), None)
            if stop_at is not None:
                self._output_ids.extend(chunk[: stop_at + 1])
                self._ids.extend(chunk[:stop_at])
                released.append(self._finish(stop_token=chunk[stop_at]))
                break
            self._output_ids.extend(chunk)
            self._ids.extend(chunk)
            self._held += self._decide_text(force=False, fresh=len(chunk))
            released.append(self._release(at_finish=False))
        return self._record("".join(released))

    def flush(self) -> DetokDelta:
        """Normal finish (length, EOS handled by the caller): release everything still held.

        A stop string completed by the held text still cuts the text and is reported.
        """
        if self._finished:
            return DetokDelta("", self._finished_by)
        return self._record(self._finish(stop_token=None))

    # ---------------------------------------------------------------- token layer

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        start = max(0, len(prompt_ids) - PROMPT_CONTEXT_TOKENS)
        # Do not start inside a byte run: its partial bytes would decode differently.
        floor = max(0, start - _MAX_UTF8_BYTES)
        while start > floor and prompt_ids[start] in self._facts.byte_fallback_ids:
            start -= 1
        return prompt_ids[start:]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decide_text(self, force: bool, fresh: int = 0) -> str:
        """Text of _ids[_read:] that can no longer change, moving the offsets past it.

        `fresh` is how many of those ids came with the current push.
        """
        if self._read == len(self._ids):
            return ""
        known = ""
        if self._read > self._prefix:
            known = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if not force and self._undecided(text, fresh):
            return ""
        if text.startswith(known):
            new = text[len(known) :]
        else:
            # Context text decoded differently with the new ids (a byte run it shared with them):
            # what was already accounted is the common part, the rest is new.
            common = 0
            for a, b in zip(known, text):
                if a != b:
                    break
                common += 1
            new = text[common:]
        if new:
            self._prefix = self._read
        self._read = len(self._ids)
        self._holding, self._waited = False, 0
        return new

    def _undecided(self, text: str, fresh: int) -> bool:
        """Whether the text of the undecided ids may still change with later ids.

        `fresh` is how many of the undecided ids came with the current push.
        """
        if self._facts.byte_fallback_ids:
            # ByteFallback decodes a whole run of byte tokens at once, and one bad byte turns the
            # run into replacement characters: a run's text is final once a text token closes it.
            run = self._open_byte_run()
            if run == 0:
                return False
            if run >= HARD_PENDING_LIMIT:
                return False  # bytes that never make text: stop waiting
            # A long run of good characters flows at character boundaries.
            return run < SOFT_PENDING_LIMIT or text.endswith(_REPLACEMENT)
        # Byte-level BPE and others: a trailing U+FFFD is an unfinished character (done within 3
        # more ids), or bytes that never make one, which stop being waited on after a while.
        if not text.endswith(_REPLACEMENT):
            return False
        if self._holding:
            self._waited += fresh
        self._holding = True
        return self._waited < HARD_PENDING_LIMIT

    def _open_byte_run(self) -> int:
        """Byte tokens at the end of the undecided ids, looking through skipped special tokens."""
        run = 0
        for token_id in reversed(self._ids[self._read :]):
            if self._skip_special and token_id in self._facts.special_ids:
                continue  # skipped tokens do not close a run
            if token_id not in self._facts.byte_fallback_ids:
                break
            run += 1
        return run

    # ---------------------------------------------------------------- text layer

    def _release(self, at_finish: bool) -> str:
        """Emit the decided text that is safe, applying stop strings; may finish the request."""
        held = self._held
        if not held:
            return ""
        if self._stops:
            hit = self._find_stop(held)
            if hit is not None:
                stop, begin = hit
                self._held = ""
                self._finished = True
                self._finished_by = stop
                return held[: begin + len(stop)] if self._include_stop else held[:begin]
        if at_finish:
            self._held = ""
            return held
        cut = len(held) - self._stop_prefix_len(held)
        if self._hold_glyph_tail:
            cut = min(cut, _last_glyph_start(held))
        self._held = held[cut:]
        return held[:cut]

    def _find_stop(self, text: str) -> tuple[str, int] | None:
        """The stop whose first match in `text` ends first (ties: the longer); with its start.

        Ending first is what a character-by-character stream would see, so the result does not
        depend on how the ids were grouped into pushes.
        """
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            begin = text.find(stop)
            if begin >= 0:
                key = (begin + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, _, stop = best
        return stop, end - len(stop)

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _finish(self, stop_token: int | None) -> str:
        self._held += self._decide_text(force=True)
        text = self._release(at_finish=True)
        if not self._finished:
            self._finished = True
            self._finished_by = stop_token
        return text

    def _record(self, text: str) -> DetokDelta:
        if text:
            self._emitted.append(text)
        return DetokDelta(text, self._finished_by if self._finished else None)
