"""Every probe on a small hand-built DFlash implementation (examples/probe_protocol.py): correct, and with
each defect planted. The implementation is written independently of the probes (plain torch, its own
mask, loss and optimizer), so these tests compare the experiments' verdicts with known answers."""

from __future__ import annotations

import functools
import math

import pytest

from sleuth.probes.verdict import PROBED_INVARIANTS, Expectations
from tests.probes.lab import example_subject, verdicts


def test_correct_implementation_matches_every_probed_invariant():
    found = verdicts(example_subject())
    assert set(found) == set(PROBED_INVARIANTS)
    wrong = {k: (v.status, v.observed or v.reason) for k, v in found.items() if v.status != "match"}
    assert wrong == {}
    assert found["dflash.loss_decay_gamma"].measured["gamma"] == pytest.approx(4.0, rel=1e-3)
    assert found["dflash.loss_kind"].observed.startswith("ce")
    # Every verdict states its experiment: what was perturbed, the number measured, the threshold.
    for verdict in found.values():
        assert verdict.hypothesis and verdict.perturbed and verdict.measurement and verdict.threshold


DEFECT_CASES = [
    ("fc_subset", "layers-read", "dflash.fc_input_layers", "2 of 3 selected layers read"),
    ("layer_offset", "layers-read", "dflash.target_layer_ids", "off by one"),
    ("anchor_leak", "attention", "dflash.context_excludes_anchor", "sees its anchor's own context position"),
    # Context "after" the anchor includes the anchor itself, so that rule breaks too.
    ("future_context", "attention", "dflash.blocks_isolated", "context after its anchor"),
    ("cross_block", "attention", "dflash.blocks_isolated", "another block's tokens"),
    ("causal_block", "attention", "dflash.block_bidirectional", "causal within the block"),
    ("context_first_layer_only", "context-per-layer", "dflash.kv_injection", "does not reach layers [1]"),
    ("position_offset", "rotary-positions", "dflash.block_position_ids", "anchor + j +1"),
    ("teacher_last_selected", "loss-gradient", "dflash.target_logits_source", "lm_head(norm(hidden_states[6]))"),
    ("no_shift", "loss-gradient", "dflash.target_shift", "p+j+0"),
    ("slot0_weighted", "loss-gradient", "dflash.anchor_slot_untrained", "slot 0 weighs 1 x slot 1"),
    ("trainable_head", "optimizer-step", "dflash.frozen_embed_head", "embeddings and lm_head trained"),
]


@pytest.mark.parametrize(("defect", "experiment", "invariant", "observed"), DEFECT_CASES, ids=[c[0] for c in DEFECT_CASES])
def test_each_planted_defect_is_a_mismatch_of_its_invariant(defect, experiment, invariant, observed):
    correct = correct_verdicts(experiment)
    broken = verdicts(example_subject(defects=[defect]), experiment)
    assert correct[invariant].status == "match"
    assert broken[invariant].status == "mismatch", broken[invariant]
    assert observed in broken[invariant].observed
    assert broken[invariant].fix
    # The other invariants the same experiment decides are not dragged along.
    also = {"future_context": {"dflash.context_excludes_anchor"}}.get(defect, set())
    others = {k: v.status for k, v in broken.items() if k != invariant and k not in also}
    assert all(status == "match" for status in others.values()), others


@functools.cache
def correct_verdicts(experiment: str):
    return verdicts(example_subject(), experiment)


def test_gamma_is_fitted_and_judged_against_the_expected_value():
    seven = verdicts(example_subject(gamma=7.0), "loss-gradient")["dflash.loss_decay_gamma"]
    assert seven.status == "mismatch" and seven.measured["gamma"] == pytest.approx(7.0, rel=1e-3)
    # 7 is the accepted value at B = 16 (the paper's setting).
    at_16 = verdicts(example_subject(gamma=7.0, block_size=16), "loss-gradient")["dflash.loss_decay_gamma"]
    assert at_16.status == "match"
    # No expected value at all: the fitted gamma is reported, the status stays unknown.
    free = verdicts(example_subject(gamma=4.0), "loss-gradient",
                    expectations=Expectations(gamma=None, gamma_by_block_size={}))["dflash.loss_decay_gamma"]
    assert free.status == "unknown" and free.measured["gamma"] == pytest.approx(4.0, rel=1e-3)


def test_no_decay_is_gamma_infinity():
    found = verdicts(example_subject(gamma=None), "loss-gradient")["dflash.loss_decay_gamma"]
    assert found.status == "mismatch"
    assert found.measured["gamma"] == "inf" and "no decay" in found.observed
    assert not math.isnan(found.measured["confidence_drift"])


def test_dpace_weighting_is_recognised_not_read_as_a_wrong_gamma():
    found = verdicts(example_subject(weighting="dpace"), "loss-gradient")
    gamma = found["dflash.loss_decay_gamma"]
    assert gamma.status == "match", gamma
    assert "D-PACE" in gamma.observed and "alpha 0.50" in gamma.observed
    assert gamma.measured["confidence_drift"] > 1e-3
    assert found["dflash.anchor_slot_untrained"].status == "match"


def test_soft_targets_are_read_as_kl():
    found = verdicts(example_subject(loss="kl"), "loss-gradient")
    assert found["dflash.loss_kind"].status == "match"
    assert found["dflash.loss_kind"].observed.startswith("kl")
    assert found["dflash.target_logits_source"].status == "match"
    assert found["dflash.loss_decay_gamma"].measured["gamma"] == pytest.approx(4.0, rel=1e-2)
    # A playbook that accepts only CE turns the same measurement into a mismatch.
    ce_only = verdicts(example_subject(loss="kl"), "loss-gradient", expectations=Expectations(loss_kinds=("ce",)))
    assert ce_only["dflash.loss_kind"].status == "mismatch"
