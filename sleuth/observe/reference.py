"""The DFlash reference formulas the observation is judged against (shared/DFLASH.md); torch-free.

One home for each formula the observer's judge needs: the target layer rule (z-lab ids: id i is the output of
decoder layer i) and the per-slot loss weight. Each returns plain numbers so a verdict can show them.
"""

from __future__ import annotations

import math


def target_layer_ids(num_layers: int, count: int) -> list[int]:
    """k layers evenly from 1 to L-3 of an L-layer target (one layer: L // 2); z-lab model.py:27-45."""
    if count <= 1:
        return [num_layers // 2]
    return [int(round(1 + i * (num_layers - 4) / (count - 1))) for i in range(count)]


def slot_weight(slot: int, gamma: float) -> float:
    """The loss weight of slot k >= 1 relative to slot 1: exp(-(k-1)/gamma) (speculators losses/utils.py)."""
    return math.exp(-(slot - 1) / gamma)


def accepted_gammas(gamma: float | None, by_block_size: dict[int, float], block_size: int) -> list[float]:
    """The gammas the playbook accepts for this block size."""
    found = [g for g in (gamma, by_block_size.get(block_size)) if g is not None]
    return list(dict.fromkeys(found))
