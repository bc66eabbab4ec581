"""Data-parallel training under torchrun: one run, many processes.

`torchrun --nproc_per_node N --no-python trainer run ...` sets WORLD_SIZE / RANK / LOCAL_RANK; we then
join a process group (NCCL on GPU, gloo on CPU), wrap the drafter in DDP and give each rank an equal,
contiguous slice of the same global batch. The frozen target is replicated on every rank (it runs under
no_grad, so it costs memory, not communication). Rank 0 alone writes the run directory.

Global-batch semantics are those of one process: the batch and its anchors are drawn for the whole global
batch from (seed, step) on every rank before slicing, the loss is a mean over rows, and DDP averages the
gradients of equal-sized slices, which is the gradient of the mean over all rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.run.rundir import RunError


@dataclass(frozen=True)
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rows(self, global_rows: int) -> slice:
        per_rank = global_rows // self.world_size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def sum(self, values: dict[str, float | list[float]]) -> dict[str, float | list[float]]:
        """Sum scalar / list values over ranks, in one all-reduce."""
        if not self.enabled:
            return values
        keys = sorted(values)
        flat = [torch.as_tensor(values[k], dtype=torch.float64).flatten() for k in keys]
        packed = torch.cat(flat)
        dist.all_reduce(packed)
        out, offset = {}, 0
        for key, piece in zip(keys, flat):
            chunk = packed[offset : offset + piece.numel()]
            offset += piece.numel()
            out[key] = chunk.tolist() if isinstance(values[key], list) else float(chunk.item())
        return out

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(device: str) -> Distributed:
    """Join torchrun's process group when launched by it; a plain process is world size 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Distributed()
    if "RANK" not in os.environ:
        raise RunError("WORLD_SIZE is set but RANK is not: launch distributed runs with torchrun")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        # Rank 0 evaluates (speculative decoding) while the others wait at a barrier: allow for a long
        # eval on a large target instead of NCCL's 10-minute default.
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timedelta(hours=1))
    return Distributed(rank=rank, world_size=world_size, local_rank=local_rank)
