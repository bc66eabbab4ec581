"""The DFlash reference formulas, each in one place (shared/DFLASH.md); torch-free and self-contained.

Everything in sleuth that judges a run against the reference takes the expected value from here: the static
config and code readers, the SpecForge and speculators run checks, the probes' experiments (copied into their
box beside the probes) and the observed step's judge. A formula written twice drifts; this module is the one
copy, and tests/sleuth/test_oracle.py pins it to the published drafters' values.
"""

from __future__ import annotations

import math


def target_layer_ids(num_layers: int, count: int) -> list[int]:
    """z-lab's `build_target_layer_ids` (dflash/model.py:27-45; SpecForge's is the same): `count` layers evenly
    from 1 to L-3 of an L-layer target, id i the output of decoder layer i; one layer: [L // 2]."""
    if count <= 0:
        return []
    if count == 1:
        return [num_layers // 2]
    return [int(round(1 + i * (num_layers - 4) / (count - 1))) for i in range(count)]


def speculators_default_layer_ids(num_layers: int) -> list[int]:
    """speculators' default when no ids are given, in vLLM's convention (id i = HF hidden_states[i], so the
    output of decoder layer i-1): [2, L // 2, L - 3] (speculators models/utils.py)."""
    return [2, num_layers // 2, num_layers - 3]


def slot_weight(slot: int, gamma: float) -> float:
    """The loss weight of block slot k >= 1 relative to slot 1: exp(-(k-1)/gamma) (speculators losses/utils.py)."""
    return math.exp(-(slot - 1) / gamma)


def accepted_gammas(gamma: float | None, by_block_size: dict[int, float], block_size: int) -> list[float]:
    """The decay gammas the playbook accepts for this block size (4; 7 at block size 16, z-lab's recipe)."""
    found = [g for g in (gamma, by_block_size.get(block_size)) if g is not None]
    return list(dict.fromkeys(found))
