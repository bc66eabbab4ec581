"""Progress of a run on stderr: a live bar on a TTY; when stderr is piped (CI, `| tee`, a log file), one plain
line per PROGRESS_EVERY_S seconds at most (and at the end), so a long run shows it is alive without flooding."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

# Seconds between two progress lines on a pipe; TRAINER_PROGRESS_EVERY_S overrides it (0: every logged row).
PROGRESS_EVERY_S = 30.0
PROGRESS_ENV = "TRAINER_PROGRESS_EVERY_S"


class RunProgress:
    def __init__(self, name: str, total: int, enabled: bool = True) -> None:
        self.console = Console(stderr=True, highlight=False)
        self.enabled = enabled
        self.live = enabled and sys.stderr.isatty()
        self.name = name
        self.total = total
        self.every_s = _every_s()
        self._progress: Progress | None = None
        self._task: Any = None
        self._last_line = 0.0
        self._started = time.monotonic()
        self._start_step = 0

    def message(self, text: str) -> None:
        if self.live:
            self.console.print(f"[dim]{self.name}:[/] {text}", soft_wrap=True)

    def note(self, text: str) -> None:
        """Something the user should know about the run (shown unless --quiet, TTY or not)."""
        if self.enabled:
            self.console.print(f"[yellow]note:[/] {text}", soft_wrap=True)

    def start(self, completed: int) -> None:
        self._started = time.monotonic()
        self._last_line = self._started
        self._start_step = completed
        if not self.live:
            return
        self._progress = Progress(
            TextColumn(f"[bold]{self.name}[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[metrics]}"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task(self.name, total=self.total, completed=completed, metrics="")
        self._progress.start()

    def metrics(self, row: dict[str, Any]) -> None:
        if self._progress is not None:
            self._progress.update(self._task, metrics=_shown(row))
        elif self.enabled:
            now = time.monotonic()
            if now - self._last_line >= self.every_s or row["step"] >= self.total:
                self._line(row, now)

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def _line(self, row: dict[str, Any], now: float) -> None:
        # One record per line, fields in a fixed order: easy to grep or to read in a CI log.
        done = row["step"] - self._start_step
        elapsed = now - self._started
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - row["step"]) / rate if rate > 0 else None
        eta_text = f" eta {eta:.0f}s" if eta is not None else ""
        sys.stderr.write(
            f"{self.name}: step {row['step']}/{self.total} {_shown(row)} ({rate:.2f} steps/s{eta_text})\n"
        )
        sys.stderr.flush()
        self._last_line = now


def _shown(row: dict[str, Any]) -> str:
    shown = f"loss {row['loss']:.3f} acc {row['acc']:.3f} streak {row['streak']:.2f}"
    if "tau" in row:
        shown += f" tau {row['tau']:.2f}"
    return shown


def _every_s() -> float:
    raw = os.environ.get(PROGRESS_ENV)
    try:
        value = float(raw) if raw is not None else PROGRESS_EVERY_S
    except ValueError:
        return PROGRESS_EVERY_S
    return value if value >= 0 else PROGRESS_EVERY_S


class ThrottledLines:
    """Per-item progress lines (a shard written, a file done) by the same rule as a run's progress: every line
    on a terminal; on a pipe or a log file at most one per PROGRESS_EVERY_S seconds, and the last one, so a
    long job shows it is alive without writing a line per item."""

    def __init__(self, write: Any, stream: Any = None) -> None:
        stream = sys.stderr if stream is None else stream
        self.write = write
        self.live = _isatty(stream)
        self.every_s = _every_s()
        self._last = time.monotonic()

    def __call__(self, line: str, last: bool = False) -> None:
        now = time.monotonic()
        if self.live or last or now - self._last >= self.every_s:
            self.write(line)
            self._last = now


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False
