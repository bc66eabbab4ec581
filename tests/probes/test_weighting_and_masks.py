"""Two readings the round-7 blind catalog needed: slot weights where no block has every slot trained, and which
rule a difference between two block masks breaks."""

from __future__ import annotations

import math

import torch

from sleuth.probes.adapters.specforge import _block_difference_kind
from sleuth.probes.experiments.loss import _profile_from_partial_blocks


def test_a_fixed_decay_is_read_from_blocks_none_of_which_is_fully_trained():
    b, gamma = 8, 4.0
    weights = torch.exp(-(torch.arange(b, dtype=torch.float64) - 1).clamp(min=0) / gamma).expand(3, b).clone()
    trained = torch.zeros(3, b, dtype=torch.bool)
    trained[0, 1:4], trained[1, 3:8], trained[2, 2:6] = True, True, True
    weights = weights * trained
    profile = _profile_from_partial_blocks(weights, trained)
    assert profile is not None
    assert math.isclose(-1 / math.log(profile[1].item()), gamma, rel_tol=1e-6)


def test_no_profile_without_a_block_of_two_trained_slots():
    trained = torch.zeros(2, 8, dtype=torch.bool)
    trained[0, 3], trained[1, 5] = True, True
    assert _profile_from_partial_blocks(torch.ones(2, 8, dtype=torch.float64) * trained, trained) is None


def _masks(blocks: int = 3, b: int = 4, context: int = 6) -> torch.Tensor:
    mask = torch.zeros(1, 1, blocks * b, context + blocks * b, dtype=torch.bool)
    for q in range(blocks * b):
        mask[0, 0, q, : 2 + q // b] = True  # some context per block
        start = context + (q // b) * b
        mask[0, 0, q, start : start + b] = True  # its own block, both ways
    return mask


def test_mask_differences_are_named_by_the_rule_they_break():
    b, context = 4, 6
    good = _masks()
    causal = good.clone()
    for q in range(causal.shape[2]):
        causal[0, 0, q, context + q + 1 : context + (q // b + 1) * b] = False
    assert _block_difference_kind(causal, good, context, b) == "within a block"
    leak = good.clone()
    leak[0, 0, 5, context] = True  # block 1's query sees block 0's first slot
    assert _block_difference_kind(leak, good, context, b) == "across blocks"
    dropped = good.clone()
    dropped[0, 0, b : 2 * b] = False  # block 1 masked out entirely (a keep flag on the wrong block)
    assert _block_difference_kind(dropped, good, context, b) == "whole blocks"
    only_context = good.clone()
    only_context[0, 0, 0, 5] = True
    assert _block_difference_kind(only_context, good, context, b) == ""
