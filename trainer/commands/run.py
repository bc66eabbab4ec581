"""`trainer run NAME`: train a drafter into <runs-dir>/<name>/, resume it, or train sleuth's fix as a new vN.

The run's name is claimed before anything is loaded: a second `trainer run` of the same name exits 2 and
touches nothing, and a new run never goes into a directory that is not empty.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

from trainer.commands.options import RunsDir, flag
from trainer.errors import UsageError, user_errors

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def run_command(
    name: Annotated[Optional[str], typer.Argument(metavar="NAME", help="Run name (default: the preset's name).")] = None,
    preset: Annotated[Optional[str], typer.Option(metavar="NAME", help="fixed | v3 | v5 | v6 | recipe-2026 (the seed's history) | zlab-qwen3.6 | zlab-qwen3.6-27b (the published Qwen3.6 drafter) | dflash2-tiny (speculators' DFlash2 recipe, tiny) | dspark-tiny (DeepSpec's DSpark recipe, tiny).")] = None,
    config_file: Annotated[
        Optional[Path], typer.Option("--config", metavar="FILE", help="YAML or JSON config file.")
    ] = None,
    overrides: Annotated[
        Optional[list[str]], typer.Option("--set", metavar="KEY=VALUE", help="Override one config key (repeatable).")
    ] = None,
    steps: Annotated[Optional[int], typer.Option(metavar="N", help="Training steps (extends a resumed run).")] = None,
    runs_dir: RunsDir = Path("runs"),
    device: Annotated[str, typer.Option(metavar="DEVICE", help="auto | cpu | cuda")] = "auto",
    resume: Annotated[bool, flag("--resume", help="Continue a killed, failed or finished run.")] = False,
    fixed: Annotated[
        bool, flag("--fixed", help="Apply the latest diagnosis's fix (or the reference preset) to a new vN run.")
    ] = False,
    from_run: Annotated[
        Optional[str], typer.Option("--from", metavar="RUN", help="With --fixed: the diagnosed run whose fix to apply.")
    ] = None,
    quiet: Annotated[bool, flag("--quiet", "-q", help="No progress display or progress lines.")] = False,
) -> None:
    """Train a drafter into <runs-dir>/<name>/ (config, metrics.jsonl, checkpoints, eval.json)."""
    with user_errors():
        from trainer.config import build_config
        from trainer.run.rundir import RunDir, claim_next_version

        if from_run and not fixed:
            raise UsageError("--from only makes sense with --fixed")
        if name is not None:
            _check_run_name(name)
        extra: dict[str, Any] = {"steps": steps} if steps is not None else {}
        claim = None
        if fixed:
            if preset or config_file:
                raise UsageError("--fixed builds its own config; drop --preset/--config (use --set to adjust)")
            values, preset, notes = _fixed_config(runs_dir, from_run)
            config = build_config(extra={**values, **extra}, overrides=overrides)
            errors = Console(stderr=True, highlight=False)
            for note in notes:  # only once the fixed config is valid: an error stays the only line
                errors.print(note, soft_wrap=True)
            if name is None:
                run, claim = claim_next_version(runs_dir)
            else:
                run = RunDir(runs_dir / name)
        elif resume:
            if name is None:
                raise UsageError("--resume needs the run's name")
            if preset or config_file or overrides:
                raise UsageError("--resume continues with the run's saved config; only --steps may change")
            run, config = RunDir(runs_dir / name), None
        else:
            config = build_config(preset=preset, config_file=config_file, overrides=overrides, extra=extra)
            name = name or preset
            if name is None:
                raise UsageError("name the run (trainer run NAME) or pick a --preset")
            _check_run_name(name)
            run = RunDir(runs_dir / name)

        from trainer.run.loop import train

        result = train(
            run, config, preset=preset, device=device, resume=resume, progress=not quiet, steps=steps, claim=claim
        )
    last = result.last_metrics
    summary = ", ".join(
        f"{key} {last[key]:.4g}" for key in ("loss", "acc", "streak", "eval_tau") if isinstance(last.get(key), float)
    )
    Console().print(
        f"{result.run.name}: {result.steps_done} steps -> {result.run.path}  ({summary})",
        soft_wrap=True, highlight=False,
    )


def _check_run_name(name: str) -> None:
    if not RUN_NAME.fullmatch(name) or name in {".", ".."}:
        raise UsageError(f"run name {name!r}: use letters, digits, '.', '_' and '-' (it names a directory)")


def _fixed_config(runs_dir: Path, from_run: str | None) -> tuple[dict[str, Any], str | None, list[str]]:
    """The config for `--fixed`: the diagnosed run's config plus sleuth's fix.yaml, else the reference;
    and the notes (rich markup) that say what was applied."""
    from trainer.config import load_yaml
    from trainer.run.rundir import RunDir, RunError, read_text

    if from_run is not None:
        _check_run_name(from_run)
        source = RunDir(runs_dir / from_run)
        fix_file = source.diagnosis_dir / "fix.yaml"
        if not fix_file.is_file():
            raise UsageError(f"run {from_run!r} has no diagnosis; run `sleuth diagnose --run {from_run}` first")
    else:
        chosen = _newest_own_diagnosis(runs_dir)
        if chosen is None:
            return {}, "fixed", ["no diagnosed run found: using the reference configuration (preset 'fixed')"]
        fix_file, source = chosen
    fix = load_yaml(read_text(fix_file, source.path, limit=2**20), str(fix_file)) or {}
    if not isinstance(fix, dict):
        raise RunError(f"{fix_file} must hold a mapping (config_patch, code_changes); the file is damaged")
    patch = fix.get("config_patch") or {}
    changes = fix.get("code_changes") or []
    if not isinstance(patch, dict):
        raise RunError(f"{fix_file}: config_patch must be a mapping of config keys; the file is damaged")
    if not isinstance(changes, list) or not all(isinstance(change, dict) for change in changes):
        raise RunError(f"{fix_file}: code_changes must be a list of entries with id and hint; the file is damaged")
    values = {**source.read_config(), **patch}
    _check_written_for(fix, fix_file, source)
    shown = ", ".join(f"{_printable(k)}={v!r}" for k, v in patch.items()) or "nothing (no config-fixable finding)"
    notes = [escape(f"applying the fix from {_printable(fix_file)} (the diagnosis of run {_printable(source.name)}): "
                    f"{shown}")]
    notes += [f"[yellow]not fixed by config[/] {escape(_printable(change.get('id')))}: "
              f"{escape(_printable(change.get('hint')))}" for change in changes]
    return values, None, notes


def _printable(value: object) -> str:
    """A string from fix.yaml (hand-editable) for the terminal: controls, bidi and invisible characters escaped."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(value))


def _newest_own_diagnosis(runs_dir: Path) -> tuple[Path, Any] | None:
    """`--fixed` without `--from`: the newest fix.yaml that is the diagnosis of the run it sits in, by the
    provenance sleuth records (`diagnosed_run_path` is that run directory, `diagnosed_config_sha256` its
    config.json). A fix.yaml without it (hand-written, copied in with a run from elsewhere, or from an older
    sleuth) or for another directory is foreign: never applied here. When a foreign one is the newest (a run
    dropped into runs/ with a fix.yaml dated in the future), or two own ones are equally new, the choice is
    ambiguous and refused in one line; `--from RUN` chooses. None when no run has a diagnosis."""
    import hashlib
    import os

    from trainer.config import load_yaml
    from trainer.run.rundir import RunDir, RunError, read_bytes, read_text

    own: list[tuple[float, Path, Any]] = []
    foreign: list[tuple[float, Path, str]] = []
    for fix_file in sorted(runs_dir.glob("*/diagnosis/fix.yaml")):
        run = RunDir(fix_file.parent.parent)
        try:
            mtime = fix_file.lstat().st_mtime
            if fix_file.is_symlink() or fix_file.parent.is_symlink() or run.path.is_symlink():
                foreign.append((mtime, fix_file, "it is reached through a link"))
                continue
            fix = load_yaml(read_text(fix_file, run.path, limit=2**20), str(fix_file))
            recorded_path = fix.get("diagnosed_run_path") if isinstance(fix, dict) else None
            recorded_sha = fix.get("diagnosed_config_sha256") if isinstance(fix, dict) else None
            if not isinstance(recorded_path, str) or not isinstance(recorded_sha, str):
                foreign.append((mtime, fix_file, "it does not record which run directory and config it was "
                                                 "written for (diagnosed_run_path, diagnosed_config_sha256)"))
            elif os.path.realpath(recorded_path) != os.path.realpath(run.path):
                foreign.append((mtime, fix_file, f"it was written for {_printable(recorded_path)}"))
            elif hashlib.sha256(read_bytes(run.config_path, run.path)).hexdigest() != recorded_sha:
                foreign.append((mtime, fix_file, f"{run.name}'s config.json changed since that diagnosis"))
            else:
                own.append((mtime, fix_file, run))
        except (OSError, RunError, UsageError, ValueError) as exc:
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            foreign.append((fix_file.lstat().st_mtime if fix_file.exists() else 0.0, fix_file,
                            f"it cannot be read ({_printable(first)[:200]})"))
    if not own and not foreign:
        return None
    newest_own = max(own, key=lambda item: item[0], default=None)
    newer_foreign = [item for item in foreign if newest_own is None or item[0] >= newest_own[0]]
    choose = "; name the diagnosed run with --fixed --from RUN"
    if newer_foreign:
        mtime, fix_file, why = max(newer_foreign, key=lambda item: item[0])
        raise UsageError(f"the newest diagnosis, {_printable(fix_file)}, is not sleuth's diagnosis of the run it "
                         f"sits in ({why}){choose}")
    assert newest_own is not None
    tied = [item for item in own if item[0] == newest_own[0]]
    if len(tied) > 1:
        names = ", ".join(_printable(item[2].name) for item in tied)
        raise UsageError(f"the diagnoses of {names} are equally new: which to fix is ambiguous{choose}")
    return newest_own[1], newest_own[2]


def _check_written_for(fix: dict[str, Any], fix_file: Path, source: Any) -> None:
    """A fix.yaml patches the config it was computed against: `diagnosed_config_sha256` (sleuth records the
    sha256 of the config.json bytes it diagnosed) must be the source run's config.json, so a fix written for
    v5 (copied into v3's diagnosis/, or written there with `sleuth diagnose --out`) is refused, not applied to
    v3. A fix.yaml from an older sleuth, without the hash, must at least name the run."""
    import hashlib

    from trainer.run.rundir import RunError, read_bytes

    written_for = fix.get("diagnosed_run")
    recorded = fix.get("diagnosed_config_sha256")
    again = f"run `sleuth diagnose --run {source.name}` for its own fix"
    if recorded is not None:
        actual = hashlib.sha256(read_bytes(source.config_path, source.path)).hexdigest()
        if recorded != actual:
            where = f"run {written_for!r}" if isinstance(written_for, str) else "another run"
            raise RunError(f"{fix_file} was written for {where} (config sha256 {str(recorded)[:12]}), not for "
                           f"{source.name}'s config.json ({actual[:12]}); {again}")
        return
    names = {source.name}
    try:
        name = source.read_info().get("name")
        names |= {name} if isinstance(name, str) else set()
    except RunError:
        pass
    if not isinstance(written_for, str) or written_for not in names:
        said = f"was written for run {written_for!r}" if isinstance(written_for, str) else "does not say which run it was written for"
        raise RunError(f"{fix_file} {said}, not {source.name}; {again}")
