"""DFlash2's selector term: a K-way cross entropy over the unary top-K, added to the unary (DFlash) loss.

    loss = unary + selector_loss_alpha * selector          (speculators 0.9.0 dflash2/metrics.py:159)

For every label-valid slot (the same slots, decay weights and per-row normalisation as the unary loss,
trainer/model/loss.py block_loss):
  * gold = the teacher's argmax at the slot (rule `dflash2.selector_gold_token`: the verifier's, not the data
    token; NeMo's DFlash2 takes the data token instead);
  * candidates = the unary top-K of the drafter's own logits; if gold is not among them it replaces the K-th
    candidate, so every slot has a label (speculators metrics.py:31-62; NeMo drops such slots instead);
  * predecessor = the token before the slot's target, x[a+k-1], the anchor for slot 1
    (rule `dflash2.selector_predecessor`);
  * scores = unary logits at the candidates + the selector's transition scores; CE against gold's index.
The gradient reaches the drafter through both the unary scores and the selector's hidden projection.

Unary logits are computed chunk by chunk (as block_loss does): the gather keeps only [c, K] of each chunk's
[c, V] logits for backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.model.dflash2 import CandidateSelector
from trainer.model.loss import LOSS_REDUCTION_EPS, LogitsHead, block_counts, loss_chunk_slots


@dataclass
class SelectorLoss:
    loss: Tensor  # scalar: the decay-weighted K-way CE, normalised like the unary loss
    selector_ids: Tensor  # [N, A, B] long: the selector's teacher-forced choice per label-valid slot, -1 elsewhere
    gold_in_top_k: Tensor  # [N, A, B] bool: gold was among the unary top-K before injection


def selector_training_candidates(candidates: Tensor, gold: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(candidates with gold injected at rank K where absent [M, K], gold's index [M], gold present [M])."""
    matches = candidates.eq(gold.unsqueeze(-1))  # [M, K]
    present = matches.any(dim=-1)
    last = candidates.shape[-1] - 1
    index = torch.where(present, matches.long().argmax(dim=-1), torch.full_like(gold, last))
    injected = candidates.clone()
    injected[:, last] = torch.where(present, candidates[:, last], gold)
    return injected, index, present


def predecessor_ids(input_ids: Tensor, anchors: Tensor, block_size: int) -> Tensor:  # [N, A, B] long
    """prev of slot k = x[a+k-1] (slot 0: the anchor itself, never trained); clamped where the label is past the row."""
    offsets = (torch.arange(block_size, device=anchors.device) - 1).clamp(min=0)  # 0 0 1 2 ...
    positions = (anchors.unsqueeze(-1) + offsets).clamp(max=input_ids.shape[1] - 1)  # [N, A, B]
    return input_ids.gather(1, positions.flatten(1)).view_as(positions)


def selector_loss(
    draft: Tensor,  # [M, H] the drafter's final hidden states, block-major over [N, A, B]
    head: LogitsHead,  # the frozen lm_head the unary logits come from
    selector: CandidateSelector,
    predecessors: Tensor,  # [N, A, B] long, from predecessor_ids
    gold: Tensor,  # [N, A, B] long: the teacher's argmax per label-valid slot (block_loss teacher_ids), -1 elsewhere
    weights: Tensor,  # [N, A, B] slot weights (decay x label-valid), as the unary loss used them
    chunk_size: int | None = None,
) -> SelectorLoss:
    num_rows, num_anchors, block_size = weights.shape
    flat_weights = weights.flatten().float()
    valid = (flat_weights > 0).nonzero().squeeze(1)  # [Mv]
    row_count = (weights > 0).flatten(1).sum(dim=1).float()  # [N]
    vocab = head.vocab_size or int(draft.shape[-1])
    step = loss_chunk_slots(chunk_size, vocab, block_size)
    selector_ids = torch.full((weights.numel(),), -1, dtype=torch.long, device=weights.device)
    present_all = torch.zeros(weights.numel(), dtype=torch.bool, device=weights.device)
    row_sum = torch.zeros(num_rows, dtype=torch.float32, device=draft.device)
    flat_prev, flat_gold = predecessors.flatten(), gold.flatten()
    for lo in range(0, valid.numel(), step):
        slots = valid[lo : lo + step]  # [c]
        x = draft.index_select(0, slots)  # [c, H]
        unary = head(x).float()  # [c, V]
        candidates = unary.detach().topk(selector.top_k, dim=-1).indices  # [c, K]
        candidates, target_index, present = selector_training_candidates(candidates, flat_gold[slots])
        scores = unary.gather(1, candidates) + selector.transition_scores(
            x, flat_prev[slots], candidates).float()  # [c, K]
        per_slot = F.cross_entropy(scores, target_index, reduction="none")  # [c]
        row_sum = row_sum.index_add(0, slots // (num_anchors * block_size), flat_weights[slots] * per_slot)
        selector_ids[slots] = candidates.gather(1, scores.detach().argmax(dim=-1, keepdim=True)).squeeze(1)
        present_all[slots] = present
    loss = (row_sum / (row_count + LOSS_REDUCTION_EPS)).mean()
    return SelectorLoss(loss, selector_ids.view(weights.shape), present_all.view(weights.shape))


def selector_counts(result: SelectorLoss, gold: Tensor, weights: Tensor) -> dict:
    """block_counts of the selector's teacher-forced choice, a hit only where gold was in the unary top-K
    (what serving could propose; speculators' `eal` gates the same way, rule `dflash2.eal_gate`)."""
    block_size = weights.shape[-1]
    correct = (result.selector_ids == gold) & result.gold_in_top_k
    return block_counts(correct.view(-1, block_size), (weights > 0).view(-1, block_size))
