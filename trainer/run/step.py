"""One DFlash training step: frozen target -> anchors -> blocks -> drafter -> decay-weighted loss.

This is where the invariants meet; each line that realises one names it (ids as in sleuth's playbook).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.model.anchors import sample_anchors
from trainer.model.attention_mask import DraftAttention, build_attention_mask
from trainer.model.loss import dflash_loss, gather_block_logits, slot_weights
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
    draft_attention: DraftAttention | None = None  # the drafter's per-layer attention (sliding windows)

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
            draft_attention=draft_attention(config),
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


def dflash_step(
    target: FrozenTarget,
    drafter: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    plan: StepPlan,
) -> tuple[torch.Tensor, dict[str, Any]]:
    input_ids = batch["input_ids"]  # (N, S)
    position_ids = batch["position_ids"]  # (N, S) restart at 0 per document
    doc_ids = batch["doc_ids"]  # (N, S) -1 on padding
    loss_mask = batch["loss_mask"]  # (N, S)
    B = plan.block_size

    # Frozen target, no grad: fused context features and the logits the drafter is trained toward.
    features, target_logits = target.forward_packed(
        input_ids, position_ids, doc_ids, plan.feature_layer_ids, plan.logits_source
    )  # (N, S, k*H), (N, S, V)

    anchors, anchor_valid = anchors.to(input_ids.device), anchor_valid.to(input_ids.device)  # (N, A)
    N, A = anchors.shape

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
    vocab = plan.draft_token_ids
    # frozen lm_head (dflash.frozen_embed_head); with a draft vocabulary, only its rows of those tokens
    draft_logits = target.logits(hidden, vocab).reshape(N, A, B, -1)  # (N, A, B, V or Vd)
    if vocab is not None:  # the teacher restricted to the same tokens, as speculators' verifier_lm_head[t2d]
        target_logits = target_logits[..., vocab.to(target_logits.device)]

    # dflash.target_shift: slot j of the block at p learns the target's prediction at p+j-1.
    target_block_logits = gather_block_logits(target_logits, anchors, B)  # (N, A, B, V or Vd)
    del target_logits  # (N, S, V) is the largest tensor of the step; only the gathered blocks are needed
    # D-PACE computes its own weights from the drafter's confidence: the slot weights then only mark labels.
    gamma = plan.gamma if plan.loss_weighting == "decay" else None
    weights = slot_weights(anchors, anchor_valid, loss_mask, doc_ids, B, gamma)  # (N, A, B)
    loss, metrics = dflash_loss(draft_logits.float(), target_block_logits.float(), weights, plan.loss_kind,
                                plan.loss_weighting, plan.dpace_alpha)
    metrics["tokens"] = int((doc_ids >= 0).sum())
    return loss, metrics
