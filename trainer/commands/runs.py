"""`trainer runs`: list runs with their status and last metrics.

A damaged run is listed with status `damaged` and one line on stderr naming the file, never a traceback;
the other runs are listed as usual. A run whose record says `running` but whose process is gone (killed)
shows as `stopped`: resume it with `trainer run NAME --resume`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainer.commands.options import RunsDir, flag
from trainer.errors import print_error, user_errors
from trainer.safe_io import escape_unsafe


def runs_command(
    runs_dir: RunsDir = Path("runs"),
    as_json: Annotated[bool, flag("--json", help="One JSON array on stdout.")] = False,
) -> None:
    """List runs with their status and last metrics."""
    with user_errors(resume_hint=None, oom_hint=None):
        from trainer.run.rundir import RunError, list_runs, run_is_active

        rows = []
        for run_dir in list_runs(runs_dir):
            row: dict[str, Any] = {"name": run_dir.name, "path": str(run_dir.path)}
            try:
                info = run_dir.read_info()
                run_dir.read_config()
                # streamed, row by row: only the last training row and the last tau are kept
                last: dict[str, Any] = {}
                tau = None
                for metric in run_dir.iter_metrics():
                    if metric.get("split", "train") == "train":  # not validation rows
                        last = metric
                    if _number(metric.get("tau")) is not None:
                        tau = metric["tau"]
            except RunError as exc:
                print_error(str(exc))
                rows.append({**row, "status": "damaged", "created": None})
                continue
            status = _text(info.get("status"))
            if status == "running" and not run_is_active(run_dir):
                status = "stopped"
            rows.append(
                {
                    **row,
                    "preset": _text(info.get("preset")),
                    "status": status,
                    "created": _text(info.get("created")),
                    "steps_done": info.get("steps_done") if isinstance(info.get("steps_done"), int) else None,
                    "step": last.get("step"),
                    **{key: _number(last.get(key)) for key in ("loss", "acc", "streak")},
                    "tau": tau,
                }
            )
        # Oldest first; a record without a readable creation time sorts by name, after the dated ones.
        rows.sort(key=lambda r: (r["created"] is None, r["created"] or "", r["name"]))
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    if not rows:
        Console(stderr=True).print(f"no runs in {runs_dir}", highlight=False, soft_wrap=True)
        return
    table = Table("run", "preset", "status", "step", "loss", "acc", "streak", "tau")
    for row in rows:
        table.add_row(
            _cell(row["name"]),
            _cell(row.get("preset") or ""),
            _cell(row["status"] or ""),
            str(row.get("step") if row.get("step") is not None else ""),
            *(f"{row[k]:.4f}" if row.get(k) is not None else "" for k in ("loss", "acc", "streak", "tau")),
        )
    Console().print(table)


def _cell(value: str) -> Text:
    """A table cell of run.json text, shown as written: a Text is never read as rich markup (`[/]` in a preset
    name is no error), and control, format and separator characters (an ESC sequence, a bidi override, a line
    separator from a run directory shipped by someone else) are spelled as escapes, never sent to the terminal."""
    return Text(escape_unsafe(value))


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
