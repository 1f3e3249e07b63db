"""N-gram drafters for speculative decoding: cheap guesses of the tokens a request will emit next.

The scheduler calls a drafter synchronously in its step loop, once per running request per
decode step, so everything here is pure Python + numpy and costs little per call:

- `PromptLookupDrafter` (vLLM "ngram", llama.cpp lookup): the request's tail n-gram is looked
  up in the request's own known tokens (prompt + output) and what followed its most recent
  earlier occurrence is proposed. Per request it keeps the tokens seen so far (a numpy buffer
  that only the new tokens extend, and the same tokens as a list, to check that the next call's
  tokens extend them); one call is a vectorized scan of the buffer, O(context) at numpy speed.
- `SuffixDrafter` (vLLM "suffix" decoding, simplified): the same lookup in the request's own
  tokens, and a shared, bounded index of the outputs of earlier finished requests, so a
  repeated tool or agent output drafts from the requests that produced it before.

A draft is only a guess: the target model verifies it, so a drafter affects speed, never
output. Token ids are ints >= 0; `tokens` may be a list, a numpy array or any sequence.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np

MAX_TRACKED_REQUESTS = 4096
MAX_CONTINUATIONS = 8
METHODS = ("none", "ngram", "suffix")


class Drafter(Protocol):
    """Proposes up to k draft tokens to follow a request's known tokens (prompt + output)."""

    def propose(self, rid: int, tokens: Sequence[int], k: int) -> list[int]:
        """At most `k` tokens guessed to follow `tokens`; [] when there is no guess."""
        ...

    def finished(self, rid: int, tokens: Sequence[int], prompt_len: int) -> None:
        """The request ended with `tokens` (prompt + output): drop its state, learn from it."""
        ...

    def forget(self, rid: int) -> None:
        """Drop the request's state without learning from it (aborted, errored)."""
        ...


def lookup(buf: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """The up to `k` tokens that followed the most recent earlier occurrence of the longest
    tail n-gram of `buf` (n in [min_n, max_n]); [] when no n-gram in that range recurs.

    An occurrence is earlier when it ends before the last token: it may overlap the tail, and
    what it proposes may run into the tail, but every proposed token is a known one.
    """
    if k <= 0 or len(buf) < min_n + 1:
        return []
    ends = np.flatnonzero(buf[:-1] == buf[-1])
    length = 1
    while length < max_n:
        room = ends[ends >= length]
        longer = room[buf[room - length] == buf[-1 - length]]
        if longer.size == 0:
            break
        ends, length = longer, length + 1
    if ends.size == 0 or length < min_n:
        return []
    start = int(ends[-1]) + 1
    return buf[start : start + k].tolist()


def _check_n(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")


def _as_tokens(tokens: Sequence[int]) -> list[int] | np.ndarray:
    return tokens if isinstance(tokens, (list, np.ndarray)) else list(tokens)


class _History:
    """The tokens of one request seen so far: `buf[:size]` and `seen` hold the same ids."""

    def __init__(self) -> None:
        self.buf = np.empty(64, dtype=np.int64)
        self.size = 0
        self.seen: list[int] = []

    def extended_by(self, tokens: list[int] | np.ndarray) -> bool:
        """Whether `tokens` starts with every token seen so far."""
        n = self.size
        if len(tokens) < n:
            return False
        if isinstance(tokens, np.ndarray):
            return bool(np.array_equal(tokens[:n], self.buf[:n]))
        return tokens[:n] == self.seen

    def extend(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """Append `tokens[size:]` (`tokens` extends what was seen); the whole history."""
        new = tokens[self.size :]
        end = self.size + len(new)
        if end > len(self.buf):
            grown = np.empty(max(2 * len(self.buf), end), dtype=np.int64)
            grown[: self.size] = self.buf[: self.size]
            self.buf = grown
        self.buf[self.size : end] = new
        self.seen.extend(new.tolist() if isinstance(new, np.ndarray) else new)
        self.size = end
        return self.buf[:end]


class PromptLookupDrafter:
    """Drafts from the request's own tokens: the longest recurring tail n-gram, n from max_n
    down to min_n, proposes what followed its most recent earlier occurrence.

    Per-request state is rebuilt whenever a call's tokens do not extend the last call's, so a
    proposal always comes from the tokens passed; at most `max_requests` requests are tracked
    (least recently proposed for dropped first), so a rid never finished costs bounded memory.
    """

    def __init__(self, min_n: int = 2, max_n: int = 4, *, max_requests: int = MAX_TRACKED_REQUESTS):
        _check_n(min_n, max_n)
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_requests = max_requests
        self._histories: OrderedDict[int, _History] = OrderedDict()

    @property
    def tracked_requests(self) -> int:
        return len(self._histories)

    def propose(self, rid: int, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        return lookup(self._history(rid, _as_tokens(tokens)), k, self.min_n, self.max_n)

    def finished(self, rid: int, tokens: Sequence[int], prompt_len: int) -> None:
        self.forget(rid)

    def forget(self, rid: int) -> None:
        self._histories.pop(rid, None)

    def _history(self, rid: int, tokens: list[int] | np.ndarray) -> np.ndarray:
        history = self._histories.get(rid)
        if history is None or not history.extended_by(tokens):
            history = self._histories[rid] = _History()
            if len(self._histories) > self.max_requests:
                self._histories.popitem(last=False)
        self._histories.move_to_end(rid)
        return history.extend(tokens)


class SuffixDrafter:
    """Drafts from the request's own tokens (as `PromptLookupDrafter`) and from a shared index
    of earlier finished requests' outputs; the longer proposal wins, the own one on a tie.

    The index maps a context n-gram (n in [min_n, max_n]) to counts of the output token that
    followed it; a context may reach back into its request's prompt, a counted token is always
    an output token. It holds at most `max_entries` contexts (least recently used evicted) and
    at most `MAX_CONTINUATIONS` tokens per context (a new token evicts the least frequent,
    oldest on a tie). A shared proposal extends the tokens greedily, one token at a time, with
    the most frequent continuation (ties to the most recently counted) of the longest context
    that has one counted at least `min_count` times.
    """

    def __init__(
        self,
        min_n: int = 2,
        max_n: int = 4,
        max_entries: int = 200_000,
        min_count: int = 1,
        *,
        max_requests: int = MAX_TRACKED_REQUESTS,
    ):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        self._own = PromptLookupDrafter(min_n, max_n, max_requests=max_requests)
        self.min_n = min_n
        self.max_n = max_n
        self.max_entries = max_entries
        self.min_count = min_count
        self._index: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()

    @property
    def tracked_requests(self) -> int:
        return self._own.tracked_requests

    @property
    def index_size(self) -> int:
        """Contexts in the shared index (<= max_entries)."""
        return len(self._index)

    def propose(self, rid: int, tokens: Sequence[int], k: int) -> list[int]:
        own = self._own.propose(rid, tokens, k)
        if len(own) >= k:
            return own
        shared = self._from_index(tokens, k)
        return shared if len(shared) > len(own) else own

    def finished(self, rid: int, tokens: Sequence[int], prompt_len: int) -> None:
        self._own.forget(rid)
        start = max(prompt_len - self.max_n, 0)
        tail = tokens[start:]
        seq = tail.tolist() if isinstance(tail, np.ndarray) else list(tail)
        for p in range(prompt_len - start, len(seq)):
            for n in range(self.min_n, min(self.max_n, p) + 1):
                self._count(tuple(seq[p - n : p]), seq[p])

    def forget(self, rid: int) -> None:
        self._own.forget(rid)

    def _count(self, context: tuple[int, ...], token: int) -> None:
        nexts = self._index.get(context)
        if nexts is None:
            nexts = self._index[context] = {}
            if len(self._index) > self.max_entries:
                self._index.popitem(last=False)
        else:
            self._index.move_to_end(context)
        nexts[token] = nexts.pop(token, 0) + 1
        if len(nexts) > MAX_CONTINUATIONS:
            older = itertools.islice(nexts, len(nexts) - 1)
            del nexts[min(older, key=nexts.__getitem__)]

    def _from_index(self, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0 or not self._index or len(tokens) < self.min_n:
            return []
        tail = tokens[-self.max_n :]
        context = tail.tolist() if isinstance(tail, np.ndarray) else list(tail)
        out: list[int] = []
        while len(out) < k:
            token = self._next(context)
            if token is None:
                break
            out.append(token)
            context = context[1:] + [token] if len(context) == self.max_n else context + [token]
        return out

    def _next(self, context: list[int]) -> int | None:
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            key = tuple(context[-n:])
            nexts = self._index.get(key)
            if nexts:
                best = max(reversed(nexts), key=nexts.__getitem__)
                if nexts[best] >= self.min_count:
                    self._index.move_to_end(key)
                    return best
        return None


def make_drafter(method: str, min_n: int, max_n: int, max_entries: int = 200_000) -> Drafter | None:
    """The drafter a config names: "none" -> None, "ngram" -> PromptLookupDrafter,
    "suffix" -> SuffixDrafter; anything else is a ValueError naming the choices."""
    if method == "none":
        return None
    if method == "ngram":
        return PromptLookupDrafter(min_n, max_n)
    if method == "suffix":
        return SuffixDrafter(min_n, max_n, max_entries)
    raise ValueError(f"unknown speculative method {method!r}; choose one of {', '.join(METHODS)}")
