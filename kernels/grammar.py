"""Constrained decoding through xgrammar: compile a constraint once, track one matcher per
request, mask the logits rows of the requests that have one.

Why xgrammar (`bin/engine bench grammar --llguidance` compares the two on the served
vocabulary; figures in docs/benchmarks.md): its tokenizer preparation, paid once per
process, is faster than llguidance's, though llguidance compiles a schema faster, and its
structural tags express tool calls ("free text, and a JSON-schema-checked call after each
trigger"). Its CPU `apply_token_bitmask_inplace` kernel
writes the refused tokens one at a time, which is fast inside a JSON string (few refused)
and slow between fields (all but a handful refused); `apply_token_bitmask` uses it for the
first kind of row only and saves-fills-restores the second.

- `GrammarEngine` (one per tokenizer and process, `GrammarEngine.shared`): compiles
  constraints (kind + spec, see `compile`) into xgrammar `CompiledGrammar`s, cached by
  `constraint_key` (bounded in bytes); serializes them so a grammar compiled where the
  request is validated (the tokenizer actor) is loaded, not compiled again, where it is
  matched (the runner, which receives it once per key, not with every request).
- `ByteLRU`: the least-recently-used map bounded in bytes that every grammar cache uses (a
  compiled grammar can be tens of MiB: counting entries bounds nothing).
- `TokenMatcher`: one request's position in its grammar; the sampler fills its bitmask row
  before a step and advances it with the chosen token after.

Invariant: a matcher has accepted exactly the tokens sampled for its request (prompt tokens
are never fed to it), so a retracted and re-prefilled request keeps its matcher as it is.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported where it is used: the tokenizer's process needs none
    from torch import Tensor

CACHE_BYTES = 256 << 20  # compiled grammars kept per engine (least recently used dropped)
_SOURCE_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; the message says why."""


def grammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def constraint_key(kind: str, spec: str, choices: list[str] | tuple[str, ...] = ()) -> str:
    """A stable name for a constraint: equal constraints share one compiled grammar."""
    text = json.dumps([kind, spec, list(choices)], ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def choice_grammar(choices: list[str] | tuple[str, ...]) -> str:
    """EBNF whose language is exactly the given strings."""
    if not choices:
        raise GrammarError("choice: give at least one string")
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    if not text:
        return '""'
    # JSON string escapes (\" \\ \n \t) are what xgrammar's EBNF literals accept; other
    # characters stay literal (a \uXXXX escape of a surrogate pair would read as two lone
    # surrogates).
    return json.dumps(text, ensure_ascii=False)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_NOT_SCHEMAS = ("enum", "const", "examples", "default", "required")


def refuse_ignored_keywords(schema: Any, where: str = "$") -> None:
    """Raise `GrammarError` for JSON-schema keywords xgrammar would silently ignore (it only
    logs a warning), so no output is promised valid while breaking them."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            refuse_ignored_keywords(item, f"{where}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise GrammarError(
            f"json_schema: at {where}: pattern together with minLength/maxLength is not "
            "supported (put the length into the pattern)"
        )
    if "multipleOf" in schema and schema.get("type") != "integer":
        raise GrammarError(f"json_schema: at {where}: multipleOf is only supported on integers")
    if schema.get("uniqueItems") is True:
        raise GrammarError(f"json_schema: at {where}: uniqueItems is not supported")
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> schemas
            for name, sub in value.items():
                refuse_ignored_keywords(sub, f"{where}.{key}.{name}")
        elif isinstance(value, dict | list) and key not in _NOT_SCHEMAS:
            refuse_ignored_keywords(value, f"{where}.{key}")


def _embedded_schemas(node: Any):
    """The JSON schemas inside a structural tag (the values of its `json_schema` keys)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "json_schema" and isinstance(value, dict):
                yield value
            else:
                yield from _embedded_schemas(value)
    elif isinstance(node, list):
        for item in node:
            yield from _embedded_schemas(item)


class ByteLRU:
    """key -> value, least recently used dropped first once the values' sizes exceed
    `max_bytes`; a value larger than `max_bytes` alone is not kept. Thread-safe.

    Invariant: `nbytes` is the sum of the kept values' sizes and `nbytes <= max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        """The value (now the most recently used), or None."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: str, value: Any, size: int) -> bool:
        """Keep `value` under `key`; False when it is larger than the whole bound."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            if size > self.max_bytes:
                return False
            self._items[key] = (value, size)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.nbytes -= dropped
            return True

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)


def grammar_nbytes(compiled: Any) -> int:
    """The memory a compiled grammar holds (xgrammar's own count)."""
    return int(compiled.memory_size_bytes)


class GrammarEngine:
    """Compiles and loads grammars for one tokenizer (thread-safe)."""

    _shared: dict[tuple, GrammarEngine] = {}
    _shared_lock = threading.Lock()

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: list[int],
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        """`tokenizer`: a `tokenizers.Tokenizer`; `vocab_size`: the logits width it is
        matched against; `stop_ids`: the tokens that end a generation (EOS); `cache_bytes`:
        the bound of the compiled grammars kept."""
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self._xgr = xgr
        if not stop_ids:
            raise GrammarError("constrained output needs the model's end-of-sequence token")
        # Special tokens (turn markers, <bos>, <pad>, image markers) must never match text:
        # left out of the vocabulary xgrammar sees, they become its "special" tokens, which
        # no grammar allows. The stop tokens stay: they end a finished grammar.
        drop = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special} - set(
            stop_ids
        )

        class WithoutSpecials(PreTrainedTokenizerFast):
            def get_vocab(self) -> dict[str, int]:
                return {t: i for t, i in super().get_vocab().items() if i not in drop}

        hf = WithoutSpecials(tokenizer_object=tokenizer)
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
        )
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        # Our own cache (xgrammar's would key on text only and never drop entries).
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache = ByteLRU(cache_bytes)
        self.compiled = 0  # grammars compiled (cache misses), for tests and stats
        self.loaded = 0  # grammars deserialized

    @classmethod
    def shared(
        cls, source: str, tokenizer: Any, vocab_size: int, stop_ids: list[int]
    ) -> GrammarEngine:
        """The process's engine for this tokenizer (`source` names it), built on first use:
        actors of one process share its tokenizer preparation and its compiled grammars."""
        key = (source, vocab_size, tuple(stop_ids))
        with cls._shared_lock:
            engine = cls._shared.get(key)
            if engine is None:
                engine = cls._shared[key] = cls(tokenizer, vocab_size, stop_ids)
            return engine

    # ---- compile ---------------------------------------------------------------------------
    def compile(self, kind: str, spec: str = "", choices: list[str] | tuple[str, ...] = ()) -> Any:
        """The compiled grammar of a constraint (from the cache when compiled before).

        kind: `json_object` (any JSON object), `json_schema` (spec: the schema's JSON text),
        `regex`, `choice` (one of `choices`, exactly), `grammar` (spec: EBNF with a `root`
        rule), `structural_tag` (spec: an xgrammar structural tag's JSON). Raises
        `GrammarError` naming the problem."""
        key = constraint_key(kind, spec, choices)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compile(kind, spec, choices)
            self._cache.put(key, compiled, grammar_nbytes(compiled))
            self.compiled += 1
        return compiled

    def _compile(self, kind: str, spec: str, choices) -> Any:
        c = self._compiler
        try:
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "json_schema":
                refuse_ignored_keywords(json.loads(spec))
                return c.compile_json_schema(spec, any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(choices))
            if kind == "grammar":
                return c.compile_grammar(spec)
            if kind == "structural_tag":
                for schema in _embedded_schemas(json.loads(spec)):
                    refuse_ignored_keywords(schema)
                return c.compile_structural_tag(spec)
        except GrammarError:
            raise
        except json.JSONDecodeError as exc:
            raise GrammarError(f"{kind}: not valid JSON: {exc}") from None
        except Exception as exc:  # xgrammar reports every compile failure as an exception
            lines = str(exc).strip().splitlines()
            # "[17:26:03] /project/cpp/regex_converter.cc:94: Regex parsing error ..."
            text = _SOURCE_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
            raise GrammarError(f"{kind}: {text}"[:500]) from None
        raise GrammarError(f"unknown constraint kind {kind!r}; use one of {', '.join(KINDS)}")

    # ---- ship between processes ------------------------------------------------------------
    def compile_serialized(
        self, kind: str, spec: str = "", choices: list[str] | tuple[str, ...] = ()
    ) -> bytes:
        """The constraint compiled and serialized for `load` in another actor or process. Not
        cached here (the caller keeps the bytes it ships, bounded in bytes)."""
        compiled = self._cache.get(constraint_key(kind, spec, choices))
        if compiled is None:
            compiled = self._compile(kind, spec, choices)
            self.compiled += 1
        return compiled.serialize_json().encode()

    def load(self, key: str, data: bytes) -> Any:
        """The compiled grammar named `key`: from the cache, else deserialized from `data`."""
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self.deserialize(data)
            self._cache.put(key, compiled, grammar_nbytes(compiled))
        return compiled

    def deserialize(self, data: bytes) -> Any:
        """A grammar from `compile_serialized`'s bytes (not cached here)."""
        try:
            compiled = self._xgr.CompiledGrammar.deserialize_json(data.decode(), self.info)
        except Exception as exc:
            raise GrammarError(f"a serialized grammar does not load: {exc}"[:500]) from None
        self.loaded += 1
        return compiled

    def matcher(self, compiled: Any) -> TokenMatcher:
        return TokenMatcher(self._xgr.GrammarMatcher(compiled), self.stop_ids, self.vocab_size)

    def bitmask(self, rows: int) -> Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)


class TokenMatcher:
    """One request's matcher. After its grammar ends (a stop token accepted), only stop
    tokens are allowed (a request held open by `min_tokens` keeps emitting them)."""

    def __init__(self, matcher: Any, stop_ids: list[int], vocab_size: int) -> None:
        self._matcher = matcher
        self.stop_ids = stop_ids
        self.vocab_size = vocab_size  # the bitmask covers tokens [0, vocab_size)
        self.rejected = 0  # tokens the grammar refused (none when every step was masked)

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            words = bitmask[row]
            words.zero_()
            for t in self.stop_ids:
                words[t // 32] |= _bit(t % 32)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        if self._matcher.is_terminated():
            return token in self.stop_ids
        ok = bool(self._matcher.accept_token(token))
        self.rejected += not ok
        return ok


def _bit(position: int) -> int:
    """Bit `position` of an int32 word, as the signed value torch stores."""
    value = 1 << position
    return value - (1 << 32) if position == 31 else value


def apply_token_bitmask(
    logits: Tensor, bitmask: Tensor, rows: list[int], vocab_size: int | None = None
) -> None:
    """Set to -inf, in place, every logit of `logits[rows[j]]` whose bit in `bitmask[j]` is
    0 (bit t of word t // 32 allows token t); columns from `vocab_size` (the grammar's
    vocabulary; default: every bit) on are masked too, whatever their bits say.

    Cost per row follows the smaller side. A row allowing few tokens (JSON punctuation, a
    number) saves them (found by unpacking only its nonzero words), fills the row with -inf
    and puts them back; xgrammar's CPU kernel, which costs per refused token, would write
    -inf one token at a time there. A row allowing most (inside a string) goes to that
    kernel, which skips the all-allowed words."""
    from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu

    width = logits.shape[1]
    limit = min(width, vocab_size or width, bitmask.shape[1] * 32)
    words = bitmask[: len(rows)].numpy().view(np.uint32)
    # Rows most of whose words allow every token in them are the dense ones.
    dense = np.count_nonzero(words == 0xFFFFFFFF, axis=1) * 2 > words.shape[1]
    for j in np.flatnonzero(dense).tolist():
        line = logits[rows[j]]
        apply_token_bitmask_inplace_cpu(line, bitmask[j], vocab_size=limit)
        line[limit:] = -float("inf")
    sparse = np.flatnonzero(~dense)
    if sparse.size == 0:
        return
    # Every allowed (row, token) of the sparse rows at once, from their nonzero words only.
    sub = words[sparse]
    r, c = np.nonzero(sub)
    bits = np.unpackbits(sub[r, c].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    hit_word, hit_bit = np.nonzero(bits)
    tokens = c[hit_word] * 32 + hit_bit
    keep = tokens < limit
    target_rows = np.asarray(rows, dtype=np.int64)[sparse]
    import torch

    flat_index = torch.from_numpy(target_rows[r[hit_word]][keep] * width + tokens[keep])
    flat = logits.view(-1)
    kept = flat[flat_index]
    for row in target_rows.tolist():  # row by row: twice as fast as index_fill_ here
        logits[row].fill_(-float("inf"))
    flat[flat_index] = kept
