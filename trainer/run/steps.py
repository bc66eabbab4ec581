"""Which step trains a run's drafter: one function per drafter kind, chosen by StepPlan.drafter_kind.

The loop and validation call `training_step`; each kind's step lives in its own module (DFlash and DFlash2:
step.py, where DFlash2 only adds its selector's term; DSpark: dspark_step.py), so a kind's code path is read in
one place.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.run.dspark_step import dspark_step
from trainer.run.step import StepPlan, dflash_step
from trainer.target.frozen import FrozenTarget

STEPS = {"dflash": dflash_step, "dflash2": dflash_step, "dspark": dspark_step}


def training_step(
    target: FrozenTarget,
    drafter: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    plan: StepPlan,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Loss and metrics of one step of the run's drafter kind."""
    step = STEPS.get(plan.drafter_kind)
    if step is None:
        raise ValueError(f"no training step for drafter_kind {plan.drafter_kind!r}; known: {', '.join(STEPS)}")
    return step(target, drafter, batch, anchors, anchor_valid, plan)
