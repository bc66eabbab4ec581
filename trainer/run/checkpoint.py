"""Checkpoints: drafter weights, optimizer state and RNG state, all in safetensors, written atomically.

Layout: `checkpoints/step-00000300/{drafter,optimizer,rng}.safetensors` + `state.json`, and
`checkpoints/latest` naming the newest complete one. A checkpoint directory is assembled under a temporary
name and renamed into place, and `latest` is replaced atomically after that, so a kill at any moment
leaves the previous checkpoint intact and `latest` always names a complete one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from trainer.run.rundir import RunError, atomic_write_json, atomic_write_text

DRAFTER_FILE = "drafter.safetensors"


@dataclass
class Checkpoint:
    step: int
    path: Path
    state: dict[str, Any]


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(
    checkpoints_dir: Path,
    step: int,
    drafter: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int,
) -> Path:
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoints_dir / checkpoint_name(step)
    staging = checkpoints_dir / f".{final.name}.partial"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()

    weights = {name: tensor.detach().contiguous().cpu() for name, tensor in drafter.state_dict().items()}
    save_file(weights, str(staging / DRAFTER_FILE), metadata={"format": "pt", "step": str(step)})
    tensors, metadata = _flatten_optimizer(optimizer)
    save_file(tensors, str(staging / "optimizer.safetensors"), metadata=metadata)
    save_file(_rng_tensors(), str(staging / "rng.safetensors"))
    atomic_write_json(staging / "state.json", {"step": step, **state})
    _fsync_dir(staging)

    if final.exists():  # a re-run of the same step after a resume: replace it whole
        shutil.rmtree(final)
    os.replace(staging, final)
    atomic_write_text(checkpoints_dir / "latest", final.name + "\n")
    _prune(checkpoints_dir, keep)
    return final


def latest_checkpoint(checkpoints_dir: Path) -> Checkpoint | None:
    latest_file = checkpoints_dir / "latest"
    if not latest_file.is_file():
        return None
    path = checkpoints_dir / latest_file.read_text().strip()
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise RunError(f"checkpoint {path} named by {latest_file} is missing or corrupt") from None
    return Checkpoint(step=int(state["step"]), path=path, state=state)


def load_drafter_weights(drafter: torch.nn.Module, checkpoint: Checkpoint) -> None:
    try:
        weights = load_file(str(checkpoint.path / DRAFTER_FILE))
    except (OSError, SafetensorError) as exc:
        raise RunError(f"cannot read {checkpoint.path / DRAFTER_FILE}: {exc}") from None
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise RunError(
            f"{checkpoint.path / DRAFTER_FILE} does not fit this drafter "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )


def restore_training_state(checkpoint: Checkpoint, optimizer: torch.optim.Optimizer) -> None:
    tensors = load_file(str(checkpoint.path / "optimizer.safetensors"))
    with open(checkpoint.path / "optimizer.safetensors", "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    param_groups = json.loads(header["__metadata__"]["param_groups"])
    for group in param_groups:  # JSON turned AdamW's betas tuple into a list
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        _, index, field = key.split(".", 2)
        state.setdefault(int(index), {})[field] = tensor
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    rng = load_file(str(checkpoint.path / "rng.safetensors"))
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available() and "torch_cuda" in rng:
        torch.cuda.set_rng_state(rng["torch_cuda"])


def _flatten_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    # safetensors holds tensors plus str->str metadata: per-parameter state becomes `state.<i>.<field>`
    # tensors and the param groups (plain numbers) travel as JSON metadata.
    saved = optimizer.state_dict()
    tensors = {
        f"state.{index}.{field}": (value if torch.is_tensor(value) else torch.tensor(value)).detach().cpu()
        for index, fields in saved["state"].items()
        for field, value in fields.items()
    }
    return tensors, {"param_groups": json.dumps(saved["param_groups"])}


def _rng_tensors() -> dict[str, torch.Tensor]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    return tensors


def _prune(checkpoints_dir: Path, keep: int) -> None:
    complete = sorted(p for p in checkpoints_dir.glob("step-*") if p.is_dir())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    for file in path.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
