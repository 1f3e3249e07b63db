"""Mutation tests: each plants one known bug in a copy of the ledger's source, and the
property machines (tests/unit/test_ledger_properties.py for `MUTANTS`,
tests/unit/test_ledger_swa_properties.py for the sliding-window `SWA_MUTANTS`), at their
normal settings, must catch it. A mutant whose anchor text no longer exists fails loudly:
update the list with the code."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import actors.allocator.ledger as ledger_module
from kvcore.page_pool import PoolError
from tests.unit.test_ledger_properties import (
    SETTINGS,
    LedgerMachine,
    LedgerMachinePage4,
    LedgerMachinePage16,
)
from tests.unit.test_ledger_swa_properties import (
    SpeculativeSwaLedgerMachine,
    SwaLedgerMachine,
    SwaLedgerMachinePage16,
)

LEDGER_SOURCE = Path(ledger_module.__file__).read_text()

# name -> (text in actors/allocator/ledger.py, what replaces it)
MUTANTS = {
    "cache_unfinished frees duplicates but leaves the row on them": (
        "            if row is not None:\n"
        "                self.table.write(row, start, theirs)\n"
        "                deltas.append(SlotDelta(row, start, theirs))\n",
        "",
    ),
    "admission matches the whole prompt (nothing left to compute)": (
        "cached, node, prefix_slots = await self._match_and_lock(tokens[: total - 1])",
        "cached, node, prefix_slots = await self._match_and_lock(tokens)",
    ),
    "the ledger never evicts": (
        "            freed = await self._evict_tree(missing)"
        " if self.tree is not None else _NO_PAGES\n",
        "            freed = _NO_PAGES\n",
    ),
    "a speculative reservation commits its drafts": (
        "            if k == 0:\n                rec.kv_committed_len = pos + 1\n",
        "            rec.kv_committed_len = pos + n\n",
    ),
    "a draft commit frees the page holding the last committed position": (
        "keep = ceil_page(end, self.page_size)",
        "keep = floor_page(end, self.page_size)",
    ),
    "a draft commit keeps the rejected tail's pages": (
        "            self._free_pages(pages_of_slots(tail, self.page_size))\n",
        "            pass\n",
    ),
    "a finish releases a record with uncommitted draft slots": (
        "if rec is not None and rec.kv_committed_len < rec.kv_allocated_len:",
        "if False:",
    ),
    "forget() drops a held record": (
        'raise LedgerError(f"request {rid} still holds row {rec.req_pool_idx}")',
        "pass",
    ),
}

# Sliding-window bugs, for the machines with a sliding pool, sessions and the prefix tree.
SWA_MUTANTS = {
    "the window frees one page too far": (
        "        hi = floor_page(first_query - self.window + 1, ps)\n",
        "        hi = floor_page(first_query - self.window + 1, ps) + ps\n",
    ),
    "the window-freeing cursor is not advanced": (
        "        rec.swa_evicted_seqlen = hi\n",
        "",
    ),
    "the tree match is not cut where the window lost its KV": (
        "        if usable < match.length:\n",
        "        if False:\n",
    ),
    "the next query's window is read one position short when a match is cut": (
        "first = max(0, end - self.window + 1) // ps",
        "first = max(0, end - self.window + 2) // ps",
    ),
    "unmaps are not sent to the runner": (
        "            deltas.append(SwaMapDelta(pages, np.zeros_like(pages)))\n",
        "            pass\n",
    ),
    "pending unmaps reach the runner after a new mapping of the same page": (
        "            self._send_unmapped(deltas)"
        "  # a page unmapped earlier may be mapped again here\n",
        "",
    ),
    "cache_unfinished swaps dead tree pages into the next chunk's window": (
        "            need_alive_from=need_alive_from,\n",
        "            need_alive_from=None,\n",
    ),
    "a finishing request never heals the tree (its pages all passed as dead)": (
        "                    alive=self._alive(slots[:aligned]),\n",
        "                    alive=None if self.swa is None else self._alive(slots) & False,\n",
    ),
    "a restored turn's floor covers KV the window already freed": (
        "not self.swa_free_prompt and rec.swa_evicted_seqlen == 0:",
        "not self.swa_free_prompt:",
    ),
    "a session restores although its window lost its KV": (
        "swa_ok = slot.rec.swa_evicted_seqlen <= first_read and self._window_alive(",
        "swa_ok = True or self._window_alive(",
    ),
    "an admitted prompt keeps no sliding KV (no floor)": (
        "                rec.swa_evict_floor = total\n",
        "                pass\n",
    ),
    "a draft commit frees the tail's full pages but not their sliding pages": (
        "            self._free_pages(pages_of_slots(tail, self.page_size))\n",
        "            self.pool.free(pages_of_slots(tail, self.page_size))\n",
    ),
    "admission does not count the sliding pool": (
        "swa_short = pages - returning - self.swa.num_free if self.swa is not None else 0",
        "swa_short = 0",
    ),
    # the host tier (the machines draw one in half their runs)
    "a demoted session keeps its pool KV too": (
        "        await self._release_slot_kv(sid, slot, cache=slot.stored is None)\n",
        "        if slot.stored is None:\n"
        "            await self._release_slot_kv(sid, slot, cache=True)\n",
    ),
    "a promotion writes the sliding KV one slot off": (
        "swa_slots = self._sliding_slots(new_slots[saved[lo:hi] - cached])",
        "swa_slots = self._sliding_slots(new_slots[saved[lo:hi] - cached]) + 1",
    ),
    "a promotion loads the entry's positions from the start, not from the tree's end": (
        "await self.tiers.load(handle, cached, full, swa_index, swa_slots)",
        "await self.tiers.load(handle, 0, full, swa_index, swa_slots)",
    ),
    # prefix-tree blocks below the pool (the machines' host tiers keep them)
    "a prefix block keeps pages whose sliding KV is gone": (
        "n = (int(np.argmin(alive)) if not alive.all() else len(alive)) * ps",
        "n = len(alive) * ps",
    ),
    "a loaded prefix block writes its sliding KV one slot off": (
        "swa_slots = self._sliding_slots(full) if self.swa is not None else _NO_PAGES",
        "swa_slots = self._sliding_slots(full) + 1 if self.swa is not None else _NO_PAGES",
    ),
}

MACHINES = (LedgerMachine, LedgerMachinePage4, LedgerMachinePage16)
SWA_MACHINES = (SwaLedgerMachine, SwaLedgerMachinePage16, SpeculativeSwaLedgerMachine)


def mutant_ledger_module(anchor: str, replacement: str) -> types.ModuleType:
    assert LEDGER_SOURCE.count(anchor) == 1, f"mutant anchor not found once: {anchor!r}"
    name = f"_mutant_ledger_{abs(hash(anchor))}"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    exec(compile(LEDGER_SOURCE.replace(anchor, replacement), name, "exec"), module.__dict__)
    module.LedgerError = ledger_module.LedgerError  # the tests expect the real class
    return module


def finished_past_its_window(ledger_class, setup=None):
    """Page size 1, window 4: a request of a 2-token prompt decodes 10 tokens and finishes;
    the tree holds its 12 positions, of which 2..7 lost their sliding KV. (ledger, tokens)"""
    from kvcore import SwaPages
    from tests.unit.ledger_driver import make_ledger, run_sync

    ledger, _ = make_ledger(64, 1, 4, 64, cls=ledger_class)
    ledger.swa, ledger.window, ledger.swa_free_step = SwaPages(64, 64, 1), 4, 1
    if setup is not None:
        setup(ledger)
    hist = np.arange(100, 113, dtype=np.int64)
    run_sync(ledger.alloc_extend(1, hist[:2], 64, []))
    for _ in range(10):
        assert run_sync(ledger.alloc_decode([1], [])) == 0
    run_sync(ledger.finish(1, hist))
    ledger.forget(1)
    return ledger, hist


def match_cut_exactly_at_a_dead_window_start(ledger_class) -> None:
    """Page size 1, window 4: a finished request's output positions 2..7 lost their sliding
    KV; a prompt matching 10 tokens needs position 7 for its first query, so the hit must be
    cut (to 2). (The machines' window oracle finds this only on some paths; this example
    finds it every time.)"""
    from kvcore import check_invariants
    from tests.unit.ledger_driver import run_sync

    ledger, hist = finished_past_its_window(ledger_class)
    prompt = np.concatenate([hist[:10], [7, 8]])
    grant = run_sync(ledger.alloc_extend(2, prompt, 64, []))
    check_invariants(run_sync(ledger.snapshot()))
    assert grant.cached_len == 2, grant


def a_block_keeps_only_its_pages_with_sliding_kv(ledger_class) -> None:
    """Page size 1, window 4: a finished request's tree node [0, 12) lost the sliding KV of
    positions 2..7; pressure evicts it into the host tier. Only [0, 2) may be kept as a
    block: a prompt repeating 10 of its tokens loads 2 and computes the rest."""
    from kvcore import check_invariants
    from kvcore.tiers import KvTier, PrefixIndex
    from tests.unit.ledger_driver import FakeKv, FakeTierPort, run_sync

    def with_blocks(ledger) -> None:
        ledger.tiers = FakeTierPort(FakeKv(65, 1, swa_pages=64))
        ledger.host, ledger.prefix_blocks = KvTier("host", 1 << 20), PrefixIndex(1)

    ledger, hist = finished_past_its_window(ledger_class, with_blocks)
    assert run_sync(ledger.alloc_extend(2, np.arange(60, dtype=np.int64), 64, [])) is not None
    run_sync(ledger.abort(2))
    ledger.forget(2)
    assert ledger.counters.block_demotes == 1
    grant = run_sync(ledger.alloc_extend(3, np.concatenate([hist[:10], [7, 8]]), 64, []))
    check_invariants(run_sync(ledger.snapshot()))
    assert grant.cached_len == 2, grant


def a_promotion_on_a_tree_prefix_loads_only_the_rest(ledger_class) -> None:
    """A demoted session whose first 32 positions the tree holds: its next turn takes them
    from the tree and loads positions [32, 35) from its entry, each with its own KV."""
    from tests.unit.test_ledger_tiers import Driver, demoted_on_a_tree_prefix, toks

    d = Driver(cls=ledger_class)
    hist = demoted_on_a_tree_prefix(d)
    prompt = np.concatenate([hist, toks(3, 7)])
    grant = d.extend(2, prompt, session="s")
    assert grant.cached_len == 35, grant
    d.kv.assert_row_holds(grant.row, prompt, len(prompt))


# Deterministic scenarios run before the machines (a planted bug either catches).
SWA_EXAMPLES = (
    a_promotion_on_a_tree_prefix_loads_only_the_rest,
    match_cut_exactly_at_a_dead_window_start,
    a_block_keeps_only_its_pages_with_sliding_kv,
)


def test_the_examples_pass_on_the_real_ledger():
    for example in SWA_EXAMPLES:
        example(ledger_module.KvLedger)


@pytest.mark.parametrize(
    ("name", "machines"),
    [(name, MACHINES) for name in sorted(MUTANTS)]
    + [(name, SWA_MACHINES) for name in sorted(SWA_MUTANTS)],
    ids=[*sorted(MUTANTS), *sorted(SWA_MUTANTS)],
)
def test_the_property_machines_catch_the_planted_bug(name, machines):
    mutant = mutant_ledger_module(*{**MUTANTS, **SWA_MUTANTS}[name])
    # The machines' own settings, deterministic, and no shrinking: finding is the point.
    quiet = settings(
        SETTINGS,
        database=None,
        derandomize=True,
        print_blob=False,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[*SETTINGS.suppress_health_check, HealthCheck.differing_executors],
    )
    if machines is SWA_MACHINES:
        for example in SWA_EXAMPLES:
            try:
                example(mutant.KvLedger)
            except (AssertionError, mutant.LedgerError) as exc:
                print(f"{name}: caught by {example.__name__}: {type(exc).__name__}: {exc}"[:300])
                return
    for machine in machines:
        planted = type(f"Mutant{machine.__name__}", (machine,), {"ledger_class": mutant.KvLedger})
        try:
            run_state_machine_as_test(planted, settings=quiet)
        except (AssertionError, mutant.LedgerError, PoolError, pytest.fail.Exception) as exc:
            print(f"{name}: caught by {machine.__name__}: {type(exc).__name__}: {exc}"[:300])
            return
    pytest.fail(f"no property machine caught the mutant: {name}")
