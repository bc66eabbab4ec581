"""DSpark's training targets and loss: DFlash's chunked block loss on the Markov-biased logits, plus the
confidence head's BCE toward each slot's acceptance rate.

Slot rule (`dspark.anchor_slot_trained`). With sample_from_anchor, slot k of the block anchored at a predicts
x[a+k+1]: its teacher is the target's distribution at a+k, its label must be supervised and in the anchor's
document, and it weighs exp(-k/gamma), so slot 0 is trained with weight 1 (speculators losses/utils.py
`dflash_loss_decay(sample_from_anchor=True)`). Without it the slots are DFlash's (trainer/model/loss.py).
Where speculators reads slot k's loss mask at a+k, we read it at the label a+k+1, as SpecForge and DeepSpec do
(`dspark.mask_target_alignment`); the two agree except at the last supervised token of a span.

Loss (speculators dspark/metrics.py:76-117). main = the run's loss kind (ce | kl) on the post-Markov logits
(`dspark.post_markov_logits`), per row sum(decay * valid * loss) / (sum valid + 1e-5), mean over rows
(block_loss). The Markov bias W2 . m is one more linear term, so logits = [h; m] . [W_head; W2]^T and the chunked,
fused block_loss computes it without ever holding [slots, V]. conf = per row sum(decay * valid *
BCE(c_k, 1 - TV_k)) / (sum valid + 1e-8), mean over rows; 1 - TV_k = sum_v min(p_v, q_v) is detached
(`dspark.conf_target`). loss = main + alpha * conf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.model.loss import (
    BlockTeacher,
    LogitsHead,
    block_counts,
    block_loss,
    block_positions,
    decay_weights,
    loss_chunk_slots,
    metrics_from_counts,
)

# speculators dspark/metrics.py `_EPS`: the confidence term's denominator guard (the main term's is 1e-5).
CONFIDENCE_REDUCTION_EPS = 1e-8


def dspark_decay(block_size: int, gamma: float | None, sample_from_anchor: bool) -> Tensor:  # [B] float32
    """sample_from_anchor: w_k = exp(-k/gamma), w_0 = 1. Otherwise DFlash's (w_0 = 0, w_k = exp(-(k-1)/gamma))."""
    if not sample_from_anchor:
        return decay_weights(block_size, gamma)
    if gamma is None:
        return torch.ones(block_size)
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / gamma)


def label_positions(anchors: Tensor, block_size: int, sample_from_anchor: bool) -> Tensor:  # [N, A, B] long
    """Where slot k's label token sits: a + k + 1 with sample_from_anchor, else a + k."""
    return block_positions(anchors, block_size) + (1 if sample_from_anchor else 0)


def teacher_rows(anchors: Tensor, block_size: int, seq_len: int, sample_from_anchor: bool) -> Tensor:
    """[N, A, B] flat rows into the teacher's [N*S, H]: the position before slot k's label, in its packed row."""
    source = (label_positions(anchors, block_size, sample_from_anchor) - 1).clamp(0, seq_len - 1)
    return source + torch.arange(anchors.shape[0], device=anchors.device)[:, None, None] * seq_len


def dspark_slot_weights(
    anchors: Tensor,  # [N, A]
    anchor_valid: Tensor,  # [N, A] bool
    loss_mask: Tensor,  # [N, S]
    doc_ids: Tensor,  # [N, S], -1 = padding
    block_size: int,
    gamma: float | None,
    sample_from_anchor: bool,
) -> Tensor:  # [N, A, B] float32
    """decay * anchor valid * label in the row * label supervised * label in the anchor's document."""
    seq_len = loss_mask.shape[1]
    positions = label_positions(anchors, block_size, sample_from_anchor)  # [N, A, B]
    in_row = positions < seq_len
    flat = positions.clamp(max=seq_len - 1).flatten(1)  # [N, A*B]
    supervised = loss_mask.gather(1, flat).view_as(positions).bool()
    same_doc = doc_ids.gather(1, flat).view_as(positions) == doc_ids.gather(1, anchors).unsqueeze(-1)
    valid = anchor_valid.unsqueeze(-1) & in_row & supervised & same_doc
    return valid.float() * dspark_decay(block_size, gamma, sample_from_anchor).to(anchors.device)


@dataclass
class DSparkLoss:
    loss: Tensor  # scalar: main + alpha * confidence
    main: Tensor  # scalar: the ce / kl term
    confidence: Tensor | None  # scalar BCE term (before alpha), None without a confidence head
    accept_rate: Tensor  # [N, A, B] float32 1 - TV per slot (0 where not label-valid), no grad
    label_valid: Tensor  # [N, A, B] bool: the slots that carry a loss
    counts: dict[str, Any]  # block_counts over the trained slots (slot 0 first when it is trained)

    def metrics(self) -> dict[str, Any]:
        """block_counts' metrics, plus `kind_metrics`: DSpark's own scalars, which the loop logs per step."""
        kind: dict[str, float] = {"dspark_main_loss": float(self.main.detach())}
        if self.confidence is not None:
            kind["dspark_confidence_loss"] = float(self.confidence.detach())
        valid = self.label_valid
        kind["dspark_accept_rate"] = float(self.accept_rate[valid].mean()) if valid.any() else 0.0
        return {**metrics_from_counts(self.counts), "counts": self.counts, "kind_metrics": kind}


def dspark_loss(
    hidden: Tensor,  # [M, H] the backbone's final-normed states, block-major over [N, A, B]
    head: LogitsHead,  # the frozen target lm_head
    markov: Tensor | None,  # [M, r] Markov features (the bias is markov_w2(markov)), None without the head
    markov_w2: Tensor | None,  # [V, r]
    confidence_logits: Tensor | None,  # [M]
    teacher: BlockTeacher,
    weights: Tensor,  # [N, A, B] from dspark_slot_weights
    kind: Literal["ce", "kl"],
    confidence_alpha: float,
    sample_from_anchor: bool,
    chunk_size: int | None = None,
) -> DSparkLoss:
    rows, biased = hidden, head
    if markov is not None:
        # [h; m] . [W_head; W2]^T = lm_head(h) + W2 m: the Markov bias rides in the same fused, chunked head
        rows = torch.cat([hidden, markov.to(hidden.dtype)], dim=-1)  # [M, H + r]
        biased = LogitsHead(torch.cat([head.weight, markov_w2.to(head.weight.dtype)], dim=1), head.bias)
    main = block_loss(rows, biased, teacher, weights, kind, "decay", chunk_size=chunk_size)
    rate = acceptance_rate(rows, biased, teacher, weights, chunk_size)  # [N, A, B]
    loss, confidence = main.loss, None
    if confidence_logits is not None:
        valid = weights > 0
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), rate.flatten(), reduction="none")  # [M]
        per_row = (bce.view_as(weights) * weights).flatten(1).sum(dim=1)  # [N]
        count = valid.flatten(1).sum(dim=1).float()  # [N]
        confidence = (per_row / (count + CONFIDENCE_REDUCTION_EPS)).mean()
        loss = loss + confidence_alpha * confidence
    label_valid = trained = weights > 0
    correct = main.draft_ids == main.teacher_ids
    if sample_from_anchor:
        # block_counts skips column 0 (DFlash's untrained anchor slot); here slot 0 is a prediction, so a
        # column of no labels goes first and position_acc[k] is slot k's.
        pad = torch.zeros_like(label_valid[..., :1])
        correct, label_valid = torch.cat([pad, correct], dim=-1), torch.cat([pad, label_valid], dim=-1)
    counts = block_counts(correct.flatten(0, 1), label_valid.flatten(0, 1))
    return DSparkLoss(loss, main.loss, confidence, rate, trained, counts)


@torch.no_grad()
def acceptance_rate(rows: Tensor, head: LogitsHead, teacher: BlockTeacher, weights: Tensor,
                    chunk_size: int | None = None) -> Tensor:  # [N, A, B] float32
    """sum_v min(p_v, q_v) = 1 - TV(draft, teacher) of every label-valid slot, chunk by chunk; 0 elsewhere."""
    valid = (weights > 0).flatten().nonzero().squeeze(1)  # [Mv]
    rate = torch.zeros(weights.numel(), dtype=torch.float32, device=weights.device)
    step = loss_chunk_slots(chunk_size, head.vocab_size or rows.shape[-1], weights.shape[-1])
    for start in range(0, valid.numel(), step):
        slots = valid[start:start + step]
        draft = torch.softmax(head(rows[slots]).float(), dim=-1)  # [c, V]
        target = torch.softmax(teacher.head(teacher.hidden[teacher.rows[slots]]).float(), dim=-1)  # [c, V]
        rate[slots] = torch.minimum(draft, target).sum(dim=-1)
    return rate.view(weights.shape)
