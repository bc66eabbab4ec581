"""The optimizer of a run: AdamW, or Muon for the 2-D weight matrices with AdamW for the rest.

speculators' `train/optimizers.py` (0.9.0) is the recipe followed: a parameter goes to Muon iff it is
trainable, 2-D with both dimensions > 1, and not an embedding or output head (our drafter has neither:
the target's are frozen outside it); everything else (norm gains) goes to AdamW. Both use torch's own
implementations. Muon's peak lr is `muon_lr` (speculators: defaults to `lr`), and the schedule scales
both groups alike: every param group carries `lr_scale`, its peak lr relative to `config.lr`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.config import TrainConfig

# Matrices that stay with AdamW even though they are 2-D (Keller Jordan's Muon convention, as speculators).
ADAMW_NAME_HINTS = ("embed_tokens", "lm_head")


def build_optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer | OptimizerChain:
    if config.optimizer == "adamw":
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        for group in optimizer.param_groups:
            group["lr_scale"] = 1.0
        return optimizer
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError(f"optimizer 'muon' needs torch >= 2.9 (torch.optim.Muon); this is torch {torch.__version__}")
    muon_params, adamw_params = split_params_for_muon(model)
    parts: list[torch.optim.Optimizer] = []
    muon_lr = config.muon_lr if config.muon_lr is not None else config.lr
    if muon_params:
        # FSDP2 holds each matrix as a DTensor shard; Newton-Schulz needs the whole matrix (GatheringMuon).
        muon_type = GatheringMuon if any(_is_dtensor(p) for p in muon_params) else torch.optim.Muon
        parts.append(
            muon_type(
                muon_params, lr=muon_lr, momentum=config.muon_momentum, weight_decay=config.muon_weight_decay,
                ns_steps=config.muon_ns_steps, adjust_lr_fn=config.muon_adjust_lr_fn,
            )
        )
        parts[-1].param_groups[0]["lr_scale"] = muon_lr / config.lr
    if adamw_params:
        parts.append(
            torch.optim.AdamW(adamw_params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
        )
        parts[-1].param_groups[0]["lr_scale"] = 1.0
    if not parts:
        raise ValueError("the drafter has no trainable parameters")
    return OptimizerChain(parts)


def split_params_for_muon(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon params, AdamW params), each in named_parameters order: speculators' split_named_params_for_muon."""
    muon: list[torch.nn.Parameter] = []
    adamw: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim == 2 and min(param.shape) > 1 and not any(hint in name for hint in ADAMW_NAME_HINTS):
            muon.append(param)
        else:
            adamw.append(param)
    return muon, adamw


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "full_tensor") and hasattr(tensor, "device_mesh")


class GatheringMuon(torch.optim.Muon):
    """torch's Muon for FSDP2-sharded matrices (`parallelism: fsdp2`, `optimizer: muon`).

    Muon orthogonalises each matrix's whole update (Newton-Schulz on the full 2-D matrix), so a shard alone
    cannot be updated. Per matrix, every rank all-gathers the parameter, its gradient and its momentum
    buffer, runs torch's own functional Muon on the full tensors (the exact computation one process makes)
    and keeps its own shard of the new parameter and buffer. The state stays sharded between steps (a
    DTensor momentum buffer per matrix, gathered into checkpoints like AdamW's moments), at the price of
    three all-gathers and one full matrix at a time per Muon matrix per step.
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        from torch.distributed.tensor import distribute_tensor
        from torch.optim._muon import muon

        if closure is not None:
            raise ValueError("GatheringMuon.step takes no closure")
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
                buffer = state["momentum_buffer"]
                full_param, full_buffer = param.full_tensor(), buffer.full_tensor()
                muon([full_param], [param.grad.full_tensor()], [full_buffer], lr=group["lr"],
                     weight_decay=group["weight_decay"], momentum=group["momentum"], nesterov=group["nesterov"],
                     ns_coefficients=group["ns_coefficients"], eps=group["eps"], ns_steps=group["ns_steps"],
                     adjust_lr_fn=group["adjust_lr_fn"], has_complex=False)
                # Every rank computed the same full tensors: each keeps its shard, no communication.
                for sharded, full in ((param, full_param), (buffer, full_buffer)):
                    mine = distribute_tensor(full, sharded.device_mesh, sharded.placements, src_data_rank=None)
                    sharded.to_local().copy_(mine.to_local())


def optimizer_kind(part: torch.optim.Optimizer) -> str:
    """The torch optimizer a part is (GatheringMuon is Muon): a checkpoint resumes across parallelisms."""
    for cls in type(part).__mro__:
        if cls.__module__.startswith("torch.optim"):
            return cls.__name__
    return type(part).__name__


class OptimizerChain:
    """Several optimizers stepped together, seen as one: param groups and state in one `state_dict`.

    The checkpoint format (state.<i>.<field> tensors + param groups as JSON) is the single optimizer's:
    parameter indices run on across the parts in order, and every group records which part it belongs to,
    so a checkpoint restores exactly and says what it was made with.
    """

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts for group in part.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError("OptimizerChain.step takes no closure")
        for part in self.parts:
            part.step()

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for index, part in enumerate(self.parts):
            saved = part.state_dict()
            for param_index, fields in saved["state"].items():
                state[param_index + offset] = fields
            count = 0
            for group in saved["param_groups"]:
                groups.append({**group, "params": [p + offset for p in group["params"]], "part": index,
                               "part_type": optimizer_kind(part)})
                count += len(group["params"])
            offset += count
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        offset = 0
        for index, part in enumerate(self.parts):
            mine = [g for g in groups if g.get("part") == index]
            if not mine or any(g.get("part_type") != optimizer_kind(part) for g in mine):
                raise ValueError(
                    f"the checkpoint's optimizer does not match this run's ({optimizer_kind(part)} part {index})"
                )
            count = sum(len(g["params"]) for g in mine)
            local_groups = []
            for group in mine:
                restored = {k: v for k, v in group.items() if k not in ("part", "part_type")}
                restored["params"] = [p - offset for p in group["params"]]
                if isinstance(restored.get("ns_coefficients"), list):  # JSON turned the tuple into a list
                    restored["ns_coefficients"] = tuple(restored["ns_coefficients"])
                local_groups.append(restored)
            local_state = {
                i - offset: fields for i, fields in state_dict["state"].items() if offset <= int(i) < offset + count
            }
            part.load_state_dict({"state": local_state, "param_groups": local_groups})
            offset += count
