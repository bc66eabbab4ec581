"""Anchor sampling: which positions of each packed row start a training block.

Rule `dflash.anchor_sampling`, as vllm-project/speculators src/speculators/models/dflash/utils.py
(`select_anchors`) does it: up to `max_anchors` per packed sequence, drawn uniformly without replacement
from the positions whose loss mask is 1, never from the last B positions (so every block of B slots
p..p+B-1 lies inside the row), then sorted. Rows with fewer eligible positions are padded with
anchor_valid False; padding anchors point at position 0 and are masked out everywhere downstream.
"""

from __future__ import annotations

import torch
from torch import Tensor


def eligible_anchor_positions(
    loss_mask: Tensor,  # [N, S]
    doc_ids: Tensor,  # [N, S], -1 = padding
    block_size: int,
) -> Tensor:  # [N, S] bool
    """Positions that may anchor a block: supervised, not padding, not among the last B of the row."""
    eligible = loss_mask.bool() & (doc_ids >= 0)
    eligible[:, max(eligible.shape[1] - block_size, 0) :] = False
    return eligible


def sample_anchors(
    loss_mask: Tensor,  # [N, S] long/bool, 1 where the token is supervised
    doc_ids: Tensor,  # [N, S] long, -1 = padding
    block_size: int,
    max_anchors: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:  # anchors [N, A] long (sorted), anchor_valid [N, A] bool; A = max_anchors
    """Sample sorted anchors per row; a deterministic function of the generator's state.

    Sorting does not change the loss; it keeps a block's neighbours in nearby query tiles, which lets
    flex attention skip whole tiles (the reason speculators gives in dflash/utils.py).
    """
    if loss_mask.shape != doc_ids.shape or loss_mask.ndim != 2:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} and doc_ids {tuple(doc_ids.shape)} must both be [N, S]")
    if block_size < 1 or max_anchors < 1:
        raise ValueError(f"block_size and max_anchors must be >= 1, got {block_size}, {max_anchors}")
    num_rows = loss_mask.shape[0]
    device = loss_mask.device
    eligible = eligible_anchor_positions(loss_mask, doc_ids, block_size).cpu()  # [N, S]
    anchors = torch.zeros(num_rows, max_anchors, dtype=torch.long)  # [N, A]
    anchor_valid = torch.zeros(num_rows, max_anchors, dtype=torch.bool)  # [N, A]
    for row in range(num_rows):
        candidates = eligible[row].nonzero().squeeze(-1)  # [E] eligible positions, increasing
        count = min(max_anchors, candidates.numel())
        # A random permutation's prefix is a uniform sample without replacement.
        order = torch.randperm(candidates.numel(), generator=generator, device=generator.device).cpu()
        anchors[row, :count] = candidates[order[:count]].sort().values
        anchor_valid[row, :count] = True
    return anchors.to(device), anchor_valid.to(device)
