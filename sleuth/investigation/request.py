"""What `sleuth diagnose` was asked, and the error that stops it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_PLAYBOOK = "dflash"
DEFAULT_REFERENCE = "speculators"


class DiagnoseError(Exception):
    """A user's mistake or an unreadable input that stops the diagnosis; the message is one line."""


@dataclass
class DiagnoseRequest:
    """What `sleuth diagnose` was asked; the CLI options one to one."""

    run: str | None = None
    runs_dir: Path | None = None
    baseline: str | None = None
    reference: str | None = None
    reference_path: Path | None = None
    code: Path | None = None
    config: Path | None = None
    offline: bool = False
    out: Path | None = None
    playbook: str = DEFAULT_PLAYBOOK
    reference_cache_dir: Path | None = None
    # Probes (sleuth/probes): None = the default policy (a run's code/ yes, --code only when asked).
    probe: bool | None = None
    probe_python: str | None = None
    probe_entry: str | None = None
    probe_timeout_s: float = 300.0
    target: Path | None = None  # the target / verifier directory, for the train-to-serve contract checks
    hidden_states: Path | None = None  # an offline hidden-state cache (dflash.hidden_state_capture)
    # The user's own training command (after `--`): run with --probe, observed for `observe_steps` optimizer
    # steps (sleuth/observe); its verdicts replace the probes'.
    command: list[str] | None = None
    observe_steps: int = 1
    served_by: str | None = None  # the serving engine the user serves with (dflash.sliding_window_served)
