"""The engine over a corpus of independent DFlash implementations with planted defects.

Each tests/fixtures/impls/<case>/ holds Python source in its own style (never imported) and expected.yaml
with the planted defects and the statuses the engine must give, exactly, for the ids it lists.
`tests/sleuth/corpus_metrics.py` prints recall and false alarms for the whole corpus.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus_metrics import CORPUS, corpus_cases, run_case, summarise  # noqa: E402

from sleuth.invariants import load_playbook  # noqa: E402

PLAYBOOK = load_playbook("dflash")
CASES = corpus_cases(CORPUS)


def test_corpus_is_large_and_varied():
    assert len(CASES) >= 8
    planted = {i for case in CASES for i in run_case(case, PLAYBOOK).planted}
    assert len(planted) >= 8  # distinct kinds of planted defects
    assert any(not run_case(case, PLAYBOOK).planted for case in CASES)  # some implementations are correct


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name)
def test_case_statuses(case: Path):
    result = run_case(case, PLAYBOOK)
    assert not result.wrong, f"{case.name}: expected vs got {result.wrong}"
    assert not result.false_alarms, f"{case.name}: false alarms {result.false_alarms}"
    assert not result.missed, f"{case.name}: missed planted defects {result.missed}"


def test_corpus_recall_and_false_alarms():
    summary = summarise([run_case(case, PLAYBOOK) for case in CASES])
    print(f"\ncorpus: {summary['cases']} cases, recall {summary['found']}/{summary['planted']} "
          f"({summary['recall']:.0%}), false alarms {summary['false_alarms']} over {summary['checks']} checks")
    assert summary["recall"] == 1.0
    assert summary["false_alarms"] == 0
