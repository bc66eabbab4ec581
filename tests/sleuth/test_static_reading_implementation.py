"""Static reading reads the implementation: false alarms of static reading on code written in new styles,
each a class of reading fixed at the root (tests/fixtures/static_reading/, one case per class). Each case
fails on main 22f97b5 as described."""

from __future__ import annotations

from pathlib import Path

import pytest

from sleuth.evidence.source import analyse_path
from sleuth.invariants import check_invariants, load_playbook
from sleuth.trace import Trace

CASES = Path(__file__).resolve().parents[1] / "fixtures" / "static_reading"
PLAYBOOK = load_playbook("dflash")


def _statuses(case: str) -> dict[str, tuple[str, bool, str | None]]:
    findings = check_invariants(PLAYBOOK, reference=None, config=None, config_source=None, checkpoint=None,
                                code=CASES / case, trace=Trace())
    return {f.id: (f.status, f.static_agreement, f.observed) for f in findings}


def test_the_users_probe_adapter_is_not_read_as_the_trainer():
    # main: "trained" from my_probe.py:13 (the adapter's lm_head copy), a false alarm
    status, agreement, observed = _statuses("adapter_beside_trainer")["dflash.frozen_embed_head"]
    assert (status, agreement, observed) == ("unknown", True, "frozen")
    excluded = analyse_path(CASES / "adapter_beside_trainer").excluded
    assert list(excluded) == ["adapter_beside_trainer/my_probe.py"]
    assert "implements the probe protocol" in excluded["adapter_beside_trainer/my_probe.py"]


def test_a_label_gather_is_not_a_position_and_a_compared_label_is_not_a_target():
    statuses = _statuses("label_gather")
    # main: block_position_ids "anchor+j+1" from `label_pos`, target_shift "p+j+0" from the accuracy's labels
    assert statuses["dflash.block_position_ids"][:3] == ("unknown", True, "anchor+j")
    assert statuses["dflash.target_shift"][:3] == ("unknown", True, "p+j-1")


def test_a_zero_placed_before_the_decay_is_slot_zero_zeroed():
    # main: "decay weights cover slot 0 and nothing zeroes the anchor slot", a false alarm
    assert _statuses("zero_before_decay")["dflash.anchor_slot_untrained"][:3] == ("unknown", True, "weight 0")


def test_slot_zero_singled_out_in_the_loss_is_not_read_as_trained():
    # main 6ee2a3d: "decay weights cover slot 0 and nothing zeroes the anchor slot", a false alarm on a blind
    # trainer that removes slot 0's term after weighting every slot (`is_anchor = slot == 0`)
    status, _agreement, observed = _statuses("slot_zero_term_removed")["dflash.anchor_slot_untrained"]
    assert status != "mismatch" and observed != "trained"


def test_a_parameter_made_without_grad_where_it_is_bound_is_frozen():
    # main 6ee2a3d: "the drafter holds the lm_head `self.head` ... and nothing freezes it", a false alarm:
    # `self.head.weight = nn.Parameter(..., requires_grad=False)` is the freeze
    status, _agreement, observed = _statuses("head_frozen_where_bound")["dflash.frozen_embed_head"]
    assert status == "unknown" and observed == "frozen?"  # the head frozen; the embeddings are not in this file
    readings = analyse_path(CASES / "head_frozen_where_bound").readings["dflash.frozen_embed_head"]
    assert [r.detail.split(";")[0] for r in readings] == ["the lm_head is frozen"]


def test_the_override_that_runs_is_read_not_the_base_hook():
    # main: static agreement with the base class's `* (k > 0)`, which no concrete class runs: silent
    status, agreement, observed = _statuses("hook_override")["dflash.anchor_slot_untrained"]
    assert (status, agreement, observed) == ("mismatch", False, "trained")


@pytest.mark.parametrize("case", ["adapter_beside_trainer", "label_gather", "zero_before_decay"])
def test_no_false_alarm_in_the_correct_cases(case: str):
    planted_by_design = {"adapter_beside_trainer": {"dflash.fc_norm"}}  # that trainer has no norm after fc
    mismatches = {i for i, (s, _a, _o) in _statuses(case).items() if s == "mismatch"}
    assert mismatches <= planted_by_design.get(case, set()), mismatches


def test_an_mlp_or_a_targets_own_mixing_layer_is_not_the_fusion_projection():
    # main: "subset" (a hard-coded 2 layers; the code's layer-id list has 4 entries) from `down` and `mix`
    readings = analyse_path(CASES / "mlp_beside_fc").readings["dflash.fc_input_layers"]
    assert {r.value for r in readings} == {"all"}
    assert _statuses("mlp_beside_fc")["dflash.fc_input_layers"][0] != "mismatch"
