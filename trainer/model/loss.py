"""DFlash training targets, loss and metrics.

Block a is anchored at context position p and has B slots: slot 0 holds the anchor token, slots 1..B-1
hold mask tokens. Slot j predicts token p+j, so its target is the target model's distribution at
position p+j-1, whose next-token prediction is token p+j (rule `dflash.target_shift`; speculators
src/speculators/models/dflash/core.py rolls the verifier logits by one for exactly this).
Slot 0 predicts nothing and gets weight 0 (`dflash.anchor_slot_untrained`); slot k >= 1 weighs
exp(-(k-1)/gamma) (`dflash.loss_decay_gamma`; speculators src/speculators/losses/utils.py
`dflash_loss_decay`), or, with D-PACE weighting, a weight that depends on the drafter's own confidence
(speculators `dpace_loss_decay`, its current DFlash default: `dpace_weights` below).

Memory. Real vocabularies are large (Qwen3 151936, Qwen3.5/3.6 248320): one float32 logit row is 1 MB,
and [N, A, B, V] drafter logits next to the teacher's are tens of GB at the reference recipe's 3072
anchors x 16. So neither is ever built whole. `block_loss` takes the drafter's final hidden states and
the teacher's hidden states (the input of the target's own head) and walks the blocks in chunks: for each
chunk it computes the drafter's and the teacher's logits of the label-valid slots only, the per-slot loss,
the metrics' argmaxes and, when a gradient is wanted, d loss / d hidden (softmax minus target, times the
slot's weight, through the head) right there, so the chunk's logits are freed before the next chunk
(Liger-Kernel's fused linear cross entropy; speculators' fused loss, PR #951, fuses only after the head).
Peak memory is set by the chunk (`loss_chunk_slots`), not by A*B*V; the numbers equal the whole-tensor
formula (`dflash_loss` below keeps that interface; tests/trainer/test_chunked_loss.py compares both with
a naive reference, gradients included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

# speculators src/speculators/losses/utils.py `_LOSS_REDUCTION_EPS`: keeps a row without labels at 0 loss.
LOSS_REDUCTION_EPS = 1e-5
# Default chunk: as many block slots as keep one chunk's float32 logits within this many bytes (CE holds one
# such tensor at a time, KL four). Smaller chunks cost speed as well as saving memory: each chunk streams the
# whole [V, H] head through three matmuls, so at V 248320 chunks of 64 slots took 1.15-1.3x the CPU time of
# 256 (1024 no faster than 256; bench/loss_memory.py inputs, one thread). 256 MiB is 256 slots there.
LOSS_CHUNK_BYTES = 256 * 2**20


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
    per_slot_ce: Tensor,  # [..., B] cross entropy of every slot (any value where not label-valid)
    label_valid: Tensor,  # [..., B] bool: slot k >= 1 with a supervised label in the anchor's document
    alpha: float,
) -> Tensor:  # [..., B] float32, no grad
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
    prefix = torch.cumprod(smooth, dim=-1)  # [..., B]
    suffix = torch.flip(torch.cumsum(torch.flip(prefix * mask, dims=[-1]), dim=-1), dims=[-1])
    return suffix * mask


def block_positions(anchors: Tensor, block_size: int) -> Tensor:  # [N, A, B] long: p + j
    """Context position of every block slot: slot j of the block anchored at p sits at p + j."""
    offsets = torch.arange(block_size, device=anchors.device)  # [B]
    return anchors.unsqueeze(-1) + offsets  # [N, A, B]


def teacher_positions(anchors: Tensor, block_size: int, seq_len: int) -> Tensor:  # [N, A, B] long
    """Where slot j of the block anchored at p finds its target: context position p+j-1.

    Clamping only keeps slot 0 of an anchor at 0 and out-of-row slots in bounds; slot_weights zeroes them.
    """
    return (block_positions(anchors, block_size) - 1).clamp(0, seq_len - 1)


def gather_block_logits(
    target_logits: Tensor,  # [N, S, V] the target model's logits over the packed rows
    anchors: Tensor,  # [N, A]
    block_size: int,
) -> Tensor:  # [N, A, B, V]
    """Slot j (j >= 1) of the block anchored at p gets target_logits[:, p+j-1]; slot 0 gets zeros.

    The whole-tensor form of the shift, for small vocabularies and for tests; the step itself never
    builds [N, S, V] (it hands `block_loss` the teacher's hidden states and `teacher_positions`)."""
    num_rows, seq_len, vocab = target_logits.shape
    num_anchors = anchors.shape[1]
    source = teacher_positions(anchors, block_size, seq_len)  # [N, A, B]
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


# --- heads: logits from hidden rows, without ever holding more rows than a chunk ------------------------


@dataclass(frozen=True)
class LogitsHead:
    """Logits of hidden rows: F.linear(x, weight, bias), then the family's output transform; with weight
    None the rows already are logits (the probe protocol hands the loss the drafter's logits themselves)."""

    weight: Tensor | None = None  # [V, H] lm_head rows (a draft vocabulary's rows only, if it has one)
    bias: Tensor | None = None  # [V]
    scale: float | None = None  # logits * scale: Cohere's logit_scale, Granite's 1 / logits_scaling
    softcap: float | None = None  # cap * tanh(logits / cap): Gemma's final_logit_softcapping

    def __call__(self, rows: Tensor) -> Tensor:  # [M, H] -> [M, V]
        logits = rows if self.weight is None else F.linear(rows, self.weight, self.bias)
        if self.scale is not None:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @property
    def vocab_size(self) -> int | None:
        return None if self.weight is None else int(self.weight.shape[0])


IDENTITY_HEAD = LogitsHead()


@dataclass(frozen=True)
class BlockTeacher:
    """What every slot is trained toward: the head of `hidden` at the row `rows` names for the slot."""

    hidden: Tensor  # [R, H] the teacher's head input, e.g. the target's final-normed states of all N*S positions
    head: LogitsHead  # the target's own head (restricted to the draft vocabulary like the drafter's)
    rows: Tensor  # [M] long, block-major over [N, A, B]: the row of `hidden` slot m learns from


def loss_chunk_slots(chunk_size: int | None, vocab_size: int, block_size: int) -> int:
    """Block slots per loss chunk: `chunk_size` (None: LOSS_CHUNK_BYTES of float32 logits), rounded down
    to whole blocks (D-PACE weighs a slot by its block's other slots) and at least one block."""
    if chunk_size is None:
        chunk_size = LOSS_CHUNK_BYTES // (4 * max(1, vocab_size))
    return max(block_size, chunk_size // block_size * block_size)


@dataclass
class BlockLoss:
    loss: Tensor  # scalar, with its graph when a gradient was wanted
    counts: dict[str, Any]  # block_counts: what metrics_from_counts turns into acc, position_acc, streak, eal
    draft_ids: Tensor  # [N, A, B] long: the drafter's argmax per label-valid slot, -1 elsewhere
    teacher_ids: Tensor  # [N, A, B] long: the teacher's argmax per label-valid slot, -1 elsewhere

    def metrics(self) -> dict[str, Any]:
        return {**metrics_from_counts(self.counts), "counts": self.counts}


def block_loss(
    draft: Tensor,  # [M, H] the drafter's final hidden states, block-major over [N, A, B] (or logits: head IDENTITY)
    head: LogitsHead,  # the frozen lm_head the drafter shares with the target (dflash.frozen_embed_head)
    teacher: BlockTeacher,
    weights: Tensor,  # [N, A, B] from slot_weights
    kind: Literal["ce", "kl"],
    weighting: Literal["decay", "dpace"] = "decay",
    dpace_alpha: float = 0.5,
    chunk_size: int | None = None,  # block slots per chunk; see loss_chunk_slots
) -> BlockLoss:
    """Per-slot loss, decay-weighted and normalised the way speculators does it, chunk by chunk.

    Normalisation follows speculators src/speculators/losses/utils.py `loss_function`: per packed row,
    sum(decay * label_valid * loss) / (number of label-valid slots + 1e-5), then the mean over rows.
    The denominator counts valid slots; it is not the sum of the decayed weights. A slot is label-valid
    exactly where its weight is > 0 (decay is positive for every slot k >= 1); only those are computed.

    kind "ce": cross entropy against the teacher's argmax (speculators' DFlash default, rule
    `dflash.loss_kind`); "kl": KL(teacher softmax || draft softmax), speculators losses/eager.py kl_div_loss.
    weighting "decay": `weights` as given (fixed exponential decay); "dpace": `weights` only says which slots
    are label-valid (build them with gamma None) and D-PACE replaces the decay (CE only, as speculators
    requires). Logits are float32 from the head's output on (bf16 matmuls accumulate in float32 already).
    """
    if kind not in ("ce", "kl"):
        raise ValueError(f"loss kind must be 'ce' or 'kl', got {kind!r}")
    if weighting not in ("decay", "dpace"):
        raise ValueError(f"loss weighting must be 'decay' or 'dpace', got {weighting!r}")
    if weighting == "dpace" and kind != "ce":
        raise ValueError("D-PACE weighting needs the cross-entropy loss (loss: ce), as speculators requires")
    if head.scale is not None or head.softcap:
        raise ValueError("the drafter's head must be linear (the target's lm_head rows)")
    num_rows, num_anchors, block_size = weights.shape
    if draft.shape[0] != weights.numel() or teacher.rows.shape[0] != weights.numel():
        raise ValueError(f"draft {tuple(draft.shape)} and teacher rows {tuple(teacher.rows.shape)} must have one "
                         f"row per slot of weights {tuple(weights.shape)}")
    vocab = head.vocab_size or int(draft.shape[-1])
    plan = _ChunkPlan(teacher, weights.float(), kind, weighting, dpace_alpha,
                      loss_chunk_slots(chunk_size, vocab, block_size))
    weight, bias = head.weight, head.bias
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (draft, weight, bias)
    )
    if wants_grad:
        loss = _FusedBlockLoss.apply(draft, weight, bias, plan)
    else:
        loss = _forward(draft, weight, bias, plan, grads=(False, False, False))[0]
    return BlockLoss(loss, plan.counts, plan.draft_ids.view(weights.shape), plan.teacher_ids.view(weights.shape))


class _ChunkPlan:
    """What one block_loss call walks over, and what its forward leaves behind (counts, argmaxes)."""

    def __init__(self, teacher: BlockTeacher, weights: Tensor, kind: str, weighting: str, alpha: float,
                 chunk_slots: int) -> None:
        self.teacher, self.weights, self.kind, self.weighting, self.alpha = teacher, weights, kind, weighting, alpha
        num_rows, num_anchors, block_size = weights.shape
        self.block_size, self.slots_per_row = block_size, num_anchors * block_size
        self.chunk_blocks = chunk_slots // block_size
        self.label_valid = (weights > 0).flatten()  # [M]
        self.valid = self.label_valid.nonzero().squeeze(1)  # [Mv] sorted slot indices that carry a loss
        self.row_count = (weights > 0).flatten(1).sum(dim=1).float()  # [N] label-valid slots per row
        self.counts: dict[str, Any] = {}
        self.draft_ids = torch.full((weights.numel(),), -1, dtype=torch.long, device=weights.device)
        self.teacher_ids = self.draft_ids.clone()

    def chunks(self) -> list[tuple[int, int, Tensor]]:
        """(first slot, slots, label-valid slot indices) of every chunk of whole blocks that has a label."""
        total = self.label_valid.numel()
        step = self.chunk_blocks * self.block_size
        starts = list(range(0, total, step))
        bounds = torch.searchsorted(self.valid, torch.tensor(starts + [total], device=self.valid.device)).tolist()
        return [(start, min(step, total - start), self.valid[lo:hi])
                for start, lo, hi in zip(starts, bounds[:-1], bounds[1:]) if hi > lo]

    @torch.no_grad()
    def hard_targets(self) -> Tensor:  # [Mv] long: the teacher's argmax at every label-valid slot
        """CE needs only the teacher's argmax: computed once per distinct source position (neighbouring
        blocks share most of theirs), chunk by chunk, instead of once per slot."""
        teacher = self.teacher
        sources, inverse = torch.unique(teacher.rows[self.valid], return_inverse=True)
        step = self.chunk_blocks * self.block_size
        ids = torch.cat([teacher.head(teacher.hidden[sources[i:i + step]]).argmax(dim=-1)
                         for i in range(0, sources.numel(), step)]) if sources.numel() else sources
        return ids[inverse]


def _forward(draft: Tensor, weight: Tensor | None, bias: Tensor | None, plan: _ChunkPlan,
             grads: tuple[bool, bool, bool]) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The loss, and d loss / d (draft, weight, bias) where `grads` asks, chunk by chunk (see block_loss)."""
    draft = draft.detach()
    weight = weight.detach() if weight is not None else None
    bias = bias.detach() if bias is not None else None
    grad_draft = torch.zeros_like(draft) if grads[0] else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads[1] and weight is not None else None
    grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if grads[2] and bias is not None else None
    device = draft.device
    weights = plan.weights.flatten()  # [M]
    row_sum = torch.zeros(plan.row_count.shape, dtype=torch.float32, device=device)  # [N]
    inverse_count = 1.0 / ((plan.row_count + LOSS_REDUCTION_EPS) * plan.row_count.numel())  # [N] d loss / d row_sum
    hard = plan.hard_targets() if plan.kind == "ce" else None  # [Mv]
    position = torch.zeros(plan.label_valid.shape, dtype=torch.long, device=device)  # slot -> index into valid
    position[plan.valid] = torch.arange(plan.valid.numel(), device=device)
    teacher, block_size = plan.teacher, plan.block_size

    def chunk(start: int, length: int, slots: Tensor) -> None:
        """One chunk: every [c, V] tensor is local here and freed when it returns."""
        x = draft.index_select(0, slots)  # [c, H] or [c, V]
        # [c, V]; with the identity head these are x itself (a copy made by index_select), free to overwrite
        logits = (F.linear(x, weight, bias) if weight is not None else x).float()
        best, draft_ids = logits.max(dim=-1)  # [c]: one pass gives the argmax and the max
        plan.draft_ids[slots] = draft_ids
        if hard is not None:
            target_ids = hard[position[slots]]  # [c]
            picked = logits.gather(1, target_ids[:, None]).squeeze(1)  # [c] the target's logit
        # One exp per logit: exp(z - max) serves the log-sum-exp and, divided by its sum, the softmax.
        shifted = logits.sub_(best[:, None])  # [c, V] z - max, in place
        probs = shifted.exp_() if hard is not None else shifted.exp()  # CE needs no shifted logits after this
        total = probs.sum(dim=-1, keepdim=True)  # [c, 1]
        log_total = total.log()
        if hard is not None:
            per_slot = best + log_total.squeeze(1) - picked  # [c] CE = lse - z_target
            target_probs = None
        else:
            target_logp, target_probs, target_ids = _log_softmax(
                teacher.head(teacher.hidden[teacher.rows[slots]]).float())  # [c, V], [c, V], [c]
            # KL(t || d) = sum t * (log t - log d), log d = shifted - log_total (speculators' eager KL formula)
            per_slot = target_logp.sub_(shifted).add_(log_total).mul_(target_probs).sum(dim=-1)  # [c], in place
            del target_logp, shifted, logits  # only the two softmaxes are left for the gradient
        plan.teacher_ids[slots] = target_ids
        slot_weight = weights[slots]  # [c]
        if plan.weighting == "dpace":  # D-PACE weighs a slot by the confidence of its block's other slots
            blocks = length // block_size
            ce = torch.zeros(length, dtype=torch.float32, device=device)
            ce[slots - start] = per_slot.detach()
            valid = plan.label_valid[start:start + length].view(blocks, block_size)
            slot_weight = dpace_weights(ce.view(blocks, block_size), valid, plan.alpha).flatten()[slots - start]
        row = slots // plan.slots_per_row  # [c] packed row of each slot
        row_sum.index_add_(0, row, slot_weight * per_slot)
        if grad_draft is not None or grad_weight is not None or grad_bias is not None:
            # d loss / d logits = softmax(draft) - target, times the slot's weight and its row's 1 / (count N)
            grad = probs.div_(total)  # [c, V] the drafter's softmax, in place
            if target_probs is None:
                grad[torch.arange(grad.shape[0], device=device), target_ids] -= 1.0
            else:
                grad.sub_(target_probs)
            grad.mul_((slot_weight * inverse_count[row])[:, None])
            if grad_draft is not None:
                grad_x = grad.to(draft.dtype)
                grad_draft.index_copy_(0, slots, grad_x @ weight if weight is not None else grad_x)
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), x.float())
            if grad_bias is not None:
                grad_bias.add_(grad.sum(dim=0))

    for start, length, slots in plan.chunks():
        chunk(start, length, slots)
    plan.counts = block_counts(plan.draft_ids.view(-1, block_size) == plan.teacher_ids.view(-1, block_size),
                               plan.label_valid.view(-1, block_size))
    loss = (row_sum / (plan.row_count + LOSS_REDUCTION_EPS)).mean()
    cast = (lambda g, like: g.to(like.dtype) if g is not None else None)
    return loss, grad_draft, cast(grad_weight, weight), cast(grad_bias, bias)


def _log_softmax(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # [c, V] float32, overwritten
    """(log softmax, softmax, argmax) of each row with one exp per logit; `logits` becomes the log softmax."""
    best, ids = logits.max(dim=-1)
    probs = logits.sub_(best[:, None]).exp()
    total = probs.sum(dim=-1, keepdim=True)
    return logits.sub_(total.log()), probs.div_(total), ids


class _FusedBlockLoss(torch.autograd.Function):
    """block_loss with its gradient computed in the forward chunk by chunk; backward only scales it."""

    @staticmethod
    def forward(ctx: Any, draft: Tensor, weight: Tensor | None, bias: Tensor | None, plan: _ChunkPlan) -> Tensor:
        loss, grad_draft, grad_weight, grad_bias = _forward(draft, weight, bias, plan, ctx.needs_input_grad[:3])
        ctx.save_for_backward(grad_draft, grad_weight, grad_bias)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        grads = tuple(g * grad_loss.to(g.dtype) if g is not None else None for g in ctx.saved_tensors)
        return (*grads, None)


def dflash_loss(
    draft_logits: Tensor,  # [N, A, B, V]
    target_block_logits: Tensor,  # [N, A, B, V] from gather_block_logits
    weights: Tensor,  # [N, A, B] from slot_weights
    kind: Literal["ce", "kl"],
    weighting: Literal["decay", "dpace"] = "decay",
    dpace_alpha: float = 0.5,
    chunk_size: int | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """block_loss on whole logit tensors (small vocabularies, tests): the same loss, metrics and gradient."""
    vocab = draft_logits.shape[-1]
    teacher = BlockTeacher(target_block_logits.detach().reshape(-1, vocab), IDENTITY_HEAD,
                           torch.arange(weights.numel(), device=weights.device))
    result = block_loss(draft_logits.reshape(-1, vocab), IDENTITY_HEAD, teacher, weights, kind, weighting,
                        dpace_alpha, chunk_size)
    return result.loss, result.metrics()


@torch.no_grad()
def block_counts(
    correct: Tensor,  # [N*A, B] bool: the drafter's argmax is the teacher's (any value where not label-valid)
    label_valid: Tensor,  # [N*A, B] bool
) -> dict[str, Any]:
    """Greedy agreement counts over label-valid slots 1..B-1 (metrics_from_counts turns them into metrics).

    acc: fraction of label-valid slots where draft argmax == target argmax (speculators `full_acc`).
    position_acc: the same per slot 1..B-1 (speculators `position_{i}_acc`; 0.0 for a slot with no labels).
    streak: mean accepted prefix per block: consecutive correct slots from slot 1, stopping at the first
        wrong slot or the first slot without a label; over blocks with at least one label-valid slot.
    eal: sum_k prod_{i<=k} position_acc_i (speculators dflash/metrics.py; no +1 for the bonus token).
    """
    correct = correct & label_valid
    correct, label_valid = correct[..., 1:], label_valid[..., 1:]  # slot 0 is never a prediction
    prefix = correct.long().cumprod(dim=-1).sum(dim=-1)  # [N*A] correct slots before the first miss
    has_label = label_valid.any(dim=-1)  # [N*A]
    # Counts, not ratios, are what add up across the ranks of a distributed run (metrics_from_counts).
    return {
        "correct": correct.sum(dim=0).tolist(),  # [B-1]
        "labels": label_valid.sum(dim=0).tolist(),  # [B-1]
        "prefix": float(prefix[has_label].sum()),
        "blocks": int(has_label.sum()),
    }


def metrics_from_counts(counts: dict[str, Any]) -> dict[str, Any]:
    """acc, position_acc, streak and eal from the (possibly summed over ranks) counts of block_counts."""
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
