"""The training command a run directory records, offered for observation (never run without --probe).

Read from what each trainer writes, through the readers sleuth already has (sleuth.runs, sleuth.interop):

* our run directory (docs/reference/run-directory.md): `run.json`'s `command` (an argv list) when the trainer
  recorded one; otherwise `config.json`, the fully resolved configuration, with `code/`, the trainer source the
  run executed: `python -m trainer.cli run NAME --config RUN/config.json`, run in a copy of that code/ (the
  run's own code path, not whatever is installed now).
* a speculators save directory: `run.yaml`, the resolved config speculators documents as re-runnable
  (`speculators train --config run.yaml`), else the argv line of `train_command.txt` as written.
* SpecForge records no command, only the draft config path in its checkpoint provenance: that is said, and
  the user gives the command after `--`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sleuth.run_info import RunInfo

MAX_ARGV = 4096  # words of a recorded command


@dataclass
class Recorded:
    """A command recorded by a run (argv), where it came from, and the code it runs in (None: where you stand)."""

    argv: list[str] | None
    source: str
    code: Path | None = None
    why_not: str | None = None  # with argv None: why the run offers no command

    def shown(self) -> str:
        return shlex.join(self.argv) if self.argv else ""


def recorded_command(info: RunInfo) -> Recorded:
    """The command `info`'s run recorded, or why it has none (never raises for what the run holds)."""
    interop: Any = info.interop
    trainer = getattr(interop, "trainer", None)
    if trainer == "specforge":
        config = getattr(interop, "draft_config_path", None)
        return Recorded(None, "SpecForge checkpoint provenance", why_not="SpecForge records no training command, only "
                        f"its draft config ({config or 'not found'}): give your SpecForge training command after `--`")
    if interop is not None:
        run_yaml, command = getattr(interop, "run_yaml_path", None), getattr(interop, "train_command", None)
        if run_yaml is not None:
            return Recorded(["speculators", "train", "--config", str(Path(run_yaml).resolve())],
                            f"{run_yaml} (speculators' resolved config, re-run with --config)")
        if isinstance(command, str) and command.strip():
            try:
                argv = shlex.split(command)[:MAX_ARGV]
            except ValueError as exc:
                return Recorded(None, str(getattr(interop, "train_command_path", "train_command.txt")),
                                why_not=f"its recorded command cannot be split into words ({exc})")
            return Recorded(argv, str(getattr(interop, "train_command_path", "train_command.txt")))
        return Recorded(None, "speculators run", why_not="the run records neither run.yaml nor train_command.txt")
    argv = (info.run_json or {}).get("command")
    if isinstance(argv, list) and argv and all(isinstance(word, str) for word in argv) and len(argv) <= MAX_ARGV:
        return Recorded(list(argv), f"{info.path / 'run.json'} (command)", code=info.code_dir)
    if info.config is None:
        return Recorded(None, str(info.config_path), why_not="the run has no readable config.json to re-run")
    if info.code_dir is None or not (info.code_dir / "trainer" / "cli.py").is_file():
        return Recorded(None, str(info.config_path), why_not="the run has no code/ copy of the trainer it executed "
                        "(code/trainer/cli.py) to run its config.json with")
    return Recorded(["python", "-m", "trainer.cli", "run", info.name, "--config", str(info.config_path.resolve())],
                    f"{info.config_path} (the resolved config) with {info.code_dir} (the code the run executed)",
                    code=info.code_dir.resolve())
