"""Input discovery: what the investigation reads before any check, each step recorded in the trace.

The run directory (through sleuth.runs, the run-directory contract), the run's config (or why it cannot be
read: a run's own config that is missing, not JSON, not a mapping or not UTF-8 makes every config-level
check unknown, never filled from the code's defaults), the checkpoint, the code; and, for someone's code
given alone, a config or checkpoint lying beside it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sleuth.investigation.request import DiagnoseError, DiagnoseRequest
from sleuth.runs import RunInfo, read_run, resolve_run_dir, safetensors_header_problem
from sleuth.trace import Trace

# Looking for a config or checkpoint beside someone's code must not crawl a whole monorepo.
_DISCOVERY_MAX_DEPTH = 3
_DISCOVERY_MAX_FILES = 400
_CONFIG_SUFFIXES = (".json", ".yaml", ".yml")
_LOCATE_MAX_FILES = 20_000
_SKIPPED_FOLDERS = frozenset({"__pycache__", "node_modules", "venv", "site-packages", "build", "dist"})


class InputDiscovery:
    """The input steps of an investigation; the agent (sleuth.diagnose) runs them and then the checks."""

    def __init__(self, request: DiagnoseRequest, trace: Trace) -> None:
        self.request, self.trace = request, trace
        self.run_info: RunInfo | None = None
        self.config: dict[str, Any] | None = None
        self.config_source: str | None = None
        # Why the run's config.json could not be read (missing, not JSON, not a mapping, not UTF-8): the run
        # ran with a config we cannot see, so config-level checks must stay unknown.
        self.config_problem: str | None = None
        self.checkpoint: Path | None = None
        self.code: Path | None = None

    def check_paths(self) -> None:
        """Paths the user named must exist: say so at once, before any slow step."""
        request = self.request
        for option, path in (("--code", request.code), ("--config", request.config),
                             ("--reference-path", request.reference_path), ("--target", request.target),
                             ("--hidden-states", request.hidden_states)):
            if path is not None:
                from sleuth.artifacts import named_path_error

                # A FIFO or a device refused before anything opens it; an unreadable one is "permission denied".
                error = named_path_error(option, path, directory_ok=option != "--config")
                if error is not None:
                    raise DiagnoseError(error)
        if request.served_by is not None:
            from sleuth.checks.engines import EngineError, resolve_engine

            try:
                resolve_engine(request.served_by)
            except EngineError as exc:
                raise DiagnoseError(f"--served-by: {exc}") from None
        from sleuth.probes.runner import ProbeError, check_options

        try:
            check_options(request.probe_python, request.probe_entry)
        except ProbeError as exc:
            raise DiagnoseError(str(exc)) from None

    def read_run(self) -> None:
        request = self.request
        with self.trace.step("read-run", run=request.run, runs_dir=request.runs_dir) as step:
            info = read_run(resolve_run_dir(request.run or "", request.runs_dir))
            checkpoint = info.checkpoint.parent.name if info.checkpoint else "none"
            step.outcome = (
                f"{info.name} ({info.path}): {len(info.metrics)} metrics rows, config "
                f"{'read' if info.config is not None else 'missing'}, checkpoint {checkpoint}, "
                f"code/ {'present' if info.code_dir else 'missing'}"
            )
            if info.problems:
                step.outcome += "; problems: " + "; ".join(info.problems)
        self.run_info = info

    def read_config(self) -> None:
        request, info = self.request, self.run_info
        if request.config is not None:
            source = request.config
        elif info is not None:
            source = info.config_path
        else:
            with self.trace.step("read-config", source=None) as step:
                step.outcome = "none given (--config): checks that need the run configuration rely on the code"
            return
        with self.trace.step("read-config", source=source) as step:
            if request.config is not None:
                self.config = load_config_file(request.config)
            else:
                assert info is not None
                self.config = info.config
            if self.config is None:
                reason = next((p for p in info.problems if p.startswith("config.json")), "config.json is unreadable") if info else ""
                self.config_problem = f"the run's {reason}"
                step.outcome = f"{reason}: checks that need the config will be unknown (the code's defaults are not what ran)"
                return
            self.config_source = str(source)
            keys = ("block_size", "target_layer_ids", "loss_decay_gamma")
            shown = {k: self.config[k] for k in keys if k in self.config}
            step.outcome = f"{len(self.config)} keys; " + ", ".join(f"{k}={v}" for k, v in shown.items())

    def read_checkpoint(self) -> None:
        info = self.run_info
        if info is None:
            return
        with self.trace.step("locate-checkpoint", path=info.checkpoint) as step:
            if info.checkpoint is None:
                step.outcome = "no checkpoint: checks that need the weights will rely on config and code"
                return
            problem = safetensors_header_problem(info.checkpoint)
            # A damaged file is still handed to the checks: they report what they could not read as unknown.
            self.checkpoint = info.checkpoint
            step.outcome = (
                f"{info.checkpoint.parent.name}: {problem}" if problem else f"{info.checkpoint.parent.name}: header ok"
            )

    def read_code(self) -> None:
        request, info = self.request, self.run_info
        code = request.code if request.code is not None else (info.code_dir if info is not None else None)
        with self.trace.step("locate-code", path=code) as step:
            if code is None:
                step.outcome = "no code/ copy in the run: code checks will be unknown"
                return
            if code.is_file():
                step.outcome = f"one file, {_line_count(code)} lines"
            else:
                unreadable: list[str] = []
                count = sum(1 for p in _walk_files(code, _LOCATE_MAX_FILES, max_depth=None, unreadable=unreadable)
                            if p.suffix == ".py")
                step.outcome = f"{count}{'+' if count >= _LOCATE_MAX_FILES else ''} Python files"
                if unreadable:
                    from sleuth.artifacts import shown

                    more = f" and {len(unreadable) - 1} more folder(s)" if len(unreadable) > 1 else ""
                    step.outcome += f"; permission denied: {shown(unreadable[0])}{more} (not read)"
            self.code = code


def load_config_file(path: Path) -> dict[str, Any]:
    """A run configuration from JSON or YAML (a mapping of config keys); DiagnoseError if unreadable."""
    from sleuth.artifacts import ArtifactError, parse_json, shown
    from sleuth.safe_yaml import YamlLimitError, describe_decode_error, load_yaml, read_text_file

    try:
        text = read_text_file(path, what="config")
    except UnicodeDecodeError as exc:
        raise DiagnoseError(f"config {shown(path)} {describe_decode_error(exc)}") from None
    except (OSError, YamlLimitError) as exc:
        raise DiagnoseError(f"cannot read config {shown(path)}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        # YAML aliases are expanded under a bound: an alias bomb is refused in milliseconds, not hung on.
        # JSON under the same bounds as every file of a run (depth, number length).
        data = parse_json(text, path) if path.suffix == ".json" else load_yaml(text)
    except YamlLimitError as exc:
        raise DiagnoseError(f"config {shown(path)}: {exc}") from None
    except ArtifactError as exc:
        raise DiagnoseError(f"config {shown(path)} does not parse: {exc.reason}") from None
    except (ValueError, RecursionError) as exc:
        raise DiagnoseError(f"config {shown(path)} does not parse: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # yaml.YAMLError, without importing yaml for JSON configs
        raise DiagnoseError(f"config {shown(path)} does not parse: {(str(exc).splitlines() or [type(exc).__name__])[0]}") from None
    if not isinstance(data, dict):
        raise DiagnoseError(f"config {path} must hold a mapping of config keys")
    return data


def discover_config(code: Path) -> Path | None:
    """A run configuration beside the code: a JSON/YAML mapping that names a block_size."""
    for path in _nearby_files(code, _CONFIG_SUFFIXES):
        try:
            if os.lstat(path).st_size > 1_000_000:
                continue
        except OSError:
            continue
        try:
            data = load_config_file(path)
        except DiagnoseError:
            continue
        if "block_size" in data:
            return path
    return None


def discover_checkpoint(code: Path) -> Path | None:
    """A readable safetensors file beside the code (a drafter checkpoint someone shipped with it)."""
    for path in _nearby_files(code, (".safetensors",)):
        if safetensors_header_problem(path) is None:
            return path
    return None


def _nearby_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(
        p for p in _walk_files(root, _DISCOVERY_MAX_FILES, max_depth=_DISCOVERY_MAX_DEPTH) if p.suffix in suffixes
    )


def _walk_files(root: Path, limit: int, *, max_depth: int | None, unreadable: list[str] | None = None) -> list[Path]:
    """Files under `root`, skipping hidden and environment folders, at most `limit` of them; the folders that
    could not be listed for want of permission are added to `unreadable`."""
    import os

    def refused(error: OSError) -> None:
        if unreadable is not None and isinstance(error, PermissionError):
            unreadable.append(str(error.filename))

    found: list[Path] = []
    base_depth = len(root.parts)
    for folder, subfolders, files in os.walk(root, onerror=refused):
        here = Path(folder)
        depth = len(here.parts) - base_depth
        subfolders[:] = sorted(
            d for d in subfolders
            if not d.startswith(".") and d not in _SKIPPED_FOLDERS and (max_depth is None or depth < max_depth)
        )
        for name in sorted(files):
            found.append(here / name)
            if len(found) >= limit:
                return found
    return found


def _line_count(path: Path) -> int:
    try:
        return len(path.read_bytes().splitlines())
    except OSError:
        return 0
