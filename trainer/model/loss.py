"""DFlash training targets, loss and metrics.

Block a is anchored at context position p and has B slots: slot 0 holds the anchor token, slots 1..B-1
hold mask tokens. Slot j predicts token p+j, so its target is the target model's distribution at
position p+j-1, whose next-token prediction is token p+j (rule `dflash.target_shift`; speculators
src/speculators/models/dflash/core.py rolls the verifier logits by one for exactly this).
Slot 0 predicts nothing and gets weight 0 (`dflash.anchor_slot_untrained`); slot k >= 1 weighs
exp(-(k-1)/gamma) (`dflash.loss_decay_gamma`; speculators src/speculators/losses/utils.py
`dflash_loss_decay`), or, with D-PACE weighting, a weight that depends on the drafter's own confidence
(speculators `dpace_loss_decay`, its current DFlash default: `dpace_weights` below).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

# speculators src/speculators/losses/utils.py `_LOSS_REDUCTION_EPS`: keeps a row without labels at 0 loss.
LOSS_REDUCTION_EPS = 1e-5


def decay_weights(block_size: int, gamma: float | None) -> Tensor:  # [B] float32
    """w_0 = 0, w_k = exp(-(k-1)/gamma) for k >= 1; gamma None means no decay (w_k = 1 for k >= 1)."""
    slot = torch.arange(block_size, dtype=torch.float32)  # [B]
    if gamma is None:
        weights = torch.ones(block_size)
    else:
        weights = torch.exp(-(slot - 1).clamp(min=0) / gamma)
    weights[0] = 0.0  # the anchor slot is an input, not a prediction
    return weights


@torch.no_grad()
def dpace_weights(
    per_slot_ce: Tensor,  # [N, A, B] cross entropy of every slot (any value where not label-valid)
    label_valid: Tensor,  # [N, A, B] bool: slot k >= 1 with a supervised label in the anchor's document
    alpha: float,
) -> Tensor:  # [N, A, B] float32, no grad
    """D-PACE per-slot weights, exactly speculators' `dpace_loss_decay` (losses/utils.py) per block.

    q_k = exp(-CE_k) is the drafter's confidence in the target's token at slot k, smoothed to
    s_k = (1 - alpha) q_k + alpha (1 where the slot has no label); prefix_k = prod_{i<=k} s_i estimates the
    chance that the draft is still accepted at slot k, and slot k weighs the expected number of accepted
    tokens that depend on it: sum_{j>=k} prefix_j over labelled slots. Weights are data: they move with the
    drafter's confidence, so no single gamma describes them (a probe sees that, not a wrong gamma).
    """
    mask = label_valid.float()
    confidence = torch.exp(-(per_slot_ce.float() * mask))
    smooth = torch.where(label_valid, (1.0 - alpha) * confidence + alpha, torch.ones_like(confidence))
    prefix = torch.cumprod(smooth, dim=-1)  # [N, A, B]
    suffix = torch.flip(torch.cumsum(torch.flip(prefix * mask, dims=[-1]), dim=-1), dims=[-1])
    return suffix * mask


def block_positions(anchors: Tensor, block_size: int) -> Tensor:  # [N, A, B] long: p + j
    """Context position of every block slot: slot j of the block anchored at p sits at p + j."""
    offsets = torch.arange(block_size, device=anchors.device)  # [B]
    return anchors.unsqueeze(-1) + offsets  # [N, A, B]


def gather_block_logits(
    target_logits: Tensor,  # [N, S, V] the target model's logits over the packed rows
    anchors: Tensor,  # [N, A]
    block_size: int,
) -> Tensor:  # [N, A, B, V]
    """Slot j (j >= 1) of the block anchored at p gets target_logits[:, p+j-1]; slot 0 gets zeros."""
    num_rows, seq_len, vocab = target_logits.shape
    num_anchors = anchors.shape[1]
    source = (block_positions(anchors, block_size) - 1).clamp(0, seq_len - 1)  # [N, A, B]
    # Clamping only keeps padding anchors (p = 0) and out-of-row slots in bounds; slot_weights zeroes them.
    index = source.view(num_rows, num_anchors * block_size, 1).expand(-1, -1, vocab)  # [N, A*B, V]
    gathered = target_logits.gather(1, index).view(num_rows, num_anchors, block_size, vocab)
    gathered[:, :, 0] = 0.0  # slot 0 has no target (the anchor token itself is given)
    return gathered


def slot_weights(
    anchors: Tensor,  # [N, A]
    anchor_valid: Tensor,  # [N, A] bool
    loss_mask: Tensor,  # [N, S]
    doc_ids: Tensor,  # [N, S], -1 = padding
    block_size: int,
    gamma: float | None,
) -> Tensor:  # [N, A, B] float32
    """Loss weight of every slot: decay * anchor valid * label supervised * label in the anchor's document.

    The label of slot j is token p+j: it must exist (p+j < S), be supervised (loss_mask[p+j] = 1) and
    belong to the anchor's document (a packed row's next document is not what the drafter should predict).
    """
    seq_len = loss_mask.shape[1]
    positions = block_positions(anchors, block_size)  # [N, A, B]
    in_row = positions < seq_len
    flat = positions.clamp(max=seq_len - 1).flatten(1)  # [N, A*B]
    label_supervised = loss_mask.gather(1, flat).view_as(positions).bool()  # [N, A, B]
    label_doc = doc_ids.gather(1, flat).view_as(positions)  # [N, A, B]
    anchor_doc = doc_ids.gather(1, anchors).unsqueeze(-1)  # [N, A, 1]
    valid = anchor_valid.unsqueeze(-1) & in_row & label_supervised & (label_doc == anchor_doc)
    decay = decay_weights(block_size, gamma).to(anchors.device)  # [B]
    return valid.float() * decay


def dflash_loss(
    draft_logits: Tensor,  # [N, A, B, V]
    target_block_logits: Tensor,  # [N, A, B, V] from gather_block_logits
    weights: Tensor,  # [N, A, B] from slot_weights
    kind: Literal["ce", "kl"],
    weighting: Literal["decay", "dpace"] = "decay",
    dpace_alpha: float = 0.5,
) -> tuple[Tensor, dict[str, Any]]:
    """Per-slot loss, decay-weighted and normalised the way speculators does it.

    Normalisation follows speculators src/speculators/losses/utils.py `loss_function`: per packed row,
    sum(decay * label_valid * loss) / (number of label-valid slots + 1e-5), then the mean over rows.
    The denominator counts valid slots; it is not the sum of the decayed weights. A slot is label-valid
    exactly where its weight is > 0 (decay is positive for every slot k >= 1).

    kind "ce": cross entropy against the target's argmax (speculators' DFlash default, rule
    `dflash.loss_kind`); "kl": KL(target softmax || draft softmax), speculators losses/eager.py kl_div_loss.
    weighting "decay": `weights` as given (fixed exponential decay); "dpace": `weights` only says which slots
    are label-valid (build them with gamma None) and D-PACE replaces the decay (CE only, as speculators
    requires).
    """
    draft_logp = F.log_softmax(draft_logits.float(), dim=-1)  # [N, A, B, V]
    target_logits = target_block_logits.float().detach()
    if kind == "ce":
        target_ids = target_logits.argmax(dim=-1)  # [N, A, B]
        per_slot = -draft_logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)  # [N, A, B]
    elif kind == "kl":
        target_logp = F.log_softmax(target_logits, dim=-1)
        per_slot = (target_logp.exp() * (target_logp - draft_logp)).sum(dim=-1)  # [N, A, B]
    else:
        raise ValueError(f"loss kind must be 'ce' or 'kl', got {kind!r}")

    weights = weights.float()
    label_valid = weights > 0  # [N, A, B]
    if weighting == "dpace":
        if kind != "ce":
            raise ValueError("D-PACE weighting needs the cross-entropy loss (loss: ce), as speculators requires")
        weights = dpace_weights(per_slot.detach(), label_valid, dpace_alpha)
    elif weighting != "decay":
        raise ValueError(f"loss weighting must be 'decay' or 'dpace', got {weighting!r}")
    row_sum = (weights * per_slot).flatten(1).sum(dim=1)  # [N]
    row_count = label_valid.flatten(1).sum(dim=1).float()  # [N]
    loss = (row_sum / (row_count + LOSS_REDUCTION_EPS)).mean()
    return loss, block_metrics(draft_logits, target_block_logits, label_valid)


@torch.no_grad()
def block_metrics(
    draft_logits: Tensor,  # [N, A, B, V]
    target_block_logits: Tensor,  # [N, A, B, V]
    label_valid: Tensor,  # [N, A, B] bool
) -> dict[str, Any]:
    """Greedy agreement metrics over label-valid slots 1..B-1.

    acc: fraction of label-valid slots where draft argmax == target argmax (speculators `full_acc`).
    position_acc: the same per slot 1..B-1 (speculators `position_{i}_acc`; 0.0 for a slot with no labels).
    streak: mean accepted prefix per block: consecutive correct slots from slot 1, stopping at the first
        wrong slot or the first slot without a label; over blocks with at least one label-valid slot.
    eal: sum_k prod_{i<=k} position_acc_i (speculators dflash/metrics.py; no +1 for the bonus token).
    """
    correct = (draft_logits.argmax(dim=-1) == target_block_logits.argmax(dim=-1)) & label_valid  # [N, A, B]
    correct, label_valid = correct[..., 1:], label_valid[..., 1:]  # slot 0 is never a prediction
    prefix = correct.long().cumprod(dim=-1).sum(dim=-1)  # [N, A] correct slots before the first miss
    has_label = label_valid.any(dim=-1)  # [N, A]
    # Counts, not ratios, are what add up across the ranks of a distributed run (metrics_from_counts).
    counts = {
        "correct": correct.flatten(0, 1).sum(dim=0).tolist(),  # [B-1]
        "labels": label_valid.flatten(0, 1).sum(dim=0).tolist(),  # [B-1]
        "prefix": float(prefix[has_label].sum()),
        "blocks": int(has_label.sum()),
    }
    return {**metrics_from_counts(counts), "counts": counts}


def metrics_from_counts(counts: dict[str, Any]) -> dict[str, Any]:
    """acc, position_acc, streak and eal from the (possibly summed over ranks) counts of block_metrics."""
    correct, labels = counts["correct"], counts["labels"]
    position_acc = [c / t if t > 0 else 0.0 for c, t in zip(correct, labels)]
    total = sum(labels)
    acc = sum(correct) / total if total > 0 else 0.0
    streak = counts["prefix"] / counts["blocks"] if counts["blocks"] > 0 else 0.0
    eal, survive = 0.0, 1.0
    for slot_acc in position_acc:
        survive *= slot_acc
        eal += survive
    return {"acc": acc, "position_acc": position_acc, "streak": streak, "eal": eal}
