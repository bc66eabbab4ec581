"""FSDP2 for the drafter (`parallelism: fsdp2` under torchrun): each rank holds a shard of every weight and
of its optimizer state, and checkpoints stay in the one-process format (full tensors, parameter indices in
`drafter.parameters()` order), so a run resumes under any world size and either parallelism.

torch.distributed.fsdp.fully_shard shards each drafter layer and then the root, gradients are
reduce-scattered as averages (the same mean-over-rows semantics as DDP), and the full state is gathered
with torch.distributed.checkpoint.state_dict's full-state-dict API only when a checkpoint or an eval needs
it. Gathering is a collective: every rank calls these functions, rank 0 receives the tensors.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard_drafter(drafter: torch.nn.Module) -> list[str]:
    """Shard in place (layers first, then the root for fc, norms); returns the parameter names in the
    unsharded order, which is the index order of saved optimizer states."""
    names = [name for name, _ in drafter.named_parameters()]
    for layer in getattr(drafter, "layers", []):
        fully_shard(layer)
    fully_shard(drafter)
    return names


class _Snapshot:
    """What save_checkpoint reads (`state_dict()`), holding already-gathered tensors."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


def gather_full_state(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      names: list[str]) -> tuple[_Snapshot, _Snapshot]:
    """(weights, optimizer) as one process would hold them; full on rank 0, empty elsewhere."""
    weights = get_model_state_dict(drafter, options=FULL)
    by_name = get_optimizer_state_dict(drafter, optimizer, options=FULL)
    index = {name: i for i, name in enumerate(names)}
    state = {index[name]: fields for name, fields in by_name.get("state", {}).items()}
    groups = [{**group, "params": [index[name] for name in group["params"]]} for group in by_name.get("param_groups", [])]
    return _Snapshot(weights), _Snapshot({"state": state, "param_groups": groups})


class ShardedOptimizerLoader:
    """What restore_training_state calls (`load_state_dict`), loading a one-process optimizer state (keyed
    by parameter index) into the sharded optimizer."""

    def __init__(self, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, names: list[str]) -> None:
        self.drafter, self.optimizer, self.names = drafter, optimizer, names

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state = {self.names[int(i)]: fields for i, fields in saved["state"].items()}
        groups = [{**group, "params": [self.names[int(i)] for i in group["params"]]} for group in saved["param_groups"]]
        set_optimizer_state_dict(self.drafter, self.optimizer, {"state": state, "param_groups": groups},
                                 options=StateDictOptions(full_state_dict=True))


def unsharded_copy(template: torch.nn.Module | None, drafter: torch.nn.Module) -> torch.nn.Module | None:
    """A plain drafter holding the sharded one's current weights, on rank 0 (which holds the unsharded
    `template`); every rank must call it, the others get None."""
    weights = get_model_state_dict(drafter, options=FULL)
    if not weights or template is None:
        return None
    model = copy.deepcopy(template)
    model.load_state_dict(weights)
    return model
