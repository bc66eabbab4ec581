"""The development corpus of trainers in new styles (tests/fixtures/anyprobe, each with `planted` defects in
expected.yaml): static reading gives no false alarm and no silent agreement with a planted defect on any of
them; probes without an adapter find what is planted, with no false alarm and no silent match. The whole
corpus is measured by bench/anyprobe_corpus.py (BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sleuth.invariants import check_invariants, load_playbook
from sleuth.probes.runner import plan_for_code, run_plan
from sleuth.probes.verdict import PROBED_INVARIANTS
from sleuth.trace import Trace

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "anyprobe"
CASES = sorted(p for p in CORPUS.iterdir() if (p / "expected.yaml").is_file())
PLAYBOOK = load_playbook("dflash")


def planted(case: Path) -> set[str]:
    return set(yaml.safe_load((case / "expected.yaml").read_text()).get("planted") or [])


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name)
def test_static_reading_raises_no_false_alarm_and_vouches_for_no_planted_defect(case: Path):
    findings = check_invariants(PLAYBOOK, reference=None, config=None, config_source=None, checkpoint=None,
                                code=case, trace=Trace())
    alarms = {f.id: f.observed for f in findings if f.status == "mismatch" and f.id not in planted(case)
              and f.id in PROBED_INVARIANTS}
    silent = {f.id for f in findings if f.id in planted(case) and (f.static_agreement or f.status == "match")}
    assert not alarms and not silent, (alarms, silent)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["a03_additive_where", "a05_registry_clean", "a08_prepare_cache"])
def test_probes_without_an_adapter_find_what_is_planted(name: str):
    case = CORPUS / name
    outcome = run_plan(plan_for_code(case, None))
    assert outcome.error is None
    statuses = {v.invariant: v.status for v in outcome.verdicts}
    assert {i for i in planted(case) if statuses[i] == "mismatch"} == planted(case)
    assert {i for i, s in statuses.items() if s == "mismatch"} == planted(case)
    measured = [v for v in outcome.verdicts if v.status in ("match", "mismatch")]
    assert len(measured) >= 7 and all(v.experiment.startswith("located-") for v in measured)


def test_the_runs_freezing_code_runs_in_the_box_and_counts():
    """a06 freezes the drafter's embedding / head copies in a base-class hook: the optimizer experiment runs
    that hook on the copy in the sandbox, and it counts as run (was: the located sites named the user's files,
    the frames the box's copy, so every freeze was 'not run' and frozen_embed_head stayed unknown)."""
    outcome = run_plan(plan_for_code(CORPUS / "a06_hierarchy_hooks", None))
    assert outcome.error is None
    verdict = next(v for v in outcome.verdicts if v.invariant == "dflash.frozen_embed_head")
    assert verdict.status == "match", verdict.reason


BLIND2 = Path(__file__).resolve().parents[2] / "bench" / "anyprobe_blind2" / "trainers"


def _blind2_planted(name: str) -> set[str]:
    manifest = yaml.safe_load((BLIND2 / "MANIFEST.yaml").read_text())["trainers"][name]
    return {p["invariant"] for p in manifest.get("planted") or []}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "found"), [
    # bench/anyprobe_blind2: written blind after this round's code, first measured at 2 of 5 found with 8
    # false alarms (BENCHMARKS.md). What the probes must keep: each planted defect they reached is a
    # mismatch, none is a match, and a clean trainer gets no mismatch from an experiment.
    ("json_functional", {"dflash.loss_decay_gamma", "dflash.target_layer_ids"}),
    ("monolith_objective", {"dflash.context_excludes_anchor"}),  # target_shift is inline in forward: unknown
    ("sdpa_index_mask", {"dflash.blocks_isolated"}),
    ("packed_gather", set()),
    ("disk_cache", set()),
])
def test_the_second_blind_corpus_keeps_its_measured_findings(name: str, found: set[str]):
    outcome = run_plan(plan_for_code(BLIND2 / name, None))
    assert outcome.error is None, outcome.error
    statuses = {v.invariant: v.status for v in outcome.verdicts}
    planted_here = _blind2_planted(name)
    assert {i for i in planted_here if statuses.get(i) == "mismatch"} == found, statuses
    assert not {i for i in planted_here if statuses.get(i) == "match"}, statuses  # never a silent match
    # the tiled block ids of sdpa_index_mask also hide pairs inside a block: the same defect, seen by a
    # second rule; a clean trainer's experiments find nothing
    extra = {i for i, s in statuses.items() if s == "mismatch"} - planted_here - {"dflash.block_bidirectional"}
    assert extra <= {"dflash.loss_decay_gamma"} if planted_here else not extra, extra
