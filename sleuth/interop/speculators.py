"""speculators (vLLM) runs read as sleuth runs: a save directory, one checkpoint, a from_pretrained dir.

What `speculators train` (0.9.0) writes, read from its source (`train/trainer.py`, `train/checkpointer.py`,
`train/config/artifacts.py`):

    SAVE/run.yaml              the resolved config (stage-shaped YAML), written at start
    SAVE/train_command.txt     "# Timestamp: ..." / "# speculators: ..." lines, then the argv
    SAVE/<epoch>/              config.json, model.safetensors, training_state.json
                               ({"epoch", "local_step", "global_step"}), val_metrics.json (only for an epoch
                               that improved the best validation loss: `loss_epoch`, `full_acc_epoch`,
                               `position_{k}_acc_epoch`, `eal_epoch`), optimizer/scheduler `.pt`
    SAVE/checkpoint_best -> <epoch>, SAVE/epoch<N>_end -> <N> (or epoch<N>_step<S> mid-epoch)

A checkpoint's config.json is a `DFlashSpeculatorConfig`: `aux_hidden_state_layer_ids` (vLLM's convention:
id i = HF `hidden_states[i]`), `block_size`, `mask_token_id`, `sample_from_anchor`,
`speculators_config.{algorithm, verifier.name_or_path, proposal_methods}`.

Metrics rows: one per checkpoint with val_metrics.json, at its `global_step` (else its epoch number):
`loss` <- `loss_epoch`, `acc` <- `full_acc_epoch`, `eal` <- `eal_epoch`, `position_acc` <- the
`position_{k}_acc_epoch` in k order; plus training curves from tensorboard event files when present.
Comparability (regression candidates): runs with the same verifier (`name_or_path`), data path and block
size, the only identity speculators records; the fingerprint strings say so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sleuth.artifacts import (
    INTEGER,
    LIST,
    MAX_RECORD_BYTES,
    OBJECT,
    STRING,
    ArtifactError,
    check_shape,
    exists,
    is_dir,
    list_dir,
    optional_json_object,
    read_bytes,
    regular_file,
    shown,
)
from sleuth.interop.verifier import Verifier, find_verifier

WEIGHTS = "model.safetensors"
# The containers the checks read into: a list or a string where an object belongs is dropped with a line.
CONFIG_SHAPE = {
    "speculators_config": OBJECT,
    "speculators_config.algorithm": STRING,
    "speculators_config.verifier": OBJECT,
    "speculators_config.verifier.name_or_path": STRING,
    "speculators_config.proposal_methods": LIST,
    "speculators_config.proposal_methods[]": OBJECT,
    "transformer_layer_config": OBJECT,
}
TRAINING_STATE_SHAPE = {"global_step": INTEGER, "epoch": INTEGER, "local_step": INTEGER}
_LINK = re.compile(r"^(checkpoint_best|epoch\d+_(end|step\d+))$")
_POSITION = re.compile(r"^position_(\d{1,6})_acc_epoch$")


@dataclass
class SpeculatorsCheckpoint:
    path: Path
    epoch: int | None
    config: dict[str, Any] | None
    val_metrics: dict[str, Any] | None
    training_state: dict[str, Any] | None
    weights: Path | None
    # Fields of its config.json that were of the wrong type (dropped): the checks that need them are unknown.
    problems: list[str] = field(default_factory=list)

    @property
    def step(self) -> int | None:
        value = (self.training_state or {}).get("global_step")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass
class SpeculatorsRun:
    """Everything read from a speculators directory; `chosen` is the checkpoint whose config is checked."""

    kind: str  # "save_dir" | "checkpoint" | "pretrained"
    path: Path
    checkpoints: list[SpeculatorsCheckpoint]
    chosen: SpeculatorsCheckpoint | None
    links: dict[str, str] = field(default_factory=dict)
    run_yaml: dict[str, Any] | None = None
    run_yaml_path: Path | None = None
    train_command: str | None = None
    train_command_path: Path | None = None
    created: str | None = None
    speculators_version: str | None = None  # "# speculators: X" in train_command.txt
    verifier: Verifier = field(default_factory=lambda: Verifier(None))
    problems: list[str] = field(default_factory=list)
    # Problems that keep the run from being called clean (see RunInfo.input_problems); also in `problems`.
    input_problems: list[str] = field(default_factory=list)
    trainer: str = "speculators"

    @property
    def root(self) -> Path:
        """The directory every file of this run must lie in: the save directory (a checkpoint's parent)."""
        return self.path.parent if self.kind == "checkpoint" else self.path

    @property
    def config(self) -> dict[str, Any] | None:
        return self.chosen.config if self.chosen else None

    def train_arg(self, flag: str) -> list[str] | None:
        """The values given to `--flag` in train_command.txt's argv, or None if the flag was not given."""
        if not self.train_command:
            return None
        words = self.train_command.split()
        if flag not in words:
            return None
        start = words.index(flag) + 1
        values = []
        for word in words[start:]:
            if word.startswith("--"):
                break
            values.append(word)
        return values

    def run_setting(self, key: str) -> tuple[str, Any] | None:
        """A key of run.yaml, found at any depth (it is stage-shaped): (dotted key, value)."""
        def walk(node: Any, prefix: str) -> tuple[str, Any] | None:
            if not isinstance(node, dict):
                return None
            if key in node:
                return prefix + key, node[key]
            for name, child in node.items():
                found = walk(child, f"{prefix}{name}.")
                if found is not None:
                    return found
            return None

        return walk(self.run_yaml, "")


def is_speculators_config(config: dict[str, Any] | None) -> bool:
    return isinstance(config, dict) and isinstance(config.get("speculators_model_type"), str)


def detect(path: Path) -> str | None:
    """"save_dir", "checkpoint", "pretrained" or None."""
    if not is_dir(path):
        return None
    if exists(path / "run.json"):
        return None  # our own trainer's run directory
    epochs = _epoch_dirs(path)
    if any(exists(path / marker) for marker in ("run.yaml", "train_command.txt")) and epochs:
        return "save_dir"
    if epochs and any(is_speculators_config(_json(d / "config.json", within=path)) for d in epochs):
        return "save_dir"
    config = _json(path / "config.json", within=path)
    if not is_speculators_config(config):
        return "save_dir" if exists(path / "run.yaml") and exists(path / "train_command.txt") else None
    if any(exists(path / name) for name in ("val_metrics.json", "training_state.json", "train_command.txt")):
        return "checkpoint"
    return "pretrained"


def read_speculators_run(path: Path) -> Any:
    """A sleuth `RunInfo` for a speculators directory, or None when `path` is not one.

    A from_pretrained directory (config + weights only) is left to the generic reader, which knows
    exported drafters; its config is still checked in speculators' conventions (`interop` is set).
    """
    from sleuth.run_info import RunInfo

    kind = detect(path)
    if kind is None or kind == "pretrained":
        return None
    run = read(path, kind)
    info = RunInfo(name=_run_name(path, kind), path=path)
    info.interop = run
    info.metrics = metrics_rows(run)  # may add problem lines (tensorboard files unreadable, ...)
    info.problems = list(run.problems)
    info.config = run.config
    info.input_problems = list(run.input_problems)
    info.run_json = _run_json(run)
    chosen = run.chosen
    if chosen is not None and chosen.weights is not None:
        info.checkpoint = chosen.weights
        info.checkpoint_step = chosen.step if chosen.step is not None else chosen.epoch
    if not info.metrics and kind != "pretrained":
        info.problems.append("no val_metrics.json with numbers in any checkpoint (and no tensorboard logs)")
    info.problems.append(f"a speculators {kind.replace('_', ' ')}: no code/ copy of the source it executed")
    return info


def read(path: Path, kind: str) -> SpeculatorsRun:
    problems: list[str] = []
    links: dict[str, str] = {}
    if kind == "save_dir":
        save_dir = path
        checkpoints = [_read_checkpoint(d, problems, path) for d in _epoch_dirs(path)]
        for child in list_dir(path):
            if child.is_symlink() and _LINK.match(child.name):
                target = _readlink(child)
                links[child.name] = target
                if not is_dir(path / target, within=path):
                    problems.append(f"{child.name} -> {shown(target)}, which does not exist in the save directory")
        best = links.get("checkpoint_best")
        chosen = next((c for c in checkpoints if best is not None and c.path.name == best), None)
        if chosen is None and checkpoints:
            chosen = max(checkpoints, key=lambda c: c.epoch if c.epoch is not None else -1)
        if not checkpoints:
            problems.append("no checkpoint directories (0/, 1/, ...) in the save directory")
    else:
        save_dir = path.parent if kind == "checkpoint" else path
        chosen = _read_checkpoint(path, problems, save_dir)
        checkpoints = [chosen]
    run = SpeculatorsRun(kind=kind, path=path, checkpoints=checkpoints, chosen=chosen, links=links, problems=problems)
    if chosen is not None:
        run.input_problems += chosen.problems
    # A checkpoint carries its own copy of train_command.txt; run.yaml sits only in the save directory.
    for directory in ([save_dir, path] if kind == "checkpoint" else [path]):
        _read_run_files(run, directory)
    if kind != "pretrained" and run.run_yaml is None and run.train_command is None:
        # speculators writes both at the start of training; without either, every training setting (the
        # loss, its weighting, gamma) is unknown, and speculators' defaults must not stand in for them.
        missing = ("neither run.yaml nor train_command.txt could be read: the training settings are unknown"
                   if exists(save_dir / "run.yaml") or exists(path / "train_command.txt") or exists(save_dir / "train_command.txt")
                   else "no run.yaml or train_command.txt: the training settings are unknown")
        run.problems.append(missing)
        run.input_problems.append(missing)
    verifier = ((run.config or {}).get("speculators_config") or {}).get("verifier") or {}
    run.verifier = find_verifier(verifier.get("name_or_path"), path)
    return run


def metrics_rows(run: SpeculatorsRun) -> list[dict[str, Any]]:
    """sleuth's metric rows: training curves from tensorboard when logged, validation numbers per checkpoint.

    With tensorboard curves, `loss`/`acc`/`eal`/`position_acc` are the per-step training metrics (as our own
    trainer logs them) and each checkpoint's validation numbers sit beside them as `val_loss`, `val_acc`,
    `val_eal`, `val_position_acc`; without, the validation numbers are the only curve and take the plain
    names (the run's `problems` say which).
    """
    from sleuth.interop.tensorboard import read_scalars

    curves = read_scalars(run)
    if curves.problem:
        run.problems.append(curves.problem)
    prefix = "val_" if curves.rows else ""
    by_step: dict[int, dict[str, Any]] = {
        step: {"step": step, "source": "tensorboard", **values} for step, values in curves.rows.items()
    }
    for checkpoint in run.checkpoints:
        values = checkpoint.val_metrics
        step = checkpoint.step if checkpoint.step is not None else checkpoint.epoch
        if not values or step is None:
            continue
        row = by_step.setdefault(step, {"step": step})
        row.update({"epoch": checkpoint.epoch, "val_source": f"{checkpoint.path.name}/val_metrics.json"})
        for ours, theirs in (("loss", "loss_epoch"), ("acc", "full_acc_epoch"), ("eal", "eal_epoch")):
            if _number(values.get(theirs)):
                row[prefix + ours] = float(values[theirs])
        positions = sorted((int(m.group(1)), v) for k, v in values.items() if (m := _POSITION.match(k)) and _number(v))
        if positions:
            row[prefix + "position_acc"] = [float(v) for _, v in positions]
    if curves.rows:
        run.problems.append(
            f"metrics: training curves from {len(curves.files)} tensorboard file(s); validation numbers as val_*"
        )
    elif by_step:
        run.problems.append("metrics: validation numbers per checkpoint only (val_metrics.json; no tensorboard logs)")
    return [by_step[s] for s in sorted(by_step)]


# --- private ---------------------------------------------------------------------------------------------


def _epoch_dirs(path: Path) -> list[Path]:
    # isdecimal, not isdigit: '²' is a digit to Python but not a number int() reads; at most 12 digits.
    children = [c for c in list_dir(path) if c.name.isascii() and c.name.isdecimal() and len(c.name) <= 12]
    return sorted((c for c in children if not c.is_symlink() and is_dir(c)), key=lambda c: int(c.name))


def _read_checkpoint(path: Path, problems: list[str], root: Path) -> SpeculatorsCheckpoint:
    label = shown(path.name)
    config = _json(path / "config.json", problems, label, within=root)
    own: list[str] = []
    if config is not None:
        check_shape(config, CONFIG_SHAPE, f"{label}/config.json", own)
    state = _json(path / "training_state.json", problems, label, within=root)
    if state is not None:
        check_shape(state, TRAINING_STATE_SHAPE, f"{label}/training_state.json", problems)
    problems += own
    try:
        weights = path / WEIGHTS if regular_file(path / WEIGHTS, within=root) else None
    except ArtifactError as exc:
        problems.append(f"{label}/{WEIGHTS} {exc.reason}")
        weights = None
    return SpeculatorsCheckpoint(
        path=path,
        epoch=int(path.name) if path.name.isascii() and path.name.isdecimal() else None,
        config=config,
        val_metrics=_json(path / "val_metrics.json", problems, label, within=root),
        training_state=state,
        weights=weights,
        problems=own,
    )


def _read_run_files(run: SpeculatorsRun, directory: Path) -> None:
    run_yaml = directory / "run.yaml"
    if exists(run_yaml) and run.run_yaml_path is None:
        try:
            from sleuth.safe_yaml import load_yaml, read_text_file

            # A user's file: size-capped, UTF-8 only, aliases bounded, like every other config sleuth reads.
            data = load_yaml(read_text_file(run_yaml, what="run.yaml", max_bytes=MAX_RECORD_BYTES, within=run.root))
        except Exception as exc:  # yaml.YAMLError, YamlLimitError or a read error: the run config becomes unknown
            run.problems.append(f"run.yaml cannot be read: {(str(exc).splitlines() or [type(exc).__name__])[0]}")
        else:
            if isinstance(data, dict):
                run.run_yaml, run.run_yaml_path = data, run_yaml
            else:
                run.problems.append("run.yaml does not hold a mapping of settings")
    command = directory / "train_command.txt"
    if exists(command) and run.train_command_path is None:
        try:
            # An argv and a few comment lines: a file past 1 MiB is not one (300 MB of words would cost GBs).
            text = read_bytes(command, within=run.root, max_bytes=MAX_RECORD_BYTES).decode("utf-8", errors="replace")
        except (OSError, ArtifactError) as exc:
            run.problems.append(f"train_command.txt {getattr(exc, 'reason', None) or exc}")
            return
        run.train_command_path = command
        lines = [line for line in text.splitlines() if line.strip()]
        run.train_command = next((line for line in lines if not line.startswith("#")), None)
        run.speculators_version = next(
            (line.split(":", 1)[1].strip() for line in lines if line.startswith("# speculators:")), None)
        stamp = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("# Timestamp:")), None)
        if stamp:
            try:
                datetime.fromisoformat(stamp.replace("Z", "+00:00"))
                run.created = stamp
            except ValueError:
                pass


def _run_json(run: SpeculatorsRun) -> dict[str, Any]:
    """The run.json facts sleuth's regression uses, from what speculators recorded."""
    data_path = run.run_setting("data_path")
    return {
        "format": "speculators",
        "created": run.created,
        "status": None,
        "target": {
            "fingerprint": _verifier_identity(run.verifier),
            "num_layers": run.verifier.num_layers,
            "hidden_size": run.verifier.hidden_size,
        },
        "data": {"fingerprint": f"data_path:{data_path[1]}" if data_path else None},
    }


def _verifier_identity(verifier: Verifier) -> str | None:
    """The verifier as found (its directory), else as named: runs on the same verifier compare."""
    if verifier.config_path is not None:
        return f"verifier:{verifier.config_path.parent.resolve()}"
    return f"verifier:{verifier.name_or_path}" if verifier.name_or_path else None


def _run_name(path: Path, kind: str) -> str:
    return f"{path.parent.name}/{path.name}" if kind == "checkpoint" else path.name


def _readlink(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:
        return "?"


def _json(path: Path, problems: list[str] | None = None, where: str = "", *, within: Path) -> dict[str, Any] | None:
    """config.json / val_metrics.json / training_state.json (a few KiB each), under sleuth.artifacts'
    discipline; a damaged one is a problem line `<where>/<name> cannot be read: <why>`."""
    found: list[str] = []
    data = optional_json_object(path, found, within=within, label=f"{where}/{path.name} cannot be read:")
    if problems is not None:
        problems += found
    return data


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
