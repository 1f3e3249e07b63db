"""The n-gram drafters of speculative decoding (actors/speculation/drafters.py): proposals on
hand-made sequences, the incremental per-request state against a brute-force reference, the
bounds on memory (tracked requests, shared index), and the cost of one propose() call."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import numpy as np
import pytest

from actors.speculation import (
    METHODS,
    PromptLookupDrafter,
    SuffixDrafter,
    make_drafter,
)
from actors.speculation.drafters import MAX_CONTINUATIONS, MAX_TRACKED_REQUESTS


def reference_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: for n from max_n down, the latest start s < len - n with the tail n-gram."""
    size = len(tokens)
    if k <= 0 or size < min_n + 1:
        return []
    for n in range(max_n, min_n - 1, -1):
        tail = tokens[size - n :] if n <= size else None
        for s in range(size - n - 1, -1, -1):
            if tokens[s : s + n] == tail:
                return tokens[s + n : s + n + k]
    return []


class ReferenceSuffix:
    """Brute force of the shared index with no eviction: every (context, next) occurrence of
    the finished outputs is rescanned at each greedy step."""

    def __init__(self, min_n: int, max_n: int, min_count: int = 1):
        self.min_n, self.max_n, self.min_count = min_n, max_n, min_count
        self.finished: list[tuple[list[int], int]] = []

    def learn(self, tokens: list[int], prompt_len: int) -> None:
        self.finished.append((list(tokens), prompt_len))

    def next_token(self, context: list[int]) -> int | None:
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            key = context[-n:]
            counts: dict[int, int] = {}
            last: dict[int, int] = {}
            order = 0
            for tokens, prompt_len in self.finished:
                for p in range(max(prompt_len, n), len(tokens)):
                    order += 1
                    if tokens[p - n : p] == key:
                        counts[tokens[p]] = counts.get(tokens[p], 0) + 1
                        last[tokens[p]] = order
            if counts:
                best = max(counts, key=lambda t: (counts[t], last[t]))
                if counts[best] >= self.min_count:
                    return best
        return None

    def propose(self, tokens: list[int], k: int) -> list[int]:
        own = reference_lookup(tokens, k, self.min_n, self.max_n)
        shared: list[int] = []
        context = list(tokens)
        while k > 0 and len(tokens) >= self.min_n and len(shared) < k:
            token = self.next_token(context)
            if token is None:
                break
            shared.append(token)
            context.append(token)
        return shared if len(shared) > len(own) else own


# --- PromptLookupDrafter on hand-made sequences ---------------------------------------------


def test_copying_a_code_block_proposes_its_continuation():
    block = [101, 7, 42, 8, 300, 9, 42, 11, 12, 13, 14]
    tokens = [1, 2, 3] + block + [50, 51] + block[:4]
    drafter = PromptLookupDrafter(min_n=2, max_n=4)
    assert drafter.propose(1, tokens, 5) == block[4:9]
    assert drafter.propose(1, tokens + block[4:6], 3) == block[6:9]


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # (2, 3, 4) occurs early followed by 100; (3, 4) alone occurs later followed by 200.
    tokens = [2, 3, 4, 100, 0, 9, 3, 4, 200, 0, 2, 3, 4]
    assert PromptLookupDrafter(2, 3).propose(1, tokens, 1) == [100]
    assert PromptLookupDrafter(2, 2).propose(1, tokens, 1) == [200]


def test_most_recent_occurrence_wins():
    tokens = [5, 6, 10, 0, 5, 6, 20, 0, 1, 5, 6]
    assert PromptLookupDrafter(2, 4).propose(1, tokens, 2) == [20, 0]
    tokens = [7, 5, 6, 10, 0, 7, 5, 6, 20, 0, 7, 5, 6]
    assert PromptLookupDrafter(2, 4).propose(1, tokens, 2) == [20, 0]


def test_never_more_than_k_tokens():
    tokens = list(range(20)) + [0, 1]
    drafter = PromptLookupDrafter(2, 4)
    assert drafter.propose(1, tokens, 3) == [2, 3, 4]
    assert drafter.propose(1, tokens, 1) == [2]
    assert drafter.propose(1, tokens, 0) == []
    assert drafter.propose(1, tokens, -1) == []


def test_too_few_tokens_propose_nothing():
    drafter = PromptLookupDrafter(min_n=2, max_n=4)
    assert drafter.propose(1, [], 4) == []
    assert drafter.propose(1, [7, 7], 4) == []
    assert drafter.propose(1, [7, 7, 7], 4) == [7]
    assert PromptLookupDrafter(min_n=3, max_n=4).propose(1, [7, 7, 7], 4) == []


def test_the_tail_never_matches_itself():
    assert PromptLookupDrafter(2, 4).propose(1, [5, 6, 7, 8], 4) == []
    assert PromptLookupDrafter(1, 1).propose(1, [5, 6, 7, 8], 4) == []
    # An earlier occurrence may overlap the tail; it proposes known tokens only.
    assert PromptLookupDrafter(2, 4).propose(1, [9, 1, 1, 1], 4) == [1]
    assert PromptLookupDrafter(2, 2).propose(1, [3, 4, 3, 4], 4) == [3, 4]


def test_below_min_n_nothing_matches():
    # Only a 1-gram recurs: min_n=2 proposes nothing, min_n=1 proposes what followed it.
    tokens = [1, 2, 3, 9, 4, 3]
    assert PromptLookupDrafter(2, 4).propose(1, tokens, 2) == []
    assert PromptLookupDrafter(1, 4).propose(1, tokens, 2) == [9, 4]


def test_any_sequence_type_and_numpy_dtypes():
    tokens = [1, 2, 3, 4, 1, 2]
    for given in (tokens, tuple(tokens), np.array(tokens, np.int32), np.array(tokens, np.int64)):
        assert PromptLookupDrafter(2, 4).propose(1, given, 2) == [3, 4]
        assert all(type(t) is int for t in PromptLookupDrafter(2, 4).propose(1, given, 2))


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 5), (2, 2)])
def test_incremental_state_matches_a_fresh_drafter_and_brute_force(min_n, max_n):
    rng = random.Random(1000 * min_n + max_n)
    for _ in range(25):
        alphabet = rng.randint(2, 5)
        drafter = PromptLookupDrafter(min_n, max_n)
        tokens: list[int] = []
        while len(tokens) < 150:
            tokens += [rng.randrange(alphabet) for _ in range(rng.randint(1, 4))]
            k = rng.randint(1, 6)
            given = np.array(tokens) if rng.random() < 0.3 else list(tokens)
            got = drafter.propose(7, given, k)
            assert got == reference_lookup(tokens, k, min_n, max_n), (tokens, k)
            assert got == PromptLookupDrafter(min_n, max_n).propose(7, tokens, k)


def test_tokens_that_do_not_extend_the_last_call_rebuild_the_state():
    rng = random.Random(5)
    drafter = PromptLookupDrafter(2, 3)
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.5:
            tokens = [t + 10 for t in tokens]  # a different vocabulary: stale data would show
        given = np.array(tokens, np.int64) if rng.random() < 0.3 else tokens
        assert drafter.propose(1, given, 4) == reference_lookup(tokens, 4, 2, 3)


def test_a_changed_middle_token_is_seen():
    drafter = PromptLookupDrafter(2, 4)
    first = [1, 2, 50, 9, 9, 9, 1, 2]
    assert drafter.propose(1, first, 1) == [50]
    changed = [1, 2, 60, 9, 9, 9, 1, 2, 8]
    assert drafter.propose(1, changed[:-1], 1) == [60]
    assert drafter.propose(1, np.array(first), 1) == [50]


def test_tracked_requests_are_capped_and_dropped():
    drafter = PromptLookupDrafter(2, 4, max_requests=8)
    tokens = [1, 2, 3, 1, 2]
    for rid in range(100):
        assert drafter.propose(rid, tokens, 2) == [3, 1]
        assert drafter.tracked_requests <= 8
    assert drafter.tracked_requests == 8
    assert drafter.propose(0, tokens + [3], 2) == [1, 2]  # evicted long ago: rebuilt
    drafter.finished(0, tokens + [3], prompt_len=5)
    drafter.forget(99)
    drafter.forget(12345)
    assert drafter.tracked_requests == 6
    assert PromptLookupDrafter().max_requests == MAX_TRACKED_REQUESTS == 4096


def test_least_recently_proposed_request_is_dropped_first():
    drafter = PromptLookupDrafter(2, 4, max_requests=2)
    drafter.propose(1, [1, 2, 1], 1)
    drafter.propose(2, [1, 2, 1], 1)
    drafter.propose(1, [1, 2, 1, 2], 1)
    drafter.propose(3, [1, 2, 1], 1)
    assert set(drafter._histories) == {1, 3}


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        PromptLookupDrafter(3, 2)
    with pytest.raises(ValueError, match="min_n"):
        PromptLookupDrafter(0, 2)
    with pytest.raises(ValueError, match="max_requests"):
        PromptLookupDrafter(2, 4, max_requests=0)
    with pytest.raises(ValueError, match="max_entries"):
        SuffixDrafter(2, 4, max_entries=0)
    with pytest.raises(ValueError, match="min_count"):
        SuffixDrafter(2, 4, min_count=0)


# --- SuffixDrafter ----------------------------------------------------------------------------

TOOL_CALL = [900, 901, 77, 902, 5, 903, 904, 6, 905, 906, 907]


def test_a_finished_output_drafts_for_a_new_request_with_another_prompt():
    drafter = SuffixDrafter(2, 4)
    first_prompt = [11, 12, 13, 14, 15]
    drafter.finished(1, first_prompt + TOOL_CALL, prompt_len=len(first_prompt))
    assert drafter.tracked_requests == 0

    other = [21, 22, 23, 24] + TOOL_CALL[:3]
    assert PromptLookupDrafter(2, 4).propose(2, other, 5) == []
    assert drafter.propose(2, other, 5) == TOOL_CALL[3:8]
    assert drafter.propose(2, other + TOOL_CALL[3:5], 10) == TOOL_CALL[5:]


def test_the_prompt_is_context_never_a_continuation():
    drafter = SuffixDrafter(2, 2)
    drafter.finished(1, [1, 2, 3, 4, 5, 6], prompt_len=4)
    assert drafter.propose(2, [8, 1, 2], 3) == []  # (1, 2) -> 3 is prompt-only
    assert drafter.propose(3, [8, 3, 4], 3) == [5, 6]  # context from the prompt, output after


def test_the_most_frequent_continuation_wins_ties_to_the_most_recent():
    drafter = SuffixDrafter(2, 2)
    drafter.finished(1, [0, 1, 2, 10], prompt_len=0)
    drafter.finished(2, [0, 1, 2, 20], prompt_len=0)
    assert drafter.propose(9, [5, 1, 2], 1) == [20]
    drafter.finished(3, [0, 1, 2, 10], prompt_len=0)
    assert drafter.propose(9, [5, 1, 2], 1) == [10]


def test_min_count_holds_back_rare_continuations():
    drafter = SuffixDrafter(2, 2, min_count=2)
    drafter.finished(1, [1, 2, 3, 4], prompt_len=0)
    assert drafter.propose(9, [7, 1, 2], 2) == []
    drafter.finished(2, [1, 2, 3, 5], prompt_len=0)
    assert drafter.propose(9, [7, 1, 2], 2) == [3]


def test_the_longest_present_context_leads_each_step():
    drafter = SuffixDrafter(2, 3)
    drafter.finished(1, [4, 1, 2, 30, 31], prompt_len=0)
    drafter.finished(2, [5, 1, 2, 40, 41], prompt_len=0)
    assert drafter.propose(9, [4, 1, 2], 2) == [30, 31]
    assert drafter.propose(10, [6, 1, 2], 2) == [40, 41]


def test_the_longer_of_own_and_shared_wins_own_on_a_tie():
    drafter = SuffixDrafter(2, 2)
    drafter.finished(1, [1, 2, 3, 4, 5, 6], prompt_len=0)
    own_longer = [1, 2, 70, 71, 72, 9, 1, 2]
    assert drafter.propose(2, own_longer, 6) == [70, 71, 72, 9, 1, 2]
    shared_longer = [9, 1, 2, 1, 2]
    assert drafter.propose(3, shared_longer, 4) == [3, 4, 5, 6]
    assert drafter.propose(3, shared_longer, 2) == [1, 2]


@pytest.mark.parametrize("min_n,max_n,min_count", [(1, 2, 1), (2, 4, 1), (2, 3, 2), (3, 3, 1)])
def test_suffix_proposals_match_a_brute_force_reference(min_n, max_n, min_count):
    rng = random.Random(min_n * 100 + max_n * 10 + min_count)
    drafter = SuffixDrafter(min_n, max_n, min_count=min_count)
    reference = ReferenceSuffix(min_n, max_n, min_count)
    for rid in range(30):
        alphabet = rng.randint(2, 6)
        prompt_len = rng.randint(0, 10)
        tokens = [rng.randrange(alphabet) for _ in range(prompt_len)]
        for _ in range(rng.randint(1, 30)):
            tokens += [rng.randrange(alphabet) for _ in range(rng.randint(1, 3))]
            k = rng.randint(1, 6)
            assert drafter.propose(rid, tokens, k) == reference.propose(tokens, k), (rid, tokens)
        if rng.random() < 0.8:
            drafter.finished(rid, np.array(tokens) if rid % 3 else tokens, prompt_len)
            reference.learn(tokens, prompt_len)
        else:
            drafter.forget(rid)
        assert drafter.tracked_requests == 0


def test_the_shared_index_stays_bounded():
    rng = random.Random(3)
    drafter = SuffixDrafter(2, 4, max_entries=500)
    for rid in range(200):
        tokens = [rng.randrange(40) for _ in range(rng.randint(10, 200))]
        drafter.propose(rid, tokens, 4)
        drafter.finished(rid, tokens, prompt_len=rng.randint(0, 10))
        assert drafter.index_size <= 500
        assert all(len(nexts) <= MAX_CONTINUATIONS for nexts in drafter._index.values())
    assert drafter.index_size == 500
    assert drafter.tracked_requests == 0


def test_many_continuations_keep_the_frequent_one_and_admit_the_newest():
    drafter = SuffixDrafter(2, 2)
    for _ in range(3):
        drafter.finished(0, [1, 2, 99], prompt_len=0)
    for token in range(100, 100 + 2 * MAX_CONTINUATIONS):
        drafter.finished(token, [1, 2, token], prompt_len=0)
    assert len(drafter._index[(1, 2)]) == MAX_CONTINUATIONS
    assert 99 in drafter._index[(1, 2)]
    assert 99 + 2 * MAX_CONTINUATIONS in drafter._index[(1, 2)]
    assert drafter.propose(5, [0, 1, 2], 1) == [99]


def test_least_recently_used_contexts_are_evicted_first():
    drafter = SuffixDrafter(2, 2, max_entries=4)
    for rid in (1, 2, 3):  # one context each: (10, 11) -> 12, (20, 21) -> 22, (30, 31) -> 32
        drafter.finished(rid, [10 * rid, 10 * rid + 1, 10 * rid + 2], prompt_len=0)
    assert drafter.index_size == 3
    assert drafter.propose(9, [0, 10, 11], 1) == [12]  # used: now the most recent
    for rid in (4, 5, 6):
        drafter.finished(rid, [10 * rid, 10 * rid + 1, 10 * rid + 2], prompt_len=0)
    assert drafter.index_size == 4
    assert drafter.propose(9, [0, 20, 21], 1) == []
    assert drafter.propose(9, [0, 30, 31], 1) == []
    assert drafter.propose(9, [0, 10, 11], 1) == [12]
    assert drafter.propose(9, [0, 50, 51], 1) == [52]


# --- make_drafter -----------------------------------------------------------------------------


def test_make_drafter():
    assert make_drafter("none", 2, 4) is None
    ngram = make_drafter("ngram", 1, 3)
    assert isinstance(ngram, PromptLookupDrafter) and (ngram.min_n, ngram.max_n) == (1, 3)
    suffix = make_drafter("suffix", 2, 5, max_entries=1000)
    assert isinstance(suffix, SuffixDrafter)
    assert (suffix.min_n, suffix.max_n, suffix.max_entries) == (2, 5, 1000)
    assert METHODS == ("none", "ngram", "suffix")
    for bad in ("eagle", "", "NGRAM"):
        with pytest.raises(ValueError, match="none, ngram, suffix"):
            make_drafter(bad, 2, 4)
    with pytest.raises(ValueError, match="min_n"):
        make_drafter("ngram", 4, 2)


def test_the_module_imports_no_torch_and_no_actor():
    code = (
        "import sys; import actors.speculation; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('actors.') "
        "and not m.startswith('actors.speculation')]; print(bad); assert not bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- cost ---------------------------------------------------------------------------------------


def test_propose_cost_on_a_32k_context(capsys):
    """Prints (never asserts) the cost of one call as a decode step makes it: 32k known tokens,
    one more each call, passed as the scheduler would (a fresh list, or an array)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 32_000, 32_768).tolist()
    prompt[-200:] = prompt[1000:1200]  # the tail copies earlier text: proposals are found
    suffix = SuffixDrafter()
    learnt = rng.integers(0, 32_000, 2048).tolist()
    start = time.perf_counter()
    suffix.finished(0, prompt + learnt, len(prompt))
    rows = [f"suffix finished() learning 2048 output tokens: {_ms(start)}"]
    steps = 300
    for name, drafter in (("ngram", PromptLookupDrafter()), ("suffix", suffix)):
        for kind, as_input in (("list", list), ("numpy", np.array)):
            start = time.perf_counter()
            drafter.propose(1, as_input(prompt), 4)
            first = _ms(start)
            output: list[int] = []
            spent = 0.0
            for step in range(steps):
                output.append(prompt[1200 + step] if step % 4 else int(rng.integers(32_000)))
                tokens = as_input(prompt + output)
                start = time.perf_counter()
                drafter.propose(1, tokens, 4)
                spent += time.perf_counter() - start
            drafter.forget(1)
            rows.append(f"{name} {kind}: first call {first}, then {spent / steps * 1e6:.1f} us")
    with capsys.disabled():
        print("\npropose() on a 32,768-token context, k=4:\n  " + "\n  ".join(rows))


def _ms(start: float) -> str:
    return f"{(time.perf_counter() - start) * 1e3:.2f} ms"
