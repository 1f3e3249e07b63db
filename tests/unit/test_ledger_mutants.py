"""Mutation tests: each plants one known bug in a copy of the ledger's source, and the
property machines of tests/unit/test_ledger_properties.py, at their normal settings, must
catch it. A mutant whose anchor text no longer exists fails loudly: update the list with
the code."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import actors.allocator.ledger as ledger_module
from tests.unit.test_ledger_properties import (
    SETTINGS,
    LedgerMachine,
    LedgerMachinePage4,
    LedgerMachinePage16,
)

LEDGER_SOURCE = Path(ledger_module.__file__).read_text()

# name -> (text in actors/allocator/ledger.py, what replaces it)
MUTANTS = {
    "cache_unfinished frees duplicates but leaves the row on them": (
        "            self.table.write(row, rec.cache_protected_len, tree_part)\n"
        "            deltas.append(SlotDelta(row, rec.cache_protected_len, tree_part))\n",
        "",
    ),
    "admission matches the whole prompt (nothing left to compute)": (
        "match = await self.tree.match_and_lock(tokens[: total - 1])",
        "match = await self.tree.match_and_lock(tokens)",
    ),
    "the ledger never evicts": (
        "            freed = await self.tree.evict(missing)\n",
        "            freed = np.zeros(0, dtype=np.int64)\n",
    ),
    "forget() drops a held record": (
        'raise LedgerError(f"request {rid} still holds row {rec.req_pool_idx}")',
        "pass",
    ),
}


def mutant_ledger_module(anchor: str, replacement: str) -> types.ModuleType:
    assert LEDGER_SOURCE.count(anchor) == 1, f"mutant anchor not found once: {anchor!r}"
    name = f"_mutant_ledger_{abs(hash(anchor))}"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    exec(compile(LEDGER_SOURCE.replace(anchor, replacement), name, "exec"), module.__dict__)
    module.LedgerError = ledger_module.LedgerError  # the tests expect the real class
    return module


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_the_property_machines_catch_the_planted_bug(name):
    mutant = mutant_ledger_module(*MUTANTS[name])
    # The machines' own settings, deterministic, and no shrinking: finding is the point.
    quiet = settings(
        SETTINGS,
        database=None,
        derandomize=True,
        print_blob=False,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[*SETTINGS.suppress_health_check, HealthCheck.differing_executors],
    )
    for machine in (LedgerMachine, LedgerMachinePage4, LedgerMachinePage16):
        planted = type(f"Mutant{machine.__name__}", (machine,), {"ledger_class": mutant.KvLedger})
        try:
            run_state_machine_as_test(planted, settings=quiet)
        except (AssertionError, mutant.LedgerError, pytest.fail.Exception) as exc:
            print(f"{name}: caught by {machine.__name__}: {type(exc).__name__}: {exc}"[:300])
            return
    pytest.fail(f"no property machine caught the mutant: {name}")
