"""Checkpoints: drafter weights, optimizer state and RNG state, all in safetensors, written atomically.

Layout: `checkpoints/step-00000300/{drafter,optimizer,rng}.safetensors` + `state.json`, and
`checkpoints/latest` naming the newest complete one. A checkpoint directory is assembled under a temporary
name and renamed into place, and `latest` is replaced atomically after that, so a kill at any moment
leaves the previous checkpoint intact and `latest` always names a complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from trainer.run.rundir import (
    RunError,
    atomic_write_json,
    atomic_write_text,
    check_inside,
    is_step,
    present,
    read_json_object,
    read_text,
)
from trainer.safe_io import loads_json, staged_path

DRAFTER_FILE = "drafter.safetensors"
_CHECKPOINT_NAME = re.compile(r"step-\d{8,}")


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
    if staging.is_symlink() or (os.path.lexists(staging) and not staging.is_dir()):
        staging.unlink()  # never follow a link planted under the staging name
    elif staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()

    weights = {name: tensor.detach().contiguous().cpu() for name, tensor in drafter.state_dict().items()}
    write_safetensors(weights, staging / DRAFTER_FILE, metadata={"format": "pt", "step": str(step)})
    tensors, metadata = _flatten_optimizer(optimizer)
    write_safetensors(tensors, staging / "optimizer.safetensors", metadata=metadata)
    write_safetensors(_rng_tensors(), staging / "rng.safetensors")
    atomic_write_json(staging / "state.json", {"step": step, **state})
    _fsync_dir(staging)

    if final.exists():  # a re-run of the same step after a resume: replace it whole
        shutil.rmtree(final)
    os.replace(staging, final)
    atomic_write_text(checkpoints_dir / "latest", final.name + "\n")
    _prune(checkpoints_dir, keep)
    return final


_OS_ERROR_CODE = re.compile(r"os error (\d+)")


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """save_file, with an I/O failure raised as the OSError it is (safetensors wraps ENOSPC in its own
    error type, which would otherwise read as a bug instead of "disk full")."""
    try:
        # staged in a private directory of our own and renamed over `path` (a link there is refused)
        with staged_path(path) as staged:
            save_file(tensors, str(staged), metadata=metadata)
    except SafetensorError as exc:
        code = _OS_ERROR_CODE.search(str(exc))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number), str(path)) from None


def latest_checkpoint(checkpoints_dir: Path, root: Path | None = None) -> Checkpoint | None:
    """The checkpoint `latest` names, validated: a damaged `latest` or state.json is one error naming it."""
    root = checkpoints_dir.parent if root is None else root
    latest_file = checkpoints_dir / "latest"
    if not present(latest_file):  # an unsearchable checkpoints/ is `permission denied`, not "no checkpoint"
        return None
    name = read_text(latest_file, root, limit=4096).strip()
    if not _CHECKPOINT_NAME.fullmatch(name):
        raise RunError(f"{latest_file} names {name[:40]!r}, not a checkpoint; the file is damaged")
    path = checkpoints_dir / name
    check_inside(path, root)
    if not path.is_dir():
        raise RunError(f"checkpoint {path} named by {latest_file} is missing (deleted or pruned)")
    state_file = path / "state.json"
    state = read_json_object(state_file, root)
    step = state.get("step")
    if not is_step(step):
        raise RunError(f"{state_file} has no integer step (got {step!r}); the file is damaged")
    if step != int(name.removeprefix("step-")):
        raise RunError(f"{state_file} says step {step} in checkpoint {name}; the file is damaged")
    return Checkpoint(step=step, path=path, state=state)


CHECKPOINT_FILES = (DRAFTER_FILE, "optimizer.safetensors", "rng.safetensors")


def read_safetensors(
    path: Path, root: Path, *, load: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of one checkpoint file: the only safetensors reader of a run directory.

    A truncated, empty or foreign file is one error naming it, whatever safetensors raises for it
    (safetensors checks at open that the header covers the file exactly, so `load=False` is a cheap check
    made before any model is loaded).
    """
    check_inside(path, root)
    if not path.is_file():
        raise RunError(f"{path} is missing")
    try:  # safetensors reports a file it may not open as missing: say what it is
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except PermissionError:
        raise RunError(f"permission denied: {path}") from None
    except OSError as exc:
        raise RunError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        with safe_open(str(path), "pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {key: handle.get_tensor(key) for key in handle.keys()} if load else {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RunError(f"{path} is not a readable safetensors file ({first}); the file is damaged") from None
    return tensors, metadata


def check_checkpoint_files(checkpoint: Checkpoint, root: Path, files: tuple[str, ...] = CHECKPOINT_FILES) -> None:
    """Every file of the checkpoint is there and whole (headers only): fail before minutes of model loading."""
    for name in files:
        read_safetensors(checkpoint.path / name, root, load=False)


def load_drafter_weights(drafter: torch.nn.Module, checkpoint: Checkpoint, root: Path | None = None) -> None:
    weights_file = checkpoint.path / DRAFTER_FILE
    weights, _ = read_safetensors(weights_file, root or checkpoint.path.parent.parent)
    check_shapes(weights_file, weights, drafter.state_dict(), "the run's config")
    drafter.load_state_dict(weights, strict=True)


def check_shapes(
    path: Path, found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], against: str
) -> None:
    """The tensors of `path` are exactly the expected names and shapes, else one line saying which differ."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(n for n in set(expected) & set(found) if tuple(expected[n].shape) != tuple(found[n].shape))
    if missing or unexpected or wrong:
        detail = "; ".join(
            part
            for part in (
                f"missing {missing[:3]}" if missing else "",
                f"unexpected {unexpected[:3]}" if unexpected else "",
                ", ".join(f"{n} {list(found[n].shape)} != {list(expected[n].shape)}" for n in wrong[:3]),
            )
            if part
        )
        raise RunError(f"{path} does not match {against} ({detail})")


def restore_training_state(checkpoint: Checkpoint, optimizer: torch.optim.Optimizer, root: Path | None = None) -> None:
    root = root or checkpoint.path.parent.parent
    optimizer_file = checkpoint.path / "optimizer.safetensors"
    tensors, metadata = read_safetensors(optimizer_file, root)
    # A loader that only takes a state dict (FSDP2's) has no local param groups to check against; the
    # structure and shapes are then checked by what it loads into.
    local_groups = getattr(optimizer, "param_groups", None)
    param_groups = _param_groups(optimizer_file, metadata, local_groups)
    params = {index: param for group, saved in zip(local_groups or [], param_groups)
              for index, param in zip(saved["params"], group["params"])}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit() or (
            local_groups is not None and int(parts[1]) not in params
        ):
            raise RunError(f"{optimizer_file} holds {key!r}, which is no state of this optimizer; the file is damaged")
        index, field = int(parts[1]), parts[2]
        if index in params and tensor.dim() > 0 and tuple(tensor.shape) != tuple(params[index].shape):
            raise RunError(f"{optimizer_file}: {key} has shape {list(tensor.shape)}, the parameter "
                           f"{list(params[index].shape)}; the checkpoint does not match the run's config")
        state.setdefault(index, {})[field] = tensor
    try:
        optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise RunError(f"{optimizer_file} does not fit this optimizer ({exc}); the file is damaged") from None

    rng_file = checkpoint.path / "rng.safetensors"
    rng, _ = read_safetensors(rng_file, root)
    try:
        torch.set_rng_state(rng["torch_cpu"])
        if torch.cuda.is_available() and "torch_cuda" in rng:
            torch.cuda.set_rng_state(rng["torch_cuda"])
    except (KeyError, RuntimeError, TypeError) as exc:
        raise RunError(f"{rng_file} holds no usable RNG state ({exc}); the file is damaged") from None


def _param_groups(path: Path, metadata: dict[str, str], local_groups: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    try:
        groups = loads_json(metadata["param_groups"])
    except (KeyError, ValueError):  # absent, not JSON, nested too deeply
        raise RunError(f"{path} has no readable param_groups metadata; the file is damaged") from None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(i, int) for i in g["params"])
        for g in groups
    ) or (local_groups is not None and [len(g["params"]) for g in groups] != [len(g["params"]) for g in local_groups]):
        raise RunError(f"{path}: its parameter groups do not match the run's drafter; the checkpoint does not "
                       "match the run's config")
    for group in groups:  # JSON turned AdamW's betas tuple into a list
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    return groups


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
