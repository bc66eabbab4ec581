"""`trainer`: train DFlash drafters as named runs, list them, evaluate them, build the embedded target.

Heavy imports (torch, transformers) happen inside the commands so `trainer --help` answers at once.
User mistakes end in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from trainer.commands.eval import eval_command
from trainer.commands.export import export_command

app = typer.Typer(
    name="trainer",
    help="Train DFlash block-diffusion drafters on a frozen target, as named runs under ./runs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
target_app = typer.Typer(help="The embedded default target.", no_args_is_help=True)
app.add_typer(target_app, name="target")
from trainer.commands.hidden_states import hidden_states_app  # noqa: E402  (after `app`: it registers on it)

app.add_typer(hidden_states_app, name="hidden-states")

stderr = Console(stderr=True)
stdout = Console()

RunsDir = Annotated[Path, typer.Option("--runs-dir", help="Where named runs live.")]
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@contextmanager
def user_errors() -> Iterator[None]:
    """Map every error a user can cause to one line and exit code 2."""
    from trainer.config import ConfigError
    from trainer.run.rundir import RunError

    # OSError covers a --runs-dir that is a file, a read-only disk, a missing path.
    known: tuple[type[BaseException], ...] = (ConfigError, RunError, OSError)
    try:
        from trainer.data.datasets import DataError
        from trainer.target.frozen import TargetError

        known = (*known, TargetError, DataError)
    except ImportError:
        pass
    try:
        yield
    except known as exc:
        stderr.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        stderr.print("interrupted: resume with --resume (the last checkpoint is intact)")
        raise typer.Exit(130) from None


@app.command()
def run(
    name: Annotated[Optional[str], typer.Argument(help="Run name (default: the preset's name).")] = None,
    preset: Annotated[Optional[str], typer.Option(help="fixed | v3 | v5 | v6: the seed's history.")] = None,
    config_file: Annotated[Optional[Path], typer.Option("--config", help="YAML or JSON config file.")] = None,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="key=value (repeatable).")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Training steps (extends a resumed run).")] = None,
    runs_dir: RunsDir = Path("runs"),
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    resume: Annotated[bool, typer.Option("--resume", help="Continue a killed or finished run.")] = False,
    fixed: Annotated[
        bool,
        typer.Option("--fixed", help="Apply the latest diagnosis's fix (or the reference preset) to a new vN run."),
    ] = False,
    from_run: Annotated[
        Optional[str], typer.Option("--from", help="With --fixed: the diagnosed run whose fix to apply.")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")] = False,
) -> None:
    """Train a drafter into <runs-dir>/<name>/ (config, metrics.jsonl, checkpoints, eval.json)."""
    with user_errors():
        from trainer.config import ConfigError, build_config, validate_config
        from trainer.run.rundir import RunDir, next_version_name

        if from_run and not fixed:
            raise ConfigError("--from only makes sense with --fixed")
        extra: dict[str, Any] = {"steps": steps} if steps is not None else {}
        if fixed:
            if preset or config_file:
                raise ConfigError("--fixed builds its own config; drop --preset/--config (use --set to adjust)")
            name = name or next_version_name(runs_dir)
            values, preset = _fixed_config(runs_dir, from_run)
            values.update(extra)
            config = build_config(extra=values, overrides=overrides)
        elif resume:
            if name is None:
                raise ConfigError("--resume needs the run's name")
            if preset or config_file or overrides:
                raise ConfigError("--resume continues with the run's saved config; only --steps may change")
            saved = RunDir(runs_dir / name)
            config = validate_config({**saved.read_config(), **extra}) if saved.exists() else None
        else:
            config = build_config(preset=preset, config_file=config_file, overrides=overrides, extra=extra)
            name = name or preset
            if name is None:
                raise ConfigError("name the run (trainer run NAME) or pick a --preset")

        if not RUN_NAME.fullmatch(name) or name in {".", ".."}:
            raise ConfigError(f"run name {name!r}: use letters, digits, '.', '_' and '-' (it names a directory)")
        from trainer.run.loop import train

        result = train(
            RunDir(runs_dir / name), config, preset=preset, device=device, resume=resume, progress=not quiet
        )
        last = result.last_metrics
        summary = ", ".join(
            f"{key} {last[key]:.4g}" for key in ("loss", "acc", "streak", "eval_tau") if last.get(key) is not None
        )
        stdout.print(
            f"{result.run.name}: {result.steps_done} steps -> {result.run.path}  ({summary})", soft_wrap=True
        )


def _fixed_config(runs_dir: Path, from_run: str | None) -> tuple[dict[str, Any], str | None]:
    """The config for `--fixed`: the diagnosed run's config plus sleuth's fix.yaml, else the reference."""
    import yaml

    from trainer.config import ConfigError
    from trainer.run.rundir import RunDir

    if from_run is not None:
        source = RunDir(runs_dir / from_run)
        fix_file = source.diagnosis_dir / "fix.yaml"
        if not fix_file.is_file():
            raise ConfigError(f"run {from_run!r} has no diagnosis; run `sleuth diagnose --run {from_run}` first")
    else:
        diagnosed = sorted(runs_dir.glob("*/diagnosis/fix.yaml"), key=lambda p: p.stat().st_mtime)
        if not diagnosed:
            stderr.print("no diagnosed run found: using the reference configuration (preset 'fixed')")
            return {}, "fixed"
        fix_file = diagnosed[-1]
        source = RunDir(fix_file.parent.parent)
    try:
        fix = yaml.safe_load(fix_file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{fix_file} does not parse: {str(exc).splitlines()[0]}") from None
    patch = fix.get("config_patch") or {}
    values = {**source.read_config(), **patch}
    shown = ", ".join(f"{k}={v!r}" for k, v in patch.items()) or "nothing (no config-fixable finding)"
    stderr.print(f"applying the fix from {fix_file}: {shown}")
    for change in fix.get("code_changes") or []:
        stderr.print(
            f"[yellow]not fixed by config[/] {change.get('id')}: {change.get('hint')}", highlight=False
        )
    return values, None


@app.command("runs")
def list_runs_command(
    runs_dir: RunsDir = Path("runs"),
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array on stdout.")] = False,
) -> None:
    """List runs with their status and last metrics."""
    from trainer.run.rundir import list_runs

    rows = []
    for run_dir in list_runs(runs_dir):
        info = run_dir.read_info()
        metrics = run_dir.read_metrics()
        last = metrics[-1] if metrics else {}
        taus = [m["tau"] for m in metrics if "tau" in m]
        rows.append(
            {
                "name": run_dir.name,
                "preset": info.get("preset"),
                "status": info.get("status"),
                "steps_done": info.get("steps_done"),
                "step": last.get("step"),
                "loss": last.get("loss"),
                "acc": last.get("acc"),
                "streak": last.get("streak"),
                "tau": taus[-1] if taus else None,
                "path": str(run_dir.path),
            }
        )
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    if not rows:
        stderr.print(f"no runs in {runs_dir}")
        return
    table = Table("run", "preset", "status", "step", "loss", "acc", "streak", "tau")
    for row in rows:
        table.add_row(
            row["name"],
            row["preset"] or "",
            row["status"] or "",
            str(row["step"] or ""),
            *(f"{row[k]:.4f}" if isinstance(row[k], float) else "" for k in ("loss", "acc", "streak", "tau")),
        )
    stdout.print(table)


@target_app.command("build")
def target_build(
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if a complete build exists.")] = False,
) -> None:
    """Build the embedded target (tokenizer + small Qwen3 model) into the user cache."""
    with user_errors():
        from trainer.target.embedded import build_embedded_target, embedded_target_dir, ensure_embedded_target

        path = build_embedded_target(embedded_target_dir()) if force else ensure_embedded_target(progress=True)
        stdout.print(str(path))


@target_app.command("path")
def target_path() -> None:
    """Print where the embedded target lives (built or not)."""
    from trainer.target.embedded import embedded_target_dir

    stdout.print(str(embedded_target_dir()))


app.command("eval")(eval_command)
app.command("export")(export_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
