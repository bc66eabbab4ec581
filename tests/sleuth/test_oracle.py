"""The reference formulas' one home, pinned to what the published drafters and recipes use."""

from __future__ import annotations

import math

from sleuth.oracle import accepted_gammas, slot_weight, speculators_default_layer_ids, target_layer_ids


def test_the_layer_rule_gives_the_published_drafters_ids() -> None:
    assert target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # z-lab Qwen3.6-27B drafter (DFLASH.md)
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # DeepSpec's DSpark on Qwen3-4B
    assert target_layer_ids(8, 5) == [1, 2, 3, 4, 5]  # the embedded target
    assert target_layer_ids(36, 1) == [18] and target_layer_ids(36, 0) == []


def test_speculators_default_is_in_vllm_ids() -> None:
    assert speculators_default_layer_ids(36) == [2, 18, 33]


def test_slot_weights_and_accepted_gammas() -> None:
    assert slot_weight(1, 4.0) == 1.0 and math.isclose(slot_weight(3, 4.0), math.exp(-0.5))
    assert accepted_gammas(4.0, {16: 7.0}, 16) == [4.0, 7.0]
    assert accepted_gammas(4.0, {16: 7.0}, 8) == [4.0]


def test_no_other_sleuth_module_writes_the_layer_rule_again() -> None:
    """A second copy drifts (the rule was written four times): the expression lives in sleuth/oracle.py only."""
    from pathlib import Path

    import sleuth

    root = Path(sleuth.__file__).parent
    copies = [str(p.relative_to(root)) for p in root.rglob("*.py")
              if p.name != "oracle.py" and any(rule in line for line in p.read_text().splitlines()
                                               if not line.lstrip().startswith(('"""', "#", "`"))
                                               for rule in ("- 4) / (", "num_layers // 2, num_layers - 3]"))]
    assert copies == []
