"""One DFlash training step: frozen target -> anchors -> blocks -> drafter -> decay-weighted loss.

This is where the invariants meet; each line that realises one names it (ids as in sleuth's playbook).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.model.anchors import sample_anchors
from trainer.model.attention_mask import DraftAttention, build_attention_mask
from trainer.model.loss import (
    IDENTITY_HEAD,
    BlockTeacher,
    block_loss,
    metrics_from_counts,
    slot_weights,
    teacher_positions,
)
from trainer.target.frozen import FrozenTarget


@dataclass(frozen=True)
class StepPlan:
    """What the config resolved to for this target, fixed for the whole run."""

    feature_layer_ids: list[int]  # target layers concatenated into fc (dflash.fc_input_layers)
    logits_source: str | int  # "final" or an intermediate layer id (dflash.target_logits_source)
    block_size: int
    max_anchors: int
    gamma: float | None
    loss_kind: str
    context_includes_anchor: bool
    mask_token_id: int
    loss_weighting: str = "decay"  # "decay" (fixed gamma) | "dpace" (speculators' current default)
    dpace_alpha: float = 0.5
    draft_token_ids: torch.Tensor | None = None  # [Vd] target ids of a reduced draft vocabulary (sorted)
    loss_chunk_size: int | None = None  # block slots whose logits the loss holds at once (None: by vocabulary)
    draft_attention: DraftAttention | None = None  # the drafter's per-layer attention (sliding windows)
    drafter_kind: str = "dflash"  # which step trains it (trainer/run/steps.py `training_step`)
    dspark: dict[str, Any] | None = None  # DSparkConfig as a dict (drafter_kind "dspark")
    selector_loss_alpha: float = 1.0  # drafter_kind "dflash2": weight of the candidate selector's term

    @classmethod
    def from_config(cls, config: TrainConfig, target: FrozenTarget,
                    draft_token_ids: torch.Tensor | None = None) -> StepPlan:
        return cls(
            feature_layer_ids=config.fc_layer_ids(target.num_layers),
            logits_source=config.target_logits_source,
            block_size=config.block_size,
            max_anchors=config.max_anchors,
            gamma=config.loss_decay_gamma,
            loss_kind=config.loss,
            context_includes_anchor=config.context_includes_anchor,
            mask_token_id=config.mask_token_id if config.mask_token_id is not None else target.mask_token_id,
            loss_weighting=config.loss_weighting,
            dpace_alpha=config.dpace_alpha,
            draft_token_ids=draft_token_ids,
            loss_chunk_size=config.loss_chunk_size,
            draft_attention=draft_attention(config),
            drafter_kind=config.drafter_kind,
            dspark=config.dspark.model_dump() if config.dspark is not None else None,
            selector_loss_alpha=config.dflash2.selector_loss_alpha,
        )


def draft_attention(config: TrainConfig) -> DraftAttention | None:
    """The drafter's per-layer attention from the run's draft_config (None: every layer full attention)."""
    draft = config.draft_config
    if not draft.layer_types:
        return None
    return DraftAttention(tuple(draft.layer_types), draft.sliding_window, draft.sliding_window_non_causal)


def sample_step_anchors(
    batch: dict[str, torch.Tensor], plan: StepPlan, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors for the whole global batch, a function of (seed, step) alone: a resumed run samples exactly
    the blocks it would have, and every rank of a distributed run agrees before taking its rows."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed((seed * 1_000_003 + step) % 2**63)  # any seed in [0, 2**63) stays in 64 bits
    return sample_anchors(batch["loss_mask"], batch["doc_ids"], plan.block_size, plan.max_anchors, generator)


@dataclass
class DraftedBlocks:
    """What every DFlash-family step shares: the teacher's states and the drafted blocks."""

    teacher_hidden: torch.Tensor  # (N, S, H) the states the target's head turns into the teacher
    hidden: torch.Tensor  # (N, A*B, H) the drafter's final-normed block states


def draft_blocks(
    target: FrozenTarget,
    drafter: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    plan: StepPlan,
) -> DraftedBlocks:
    """Frozen target forward, then one drafter forward over every block (slot 0 = anchor, then masks)."""
    input_ids = batch["input_ids"]  # (N, S)
    position_ids = batch["position_ids"]  # (N, S) restart at 0 per document
    doc_ids = batch["doc_ids"]  # (N, S) -1 on padding
    B = plan.block_size

    # Frozen target, no grad: fused context features, and the hidden states its head turns into the teacher.
    features, teacher_hidden = target.forward_hidden(
        input_ids, position_ids, doc_ids, plan.feature_layer_ids, plan.logits_source
    )  # (N, S, k*H), (N, S, H)

    anchors, anchor_valid = anchors.to(input_ids.device), anchor_valid.to(input_ids.device)  # (N, A)
    N, A = anchors.shape
    S = input_ids.shape[1]

    # Block tokens: slot 0 = the anchor token, slots 1..B-1 = mask token.
    block_ids = torch.full((N, A, B), plan.mask_token_id, dtype=torch.long, device=input_ids.device)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    # dflash.block_position_ids: block token j sits at the anchor's position + j; context keeps its own.
    offsets = torch.arange(B, device=input_ids.device)
    block_positions = position_ids.gather(1, anchors)[:, :, None] + offsets  # (N, A, B)
    all_positions = torch.cat([position_ids, block_positions.reshape(N, A * B)], dim=1)  # (N, S + A*B)

    mask = build_attention_mask(  # one mask per drafter layer type when some layers slide
        anchors, anchor_valid, doc_ids, B, plan.context_includes_anchor, device=input_ids.device,
        attention=plan.draft_attention,
    )
    block_embeds = target.embed(block_ids.reshape(N, A * B))  # (N, A*B, H), frozen embeddings
    hidden = drafter(block_embeds, features, all_positions, attention_mask=mask)  # (N, A*B, H)
    return DraftedBlocks(teacher_hidden, hidden)


def dflash_step(
    target: FrozenTarget,
    drafter: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    plan: StepPlan,
    draft_logits_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Loss and metrics of one DFlash or DFlash2 step (DFlash2 adds its candidate selector's term).
    `draft_logits_hook` is the probe protocol's intervention point (trainer/probe.py): it gets the drafter's
    logits [N, A*B, V] and what it returns goes through the same chunked loss, with the run's chunk size, in
    their place."""
    if plan.drafter_kind not in ("dflash", "dflash2"):
        raise ValueError(f"dflash_step trains DFlash and DFlash2 drafters; this run's drafter_kind is "
                         f"{plan.drafter_kind!r}")
    if plan.drafter_kind == "dflash2" and draft_logits_hook is not None:
        raise ValueError("the probe protocol's logits hook does not cover DFlash2's candidate selector yet")
    doc_ids = batch["doc_ids"]  # (N, S) -1 on padding
    loss_mask = batch["loss_mask"]  # (N, S)
    B = plan.block_size
    blocks = draft_blocks(target, drafter, batch, anchors, anchor_valid, plan)
    teacher_hidden, hidden = blocks.teacher_hidden, blocks.hidden
    anchors, anchor_valid = anchors.to(doc_ids.device), anchor_valid.to(doc_ids.device)  # (N, A)
    N, A = anchors.shape
    S = doc_ids.shape[1]
    vocab = plan.draft_token_ids
    # frozen lm_head (dflash.frozen_embed_head); with a draft vocabulary, only its rows of those tokens
    head = target.draft_head(vocab)
    draft = hidden.reshape(N * A * B, -1)  # (N*A*B, H) block-major
    if draft_logits_hook is not None:
        draft, head = draft_logits_hook(head(hidden)).reshape(N * A * B, -1), IDENTITY_HEAD  # (N*A*B, V)
    # dflash.target_shift: slot j of the block at p learns the target's prediction at p+j-1; the teacher
    # restricted to the draft vocabulary's tokens, as speculators' verifier_lm_head[t2d].
    rows = teacher_positions(anchors, B, S) + torch.arange(N, device=anchors.device)[:, None, None] * S
    teacher = BlockTeacher(teacher_hidden.reshape(N * S, -1), target.teacher_head(vocab), rows.flatten())
    # D-PACE computes its own weights from the drafter's confidence: the slot weights then only mark labels.
    gamma = plan.gamma if plan.loss_weighting == "decay" else None
    weights = slot_weights(anchors, anchor_valid, loss_mask, doc_ids, B, gamma)  # (N, A, B)
    result = block_loss(draft, head, teacher, weights, plan.loss_kind, plan.loss_weighting, plan.dpace_alpha,
                        plan.loss_chunk_size)
    loss, metrics = result.loss, result.metrics()
    if plan.drafter_kind == "dflash2":
        loss, metrics = _with_selector_term(drafter, draft, head, result, batch["input_ids"], anchors, weights, plan)
    metrics["tokens"] = int((doc_ids >= 0).sum())
    return loss, metrics


def _with_selector_term(drafter: torch.nn.Module, draft: torch.Tensor, head: Any, unary: Any,
                        input_ids: torch.Tensor, anchors: torch.Tensor, weights: torch.Tensor,
                        plan: StepPlan) -> tuple[torch.Tensor, dict[str, Any]]:
    """DFlash2: unary + alpha * selector CE (trainer/model/dflash2_loss.py). acc, position_acc, streak and
    eal then count the selector's teacher-forced choice, what DFlash2 proposes at serving time."""
    from trainer.model.dflash2_loss import predecessor_ids, selector_counts, selector_loss

    selector = getattr(drafter, "module", drafter).candidate_selector  # under DDP, the wrapped drafter's
    gold = unary.teacher_ids  # dflash2.selector_gold_token: the teacher's argmax
    result = selector_loss(draft, head, selector, predecessor_ids(input_ids, anchors, plan.block_size), gold,
                           weights, plan.loss_chunk_size)
    counts = selector_counts(result, gold, weights)
    # the two loss terms go to metrics.jsonl next to the total (loss = unary_loss + alpha * selector_loss)
    kind_metrics = {"unary_loss": float(unary.loss.detach()), "selector_loss": float(result.loss.detach())}
    metrics = {**metrics_from_counts(counts), "counts": counts, "kind_metrics": kind_metrics,
               "unary_acc": unary.metrics()["acc"]}
    return unary.loss + plan.selector_loss_alpha * result.loss, metrics
