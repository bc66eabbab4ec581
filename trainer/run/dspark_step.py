"""One DSpark training step: DFlash's blocks (trainer/run/step.py `draft_blocks`), then DSpark's heads and loss
(trainer/model/dspark.py, trainer/model/dspark_loss.py). Reached through `training_step` for drafter_kind dspark.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.model.dspark import training_prev_ids
from trainer.model.dspark_loss import dspark_loss, dspark_slot_weights, teacher_rows
from trainer.model.loss import BlockTeacher
from trainer.run.step import StepPlan, draft_blocks
from trainer.target.frozen import FrozenTarget


def dspark_step(
    target: FrozenTarget,
    drafter: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    plan: StepPlan,
) -> tuple[torch.Tensor, dict[str, Any]]:
    if plan.dspark is None:
        raise ValueError("a dspark step needs the run's dspark settings (StepPlan.dspark)")
    module = drafter.module if hasattr(drafter, "module") else drafter  # DDP wraps it; the heads live inside
    sample_from_anchor = bool(plan.dspark["sample_from_anchor"])
    input_ids, doc_ids, loss_mask = batch["input_ids"], batch["doc_ids"], batch["loss_mask"]  # (N, S) each
    blocks = draft_blocks(target, drafter, batch, anchors, anchor_valid, plan)
    anchors, anchor_valid = anchors.to(input_ids.device), anchor_valid.to(input_ids.device)  # (N, A)
    N, A = anchors.shape
    S, B = input_ids.shape[1], plan.block_size
    hidden = blocks.hidden.reshape(N * A, B, -1)  # (N*A, B, H)
    prev_ids = training_prev_ids(input_ids, anchors, B, sample_from_anchor)  # (N, A, B) dspark.markov_prev_token
    markov, confidence = module.heads(hidden, prev_ids.reshape(N * A, B))  # (N*A, B, r) | None, (N*A, B) | None
    rows = teacher_rows(anchors, B, S, sample_from_anchor)  # (N, A, B)
    teacher = BlockTeacher(blocks.teacher_hidden.reshape(N * S, -1), target.teacher_head(None), rows.flatten())
    weights = dspark_slot_weights(anchors, anchor_valid, loss_mask, doc_ids, B, plan.gamma, sample_from_anchor)
    result = dspark_loss(
        hidden.reshape(N * A * B, -1),
        target.draft_head(None),
        markov.reshape(N * A * B, -1) if markov is not None else None,
        module.markov_head.markov_w2.weight if markov is not None else None,
        confidence.reshape(N * A * B) if confidence is not None else None,
        teacher, weights, plan.loss_kind, float(plan.dspark["confidence_head_alpha"]), sample_from_anchor,
        plan.loss_chunk_size,
    )
    metrics = result.metrics()
    metrics["tokens"] = int((doc_ids >= 0).sum())
    return result.loss, metrics
