"""Progress of a run on stderr: a live bar with the latest metrics on a TTY, silence otherwise."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class RunProgress:
    def __init__(self, name: str, total: int, enabled: bool = True) -> None:
        self.console = Console(stderr=True)
        # Quiet when not a TTY (CI, pipes, `make demo | tee`): the metrics file is the record.
        self.enabled = enabled and sys.stderr.isatty()
        self.name = name
        self.total = total
        self._progress: Progress | None = None
        self._task: Any = None

    def message(self, text: str) -> None:
        if self.enabled:
            self.console.print(f"[dim]{self.name}:[/] {text}")

    def start(self, completed: int) -> None:
        if not self.enabled:
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
            shown = f"loss {row['loss']:.3f} acc {row['acc']:.3f} streak {row['streak']:.2f}"
            if "tau" in row:
                shown += f" tau {row['tau']:.2f}"
            self._progress.update(self._task, metrics=shown)

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
