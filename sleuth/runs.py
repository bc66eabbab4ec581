"""Reading a run directory, per the run-directory contract (the only thing sleuth knows about a trainer).

A run directory written by any trainer that follows the contract can be diagnosed. Reading is tolerant:
a missing or damaged file never stops the diagnosis; it becomes a `problem` (one line saying what and
why) and the checks that needed that file come out `unknown`. Only a run that cannot be found at all is
an error (`RunError`).
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Any

from sleuth.artifacts import (
    ArtifactError,
    BoundedLines,
    denied,
    exists,
    is_dir,
    json_kind,
    list_dir,
    parse_json,
    read_bytes,
    read_json_object,
    regular_file,
    shown,
)
# RunInfo lives in its own module (sleuth.interop builds it too); importers of sleuth.runs keep finding it here.
from sleuth.run_info import MAX_METRIC_MAGNITUDE, RunInfo, is_step, metric_value

EXPORT_WEIGHTS = "model.safetensors"  # what `trainer export` (and z-lab / speculators) write

DEFAULT_RUNS_DIR = Path("runs")

# A safetensors header is a little-endian u64 length followed by that many bytes of JSON. Real drafter
# headers are a few KiB; anything past this is a damaged length field, not a header worth reading.
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
# checkpoints/latest holds one directory name, like `step-300`.
_CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_MAX_LATEST = 4096

# metrics.jsonl grows a few hundred bytes per logged step: a million steps fit; more is not a metrics file.
_MAX_METRICS_FILE = 512 * 1024 * 1024
# One row is a few hundred bytes (a few KiB with per-position lists).
_MAX_METRICS_LINE = 1024 * 1024
# A trajectory needs far fewer points than this; a longer run is thinned evenly (every 2nd, 4th, ... row).
_MAX_METRICS_ROWS = 200_000


class RunError(Exception):
    """A run cannot be found or read at all; the message is one line."""


def resolve_run_dir(run: str | Path, runs_dir: Path | None = None) -> Path:
    """`run` is a path to a run directory, or the name of one inside `runs_dir` (default ./runs).

    A bare name (no path separator) means the run of that name first, a folder of that name in the
    working directory second; anything that looks like a path is a path.
    """
    base = runs_dir if runs_dir is not None else DEFAULT_RUNS_DIR
    as_path = Path(run).expanduser()
    in_runs_dir = base / str(run)
    text = str(run)
    looks_like_path = as_path.is_absolute() or "/" in text or os.sep in text or text in (".", "..", "~")
    for candidate in ((as_path, in_runs_dir) if looks_like_path else (in_runs_dir, as_path)):
        if candidate.is_dir():
            return candidate
    known = sorted(p.name for p in list_run_dirs(base)) if base.is_dir() else []
    where = f"in {base}/ (runs there: {', '.join(known)})" if known else f"in {base}/"
    raise RunError(f"no run {str(run)!r}: not a directory, and no run of that name {where}")


def list_run_dirs(runs_dir: Path) -> list[Path]:
    """The run directories directly inside `runs_dir`: those with a run.json or metrics (ours), or a
    run.yaml / train_command.txt (a speculators save directory).

    A directory with only a config.json is not a run: a verifier or target model beside the runs, an
    exported drafter; it has no history to compare with.
    """
    if not is_dir(runs_dir):
        return []
    from sleuth.interop import FOREIGN_RUN_MARKERS, is_foreign_save_dir

    if is_foreign_save_dir(runs_dir):
        return []  # a speculators save directory holds one run's checkpoints, not runs
    markers = ("run.json", "metrics.jsonl", *FOREIGN_RUN_MARKERS)
    return [p for p in list_dir(runs_dir) if is_dir(p) and any(exists(p / m) for m in markers)]


def read_run(path: Path) -> RunInfo:
    """Read everything sleuth uses from a run directory; damaged parts become `problems`, not errors."""
    if not is_dir(path):
        raise RunError(denied(path) or f"run directory {shown(path)} does not exist")
    if denied(path):
        raise RunError(str(denied(path)))
    from sleuth.interop import read_foreign_run

    foreign = read_foreign_run(path)  # a speculators save directory or checkpoint, read in its own layout
    if foreign is not None:
        return foreign
    markers = ("run.json", "config.json", "metrics.jsonl", "checkpoints", "code", EXPORT_WEIGHTS)
    if not any(exists(path / m) for m in markers):
        raise RunError(
            f"{shown(path)} is not a run directory: it has none of run.json, config.json, metrics.jsonl, "
            "checkpoints/, code/ (nor an exported drafter's model.safetensors)"
        )
    info = RunInfo(name=path.name, path=path)
    info.run_json = _read_json_object(path / "run.json", info.problems, path)
    if info.run_json and isinstance(info.run_json.get("name"), str) and info.run_json["name"]:
        info.name = info.run_json["name"]
    info.config, info.config_sha256 = _read_config(path / "config.json", info.problems, path)
    _read_metrics(path / "metrics.jsonl", info)
    info.eval_report = _read_json_object(path / "eval.json", None, path)
    if is_export_dir(path, info.config):
        # A serving export (`trainer export`, z-lab's or speculators' layout): its config and weights are
        # all there is; no metrics, no code, no run.json.
        info.checkpoint = path / EXPORT_WEIGHTS
        info.problems.append("an exported drafter directory: config and weights only (no metrics, no code)")
        return info
    _find_checkpoint(path / "checkpoints", info)
    code = path / "code"
    if is_dir(code, within=path) and denied(code):
        info.problems.append(str(denied(code)))
    elif is_dir(code, within=path):
        info.code_dir = code
    elif is_dir(code):
        # A shipped run can point code/ at any tree (the system's Python library): it is not this run's copy.
        info.problems.append("code/ is a link leading outside the run directory; not read")
    else:
        info.problems.append("the run has no code/ copy of the source it executed")
    return info


def is_export_dir(path: Path, config: dict[str, Any] | None) -> bool:
    """A drafter exported for serving: a config.json that says DFlash, plus model.safetensors."""
    if config is None or not _is_file(path / EXPORT_WEIGHTS, path) or exists(path / "run.json"):
        return False
    from sleuth.evidence.variant import SPECULATORS_TYPES

    return "dflash_config" in config or config.get("speculators_model_type") in SPECULATORS_TYPES


def _is_file(path: Path, within: Path) -> bool:
    """A regular file inside the run (not a FIFO, a device or a link leaving it); never raises."""
    try:
        return regular_file(path, within=within)
    except ArtifactError:
        return False


def _read_json_object(path: Path, problems: list[str] | None, run: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None with a problem line (None `problems`: the file is optional).
    Read under sleuth.artifacts' discipline: a regular file inside the run, bounded in size, depth and
    number length; every failure is one line naming the file."""
    try:
        return read_json_object(path, within=run)
    except FileNotFoundError:
        if problems is not None:
            problems.append(f"{path.name} is missing")
    except ArtifactError as exc:
        if problems is not None:
            problems.append(f"{shown(path.name)} {exc.reason}")
    return None


def _read_config(path: Path, problems: list[str], run: Path) -> tuple[dict[str, Any] | None, str | None]:
    """config.json as `_read_json_object` reads it, with the sha256 of the bytes parsed."""
    import hashlib

    try:
        raw = read_bytes(path, within=run)
        data = parse_json(raw, path)
    except FileNotFoundError:
        problems.append(f"{path.name} is missing")
        return None, None
    except ArtifactError as exc:
        problems.append(f"{shown(path.name)} {exc.reason}")
        return None, None
    if not isinstance(data, dict):
        problems.append(f"{path.name} holds {json_kind(data)}, not a JSON object")
        return None, None
    return data, hashlib.sha256(raw).hexdigest()


def _read_metrics(path: Path, info: RunInfo) -> None:
    """metrics.jsonl, streamed under three bounds (`_MAX_METRICS_FILE` bytes, `_MAX_METRICS_LINE` per line,
    `_MAX_METRICS_ROWS` rows kept): a damaged, huge or sparse file costs what a real one does, and everything
    skipped is said in one problem line."""
    lines = BoundedLines(path, within=info.path, max_line=_MAX_METRICS_LINE, max_bytes=_MAX_METRICS_FILE,
                         skip_blank=True)
    skipped: list[int] = []
    too_long: list[int] = []
    dropped: list[str] = []
    usable, stride = 0, 1
    try:
        for number, line in lines:
            if line is None:
                too_long.append(number)
                continue
            if not line.strip():
                continue
            try:
                row = parse_json(line, path)
            except ArtifactError:  # not UTF-8, garbled, nested too deep, a number of 400 digits
                skipped.append(number)
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if not is_step(step):
                skipped.append(number)
                continue
            # NaN, ±Infinity and overflowed numbers are not measurements: dropped from the row (and named),
            # so no reader of metrics (chart, regression) meets them.
            unusable = [k for k, v in row.items() if k != "step" and isinstance(v, (int, float))
                        and not isinstance(v, bool) and metric_value(v) is None]
            for key in unusable:
                row.pop(key)
                dropped.append(f"{key} at line {number}")
            usable += 1
            if (usable - 1) % stride:
                continue
            info.metrics.append(row)
            if len(info.metrics) > _MAX_METRICS_ROWS:
                # More rows than a trajectory needs: keep every other one, evenly over the whole run.
                info.metrics[:] = info.metrics[::2]
                stride *= 2
    except FileNotFoundError:
        info.problems.append("metrics.jsonl is missing")
        return
    except ArtifactError as exc:
        info.problems.append(f"metrics.jsonl {exc.reason}")
        return
    info.metrics_sha256 = lines.sha256
    said: list[str] = []
    if skipped:
        # Non-UTF-8 lines count as garbled: one damaged line costs that line, never the whole file.
        said.append(f"skipped {len(skipped)} truncated or garbled line(s) (line {_numbers(skipped)})")
    if too_long:
        said.append(f"skipped {len(too_long)} line(s) longer than {_MAX_METRICS_LINE >> 10} KiB, not read "
                    f"(line {_numbers(too_long)})")
    if lines.truncated:
        said.append(f"read only the first {_MAX_METRICS_FILE >> 20} MiB of {lines.size} bytes")
    if stride > 1:
        said.append(f"kept 1 row in {stride} of {usable} (at most {_MAX_METRICS_ROWS} rows are kept)")
    if said:
        info.problems.append("metrics.jsonl: " + "; ".join(said))
    if dropped:
        more = f" and {len(dropped) - 5} more" if len(dropped) > 5 else ""
        info.problems.append(f"metrics.jsonl: ignored {len(dropped)} value(s) that are not finite numbers within "
                             f"±{MAX_METRIC_MAGNITUDE:g} ({', '.join(dropped[:5])}{more})")
    if not info.metrics:
        info.problems.append("metrics.jsonl holds no usable metrics rows")


def _numbers(lines: list[int]) -> str:
    return ", ".join(str(n) for n in lines[:5]) + (f" and {len(lines) - 5} more" if len(lines) > 5 else "")


def _find_checkpoint(checkpoints: Path, info: RunInfo) -> None:
    """The newest complete checkpoint's drafter weights: `checkpoints/latest` names its directory."""
    if not is_dir(checkpoints, within=info.path):
        info.problems.append(denied(checkpoints) or "the run has no checkpoints/ directory")
        return
    if denied(checkpoints):
        info.problems.append(str(denied(checkpoints)))
        return
    latest_file = checkpoints / "latest"
    step_dir: Path | None = None
    try:
        latest = read_bytes(latest_file, within=info.path, max_bytes=_MAX_LATEST, head=True)
    except (FileNotFoundError, ArtifactError) as exc:
        latest = None
        if isinstance(exc, ArtifactError):
            info.problems.append(f"checkpoints/latest {exc.reason}")
    if latest is not None:
        name = latest.decode("utf-8", errors="replace").strip()
        # `latest` names a directory inside checkpoints/, nothing else: a path in it could point anywhere.
        if _CHECKPOINT_NAME.fullmatch(name) and name not in (".", "..") and denied(checkpoints / name):
            info.problems.append(str(denied(checkpoints / name)))
            return
        if _CHECKPOINT_NAME.fullmatch(name) and name not in (".", "..") and is_dir(checkpoints / name, within=info.path):
            step_dir = checkpoints / name
        else:
            name = name if len(name) <= 80 else name[:77] + "..."
            info.problems.append(f"checkpoints/latest names {shown(name)!r}, which does not exist")
    # Without a usable pointer, the highest-numbered step directory is the best guess; say so.
    if step_dir is None:
        candidates = [p for p in list_dir(checkpoints) if p.name.startswith("step-")
                      and _is_file(p / "drafter.safetensors", info.path)]
        if not candidates:
            info.problems.append("no checkpoint with drafter.safetensors under checkpoints/")
            return
        step_dir = candidates[-1]
        if latest is not None:
            info.problems.append(f"using {shown(step_dir.name)} instead")
        else:
            info.problems.append(f"checkpoints/latest is missing; using {shown(step_dir.name)}")
    weights = step_dir / "drafter.safetensors"
    if denied(weights):
        info.problems.append(str(denied(weights)))
        return
    if not _is_file(weights, info.path):
        info.problems.append(f"checkpoints/{shown(step_dir.name)} has no drafter.safetensors")
        return
    info.checkpoint = weights
    try:
        info.checkpoint_step = int(step_dir.name.split("-", 1)[1])
    except (IndexError, ValueError):
        info.checkpoint_step = None
    problem = safetensors_header_problem(weights)
    if problem:
        info.problems.append(f"checkpoints/{shown(step_dir.name)}/drafter.safetensors {problem}")


def safetensors_header_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be read (cheaply: its header only, no torch), or None if it can."""
    try:
        if not regular_file(path):
            return "is missing"
    except ArtifactError as exc:
        return exc.reason
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                return "is corrupt: shorter than a safetensors header"
            (length,) = struct.unpack("<Q", prefix)
            if length == 0 or length > _MAX_SAFETENSORS_HEADER or 8 + length > size:
                return "is corrupt: its header length field is impossible (truncated or not safetensors)"
            header = parse_json(handle.read(length), path)
    except OSError as exc:
        return f"cannot be read: {exc}"
    except ArtifactError:
        return "is corrupt: its header is not valid JSON"
    if not isinstance(header, dict):
        return "is corrupt: its header is not a JSON object"
    ends = [
        entry["data_offsets"][1]
        for key, entry in header.items()
        if key != "__metadata__"
        and isinstance(entry, dict)
        and isinstance(entry.get("data_offsets"), list)
        and len(entry["data_offsets"]) == 2
        and isinstance(entry["data_offsets"][1], int)
    ]
    if ends and 8 + length + max(ends) > size:
        return "is corrupt: truncated (tensor data ends before the header says)"
    return None
