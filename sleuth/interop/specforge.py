"""SpecForge (SGLang) runs read as sleuth runs: an output directory, or one of its checkpoints.

What `specforge train` writes (SpecForge a6b6b02, `specforge/training/checkpoint.py`, `controller.py`,
`trainer.py`, `tracker.py`), for one run `run_id` under `output_dir`:

    OUT/{run_id}-step{N}/training_state.pt     the shared payload (rank 0): `draft_state_dict` (fc, hidden_norm,
                                               layers.*, norm; no embeddings), `global_step`, `epoch`,
                                               `strategy`, `run_id`, the trainer's contract (`batch_size`,
                                               `num_epochs`, ...) and the algorithm's resume contract
                                               (DFlash: `dflash_target_layer_ids`, `dflash_block_size`,
                                               `dflash_mask_token_id`, `dflash_num_anchors`,
                                               `dflash_loss_decay_gamma`, `dflash_loss_type`, ...) and
                                               `specforge_model_provenance` (target model and draft config
                                               paths, capture layers)
    OUT/{run_id}-step{N}/training_state_rank{r}.pt   per-rank optimizer / RNG state (not read)
    OUT/{run_id}-latest -> {run_id}-stepN, OUT/{run_id}-best -> {run_id}-stepN, OUT/{run_id}.best_meta.json
    OUT/runs/events.out.tfevents.*             tensorboard (`tracking.report_to: tensorboard`): `train/loss`,
                                               `train/acc`, `eval/avg_loss`, `eval/avg_acc`, ...

There is no config.json in a checkpoint: the draft config is the JSON the run was given
(`model.draft_model_config`, e.g. `configs/qwen3-8b-dflash.json`), whose path the provenance records.
`training_state.pt` is read with `torch.load(weights_only=True)`: tensors and plain containers only, no
code from the file runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.artifacts import (
    OBJECT,
    SEQUENCE,
    check_shape,
    exists,
    is_dir,
    list_dir,
    optional_json_object,
    regular_file,
    shown,
)
from sleuth.interop.verifier import Verifier, find_verifier

STATE_FILE = "training_state.pt"
_STEP_DIR = re.compile(r"^(?P<run_id>.+)-step(?P<step>\d{1,12})$")
_MAX_STATE_FILE = 4 * 1024**3
# What the checks read into: the weights by name, the provenance as (key, value) pairs.
STATE_SHAPE = {"draft_state_dict": OBJECT, "specforge_model_provenance": SEQUENCE, "dflash_target_layer_ids": SEQUENCE}
DRAFT_CONFIG_SHAPE = {"dflash_config": OBJECT, "rope_scaling": OBJECT}
# tensorboard tags SpecForge logs (`training_metric_names`, `Evaluator`) -> sleuth's metric names
TENSORBOARD_TAGS = {
    "train/loss": "loss",
    "train/acc": "acc",
    "eval/avg_loss": "val_loss",
    "eval/avg_acc": "val_acc",
    "eval/simulated_acc_len": "val_simulated_acc_len",
}


@dataclass
class SpecForgeCheckpoint:
    path: Path
    step: int
    state: dict[str, Any] | None  # training_state.pt without the optimizer state
    problem: str | None = None

    def get(self, key: str, default: Any = None) -> Any:
        return (self.state or {}).get(key, default)

    @property
    def fc_shape(self) -> list[int] | None:
        weights = self.get("draft_state_dict") or {}
        fc = weights.get("fc.weight")
        return list(fc.shape) if fc is not None and hasattr(fc, "shape") else None


@dataclass
class SpecForgeRun:
    """Everything read from a SpecForge directory; `chosen` is the checkpoint whose settings are checked."""

    kind: str  # "output_dir" | "checkpoint"
    path: Path
    checkpoints: list[SpecForgeCheckpoint]
    chosen: SpecForgeCheckpoint | None
    links: dict[str, str] = field(default_factory=dict)
    best_meta: dict[str, Any] | None = None
    draft_config: dict[str, Any] | None = None
    draft_config_path: Path | None = None
    verifier: Verifier = field(default_factory=lambda: Verifier(None))
    problems: list[str] = field(default_factory=list)
    # Problems that keep the run from being called clean (see RunInfo.input_problems); also in `problems`.
    input_problems: list[str] = field(default_factory=list)
    trainer: str = "specforge"

    @property
    def config(self) -> dict[str, Any] | None:
        return self.draft_config

    def use_draft_config(self, path: Path) -> None:
        """Check this draft config JSON (a file, or a directory with config.json) instead of the recorded one."""
        config = path / "config.json" if is_dir(path) else path
        why: list[str] = []
        data = optional_json_object(config, why, label="")
        if data is None:
            reason = why[0].strip() if why else "not found"
            self.problems.append(f"--config {shown(path)}: not a JSON draft config ({reason}); the recorded one is checked")
            return
        self.draft_config, self.draft_config_path = check_shape(data, DRAFT_CONFIG_SHAPE, shown(config), self.problems), config

    def provenance(self, key: str) -> Any:
        """One entry of `specforge_model_provenance` (a tuple of (key, value) pairs)."""
        pairs = (self.chosen.get("specforge_model_provenance") if self.chosen else None) or ()
        for pair in pairs:
            if isinstance(pair, (tuple, list)) and len(pair) == 2 and pair[0] == key:
                return pair[1]
        return None

    def recorded_path(self, key: str) -> str | None:
        """The path SpecForge recorded for a model source: ("directory-stat-v2", PATH, ...) or ("reference", ID)."""
        identity = self.provenance(key)
        if isinstance(identity, (tuple, list)) and len(identity) >= 2 and isinstance(identity[1], str):
            return identity[1]
        return None


def detect(path: Path) -> str | None:
    """"output_dir", "checkpoint" or None."""
    if not is_dir(path) or exists(path / "run.json"):
        return None
    if exists(path / STATE_FILE):
        return "checkpoint"
    if _step_dirs(path):
        return "output_dir"
    return None


def read_specforge_run(path: Path) -> Any:
    """A sleuth `RunInfo` for a SpecForge directory, or None when `path` is not one."""
    from sleuth.run_info import RunInfo

    kind = detect(path)
    if kind is None:
        return None
    run = read(path, kind)
    info = RunInfo(name=_run_name(run), path=path)
    info.interop = run
    info.metrics = metrics_rows(run)
    info.problems = list(run.problems)
    info.config = run.draft_config
    info.input_problems = list(run.input_problems)
    info.run_json = _run_json(run)
    # The weights live in a torch pickle, not a safetensors file: the generic header reader cannot read
    # them, so `info.checkpoint` stays None and the SpecForge checks read fc from the state dict.
    if run.chosen is not None:
        info.checkpoint_step = run.chosen.step
    if not info.metrics:
        info.problems.append("no tensorboard logs (runs/) and no best_meta.json with numbers")
    info.problems.append(f"a SpecForge {kind.replace('_', ' ')}: no code/ copy of the source it executed")
    return info


def read(path: Path, kind: str) -> SpecForgeRun:
    problems: list[str] = []
    links: dict[str, str] = {}
    best_meta = None
    if kind == "output_dir":
        checkpoints = [_read_checkpoint(d, step, path) for step, d in _step_dirs(path)]
        for child in list_dir(path):
            if child.is_symlink() and child.name.endswith(("-best", "-latest")):
                links[child.name] = _readlink(child)
        chosen = _pick(checkpoints, links)
        run_ids = sorted({_run_id(c.path) for c in checkpoints})
        if len(run_ids) > 1 and chosen is not None:
            # SpecForge refuses to resume from such a directory without a checkpoint named; read one run.
            own = _run_id(chosen.path)
            problems.append(f"{len(run_ids)} runs share this output_dir ({', '.join(run_ids)}): {own}'s checkpoints "
                            "are read; runs/ tensorboard files may mix them")
            checkpoints = [c for c in checkpoints if _run_id(c.path) == own]
            links = {name: target for name, target in links.items() if name.rsplit("-", 1)[0] == own}
        own_id = _run_id(chosen.path) if chosen is not None else None
        best_meta = optional_json_object(path / f"{own_id}.best_meta.json", problems, within=path) if own_id else None
    else:
        match = _STEP_DIR.match(path.name)
        step = int(match.group("step")) if match else -1
        chosen = _read_checkpoint(path, step, path.parent)
        checkpoints = [chosen]
        if chosen.step < 0 and isinstance(chosen.get("global_step"), int):
            chosen.step = chosen.get("global_step")
    problems += [f"{shown(c.path.name)}/{STATE_FILE}: {c.problem}" for c in checkpoints if c.problem]
    run = SpecForgeRun(kind=kind, path=path, checkpoints=checkpoints, chosen=chosen, links=links,
                       best_meta=best_meta, problems=problems)
    if chosen is not None and chosen.problem:
        # The checkpoint whose settings are checked is damaged: what it trained with is unknown, not clean.
        run.input_problems.append(f"{shown(chosen.path.name)}/{STATE_FILE}: {chosen.problem}")
    if chosen is not None and chosen.state is not None:
        shape_problems: list[str] = []
        check_shape(chosen.state, STATE_SHAPE, f"{shown(chosen.path.name)}/{STATE_FILE}", shape_problems)
        problems += shape_problems
        run.input_problems += shape_problems
    if chosen is not None and chosen.state is not None and chosen.get("strategy") not in ("dflash", None):
        problems.append(f"strategy {chosen.get('strategy')!r}: only DFlash's settings are checked")
    _read_draft_config(run)
    target = run.recorded_path("target_model")
    run.verifier = find_verifier(target, path, relocatable=True)
    found = run.verifier.config_path
    if target and found is not None and found.parent != Path(target):
        problems.append(f"target recorded as {target}, read from {found.parent} (the run has moved)")
    return run


def metrics_rows(run: SpecForgeRun) -> list[dict[str, Any]]:
    """Per-step training curves from SpecForge's tensorboard files; else the best checkpoint's eval numbers."""
    from sleuth.interop.tensorboard import find_event_files, read_tagged_scalars

    root = run.path if run.kind == "output_dir" else run.path.parent
    files, note = find_event_files(root / "runs", near=run.path)
    if note:
        run.problems.append(note)
    curves = read_tagged_scalars(files, TENSORBOARD_TAGS)
    if curves.problem:
        run.problems.append(curves.problem)
    rows = {step: {"step": step, "source": "tensorboard", **values} for step, values in curves.rows.items()}
    if rows:
        run.problems.append(f"metrics: curves from {len(curves.files)} tensorboard file(s) in {root / 'runs'}")
        return [rows[s] for s in sorted(rows)]
    meta = run.best_meta or {}
    values = meta.get("metrics") if isinstance(meta.get("metrics"), dict) else {}
    step = meta.get("step")
    if isinstance(step, int) and values:
        row: dict[str, Any] = {"step": step, "source": "best_meta.json"}
        for tag, name in TENSORBOARD_TAGS.items():
            if _number(values.get(tag)):
                row[name] = float(values[tag])
        run.problems.append("metrics: only the best checkpoint's eval numbers (best_meta.json; no tensorboard logs)")
        return [row]
    return []


# --- private ---------------------------------------------------------------------------------------------


def _step_dirs(path: Path) -> list[tuple[int, Path]]:
    found = []
    for child in list_dir(path):
        match = _STEP_DIR.match(child.name)
        if match and not child.is_symlink() and is_dir(child) and exists(child / STATE_FILE):
            found.append((int(match.group("step")), child))
    return sorted(found)


def _run_id(path: Path) -> str:
    match = _STEP_DIR.match(path.name)
    return match.group("run_id") if match else path.name


def _pick(checkpoints: list[SpecForgeCheckpoint], links: dict[str, str]) -> SpecForgeCheckpoint | None:
    """The best checkpoint (`{run_id}-best`), else the latest (`{run_id}-latest`), else the highest step."""
    for suffix in ("-best", "-latest"):
        for name, target in links.items():
            if name.endswith(suffix):
                chosen = next((c for c in checkpoints if c.path.name == target and c.state is not None), None)
                if chosen is not None:
                    return chosen
    readable = [c for c in checkpoints if c.state is not None]
    return max(readable, key=lambda c: c.step) if readable else (checkpoints[-1] if checkpoints else None)


def _read_checkpoint(path: Path, step: int, root: Path) -> SpecForgeCheckpoint:
    checkpoint = SpecForgeCheckpoint(path=path, step=step, state=None)
    state_file = path / STATE_FILE
    try:
        # A regular file inside the output directory (torch.load on a FIFO would wait for a writer forever).
        if not regular_file(state_file, within=root):
            raise ValueError("missing")
        if state_file.stat().st_size > _MAX_STATE_FILE:
            raise ValueError(f"{state_file.stat().st_size} bytes, more than a drafter's state can be")
        import torch

        # weights_only: tensors and plain containers only (SpecForge writes nothing else); mmap: the
        # optimizer state is not read into memory.
        state = torch.load(state_file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # a torn or foreign file: the other checkpoints still count
        checkpoint.problem = f"cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        return checkpoint
    if not isinstance(state, dict):
        checkpoint.problem = f"holds a {type(state).__name__}, not SpecForge's state dict"
        return checkpoint
    state.pop("replicated_optimizer_state", None)
    weights = state.get("draft_state_dict")
    degenerate = _degenerate_tensors(weights) if isinstance(weights, dict) else []
    if degenerate:
        # A view that repeats one element (stride 0) or claims more elements than its storage holds is not a
        # trained weight: its shape would be read as evidence of a [1e6, 1e6] layer. The file is damaged.
        checkpoint.problem = (f"draft_state_dict holds tensors whose storage cannot back their shape (expanded or "
                              f"truncated views): {', '.join(degenerate[:3])}; the weights are not evidence")
        return checkpoint
    checkpoint.state = state
    return checkpoint


def _degenerate_tensors(weights: dict[Any, Any]) -> list[str]:
    """Names of tensors whose storage is smaller than the elements their shape and strides address, or that
    repeat elements (a zero stride on a dimension longer than 1)."""
    import torch

    bad = []
    for name, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            continue
        repeated = any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride()))
        span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
        needed = (tensor.storage_offset() + span) * tensor.element_size()
        if repeated or needed > tensor.untyped_storage().nbytes():
            bad.append(f"{shown(str(name))} {list(tensor.shape)}")
    return bad


def _read_draft_config(run: SpecForgeRun) -> None:
    """The draft config the run was given (`model.draft_model_config`), found where the provenance says."""
    recorded = run.recorded_path("draft_config")
    if recorded is None:
        run.problems.append("the checkpoint records no draft config path (specforge_model_provenance)")
        return
    for candidate in _relocations(recorded, run.path):
        config = candidate / "config.json" if is_dir(candidate) else candidate
        if exists(config):
            why: list[str] = []
            data = optional_json_object(config, why, label="")
            if data is None:
                reason = why[0].strip() if why else "is not a regular file"
                problem = f"draft config {shown(config)} cannot be read: {reason}"
                run.problems.append(problem)
                run.input_problems.append(problem)
                return
            run.draft_config, run.draft_config_path = data, config
            shape_problems: list[str] = []
            check_shape(data, DRAFT_CONFIG_SHAPE, f"draft config {shown(config)}", shape_problems)
            run.problems += shape_problems
            run.input_problems += shape_problems
            if candidate != Path(recorded):
                run.problems.append(f"draft config recorded as {recorded}, read from {config} (the run has moved)")
            return
    run.problems.append(f"draft config {recorded} (recorded by SpecForge) not found here, nor relative to the run")


def _relocations(recorded: str, near: Path) -> list[Path]:
    """A recorded path, then its trailing components under the run and each directory above it (a moved run)."""
    from sleuth.interop.verifier import relocated_candidates

    return relocated_candidates(recorded, near)


def _run_json(run: SpecForgeRun) -> dict[str, Any]:
    chosen = run.chosen
    target = run.recorded_path("target_model")
    samples = chosen.get("source_dataset_size", chosen.get("dataset_size")) if chosen else None
    return {
        "format": "specforge",
        "created": None,
        "status": None,
        "name": chosen.get("run_id") if chosen else None,
        "target": {
            "fingerprint": f"target:{target}" if target else None,
            "num_layers": run.verifier.num_layers,
            "hidden_size": run.verifier.hidden_size,
        },
        # SpecForge records no data path: the sample count is the only data identity it keeps, and the
        # fingerprint says so (two runs over different data of the same size would compare).
        "data": {"fingerprint": f"specforge samples={samples} (no data path recorded)" if _is_count(samples) else None},
    }


def _run_name(run: SpecForgeRun) -> str:
    run_id = run.chosen.get("run_id") if run.chosen else None
    if run.kind == "checkpoint":
        return f"{run.path.parent.name}/{run.path.name}"
    return run_id if isinstance(run_id, str) and run_id else run.path.name


def _readlink(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:
        return "?"


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
