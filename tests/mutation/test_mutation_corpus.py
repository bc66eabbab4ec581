"""Mutation testing of sleuth's static reading on our corpus and on our own trainer's source.

Every operator in mutation_operators.py plants its defect at every site it finds (up to two per operator per
implementation) in each tests/fixtures/impls case and in trainer/ (diagnosed with the reference config, as
a run of ours would be). The test prints recall, unknowns, silent false matches and false alarms, and
fails on any silent false match (a planted defect reported `match`) or false alarm (a mismatch where
nothing was planted, or where a rewrite changed nothing that matters).

    python tests/mutation/mutation_harness.py        the same table, by hand
"""

from __future__ import annotations

import pytest
from mutation_harness import default_roots, report, score

pytestmark = pytest.mark.slow


def test_no_silent_false_match_and_no_false_alarm_under_mutation() -> None:
    result = score(default_roots())
    table = report(result)
    print("\n" + table)
    planted = result.planted
    assert len(planted) >= 60, "the operators must find sites in most implementations\n" + table
    assert not result.silent, "silent false matches:\n" + "\n".join(
        f"{o.implementation}: {o.mutant.operator} at {o.mutant.path}:{o.mutant.line} ({o.mutant.description}) -> {o.status}"
        for o in result.silent)
    assert not result.false_alarms, "false alarms:\n" + "\n".join(result.false_alarms)
    # Detection, not only honesty: most planted defects must be found outright.
    assert result.detected / len(planted) >= 0.8, result.summary()  # measured 90/96 on 2026-11-30
