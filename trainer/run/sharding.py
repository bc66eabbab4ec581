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


def _parts(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind a run's optimizer: AdamW alone, or OptimizerChain's Muon + AdamW."""
    return list(getattr(optimizer, "parts", [optimizer]))


def _part_names(drafter: torch.nn.Module, part: torch.optim.Optimizer) -> list[str]:
    """The parameter names of one optimizer, in its own order: the index order of the one-process format."""
    name_of = {id(param): name for name, param in drafter.named_parameters()}
    return [name_of[id(param)] for group in part.param_groups for param in group["params"]]


def gather_full_state(drafter: torch.nn.Module, optimizer: Any,
                      names: list[str]) -> tuple[_Snapshot, _Snapshot]:
    """(weights, optimizer) as one process would hold them; full on rank 0, empty elsewhere. A chained
    optimizer (Muon + AdamW) is gathered part by part into OptimizerChain's one-process layout (indices run
    on across the parts; every group says its part)."""
    from trainer.run.optim import optimizer_kind

    weights = get_model_state_dict(drafter, options=FULL)
    chained = hasattr(optimizer, "parts")
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    offset = 0
    for index, part in enumerate(_parts(optimizer)):
        part_names = _part_names(drafter, part)
        position = {name: offset + i for i, name in enumerate(part_names)}
        by_name = get_optimizer_state_dict(drafter, part, options=FULL)
        state.update({position[name]: fields for name, fields in by_name.get("state", {}).items()})
        for group in by_name.get("param_groups", []):
            restored = {**group, "params": [position[name] for name in group["params"]]}
            if chained:
                restored.update(part=index, part_type=optimizer_kind(part))
            groups.append(restored)
        offset += len(part_names)
    return _Snapshot(weights), _Snapshot({"state": state, "param_groups": groups})


class ShardedOptimizerLoader:
    """What restore_training_state calls (`load_state_dict`), loading a one-process optimizer state (keyed
    by parameter index) into the sharded optimizer, part by part for a chain."""

    def __init__(self, drafter: torch.nn.Module, optimizer: Any, names: list[str]) -> None:
        self.drafter, self.optimizer, self.names = drafter, optimizer, names

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        from trainer.run.optim import optimizer_kind

        chained = hasattr(self.optimizer, "parts")
        offset = 0
        for index, part in enumerate(_parts(self.optimizer)):
            part_names = _part_names(self.drafter, part)
            mine = [g for g in saved["param_groups"] if not chained or g.get("part") == index]
            if chained and (not mine or any(g.get("part_type") != optimizer_kind(part) for g in mine)):
                raise ValueError(
                    f"the checkpoint's optimizer does not match this run's ({optimizer_kind(part)} part {index})"
                )
            name_at = {offset + i: name for i, name in enumerate(part_names)}
            groups = []
            for group in mine:
                restored = {k: v for k, v in group.items() if k not in ("part", "part_type")}
                restored["params"] = [name_at[int(i)] for i in group["params"]]
                if isinstance(restored.get("ns_coefficients"), list):  # JSON turned the tuple into a list
                    restored["ns_coefficients"] = tuple(restored["ns_coefficients"])
                groups.append(restored)
            state = {name_at[int(i)]: fields for i, fields in saved["state"].items() if int(i) in name_at}
            set_optimizer_state_dict(self.drafter, part, {"state": state, "param_groups": groups},
                                     options=StateDictOptions(full_state_dict=True))
            offset += len(part_names)


def unsharded_copy(template: torch.nn.Module | None, drafter: torch.nn.Module,
                   every_rank: bool = False) -> torch.nn.Module | None:
    """A plain drafter holding the sharded one's current weights, on rank 0 (which holds the unsharded
    `template`), or on every rank holding one when `every_rank` (eval in lockstep beside a sharded target);
    every rank must call it, the others get None."""
    options = StateDictOptions(full_state_dict=True) if every_rank else FULL
    weights = get_model_state_dict(drafter, options=options)
    if not weights or template is None:
        return None
    model = copy.deepcopy(template)
    model.load_state_dict(weights)
    return model


def decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The target's stack of decoder layers: the ModuleList holding `num_layers` blocks (HF names it
    model.layers, transformer.h, language_model.layers, ... by family)."""
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(f"cannot find the {num_layers} decoder layers of {type(model).__name__} to shard")


def shard_target(target: Any, mesh: Any) -> None:
    """`target_parallelism: fsdp2`: shard each frozen decoder layer of `target` (a FrozenTarget loaded on the
    CPU) over the ranks of `mesh`, on its device: fully_shard moves one layer to the device, keeps this
    rank's 1/N of it and frees the rest, so no device ever holds the whole target. A layer is all-gathered
    for its forward and freed after it (reshard_after_forward): the body costs 1/N of its size plus one
    gathered layer at a time.

    Embeddings, the final norm and lm_head stay whole on every rank: the drafter calls them directly every
    step, outside the target's forward. The shards are exact copies of the weights, so every forward
    computes what the unsharded target computes. Every rank must run the same target forwards (a gather is
    a collective): packed rows, the fidelity check, validation and eval all do so in lockstep.
    """
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
        else torch.device(mesh.device_type)
    layers = decoder_layers(target.model, target.num_layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
        # Each layer is its own FSDP root (embeddings and head stay outside), and a root keeps its gathered
        # weights after forward for the backward it expects; a frozen target has none: free them at once.
        layer.register_forward_hook(_reshard_after_forward)
    sharded = {id(p) for p in layers.parameters()} | {id(b) for b in layers.buffers()}
    moved: dict[int, torch.Tensor] = {}  # tied weights (embeddings = lm_head) stay one tensor
    for module in target.model.modules():
        for store in (module._parameters, module._buffers):
            for key, tensor in store.items():
                if tensor is None or id(tensor) in sharded:
                    continue
                if id(tensor) not in moved:
                    on_device = tensor.detach().to(device)
                    moved[id(tensor)] = torch.nn.Parameter(on_device, requires_grad=False) \
                        if isinstance(tensor, torch.nn.Parameter) else on_device
                store[key] = moved[id(tensor)]
    target.device = device
    target.lm_head = target.model.get_output_embeddings()


def _reshard_after_forward(module: Any, inputs: Any, output: Any) -> None:
    module.reshard()


def load_sharded_target(load: Any, device: torch.device, world_size: int, rank: int, barrier: Any) -> Any:
    """Load the target with `load()` (on the CPU) one rank at a time and shard it over all ranks: at any
    moment at most one rank holds the whole target in host memory, and no device ever does."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))
    target = None
    for turn in range(world_size):
        if turn == rank:
            target = load()
            shard_target(target, mesh)
        barrier()
    assert target is not None
    return target


def target_shard_record(target: Any, world_size: int) -> dict[str, Any]:
    """What this rank holds of the target's decoder layers (run.json `target_sharding`): measured from
    the local shards, so the record shows the target really is split."""
    layers = decoder_layers(target.model, target.num_layers)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in layers.parameters())
    full = sum(p.numel() for p in layers.parameters())
    return {"mode": "fsdp2", "world_size": world_size, "layer_params": full, "layer_params_on_rank0": local}
