"""sleuth's side of a probe: which subject, in which interpreter, and the subprocess that runs it.

The experiments never run in sleuth's own process: the code under diagnosis is imported in a child
process (`sleuth.probes.worker`) with its import root first on sys.path, CUDA hidden, the network refused
and a wall-clock limit. Its answer is JSON; anything else it does (a crash, a hang, an import error) turns
into `unknown` verdicts with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.probes.verdict import DECIDES, PROBED_INVARIANTS, Expectations, Verdict

DEFAULT_TIMEOUT_S = 120.0
TRAINER_ENTRY = "trainer.probe:probe_subject"
# The sleuth package: linked into the child's scratch directory (its sys.path[0]), so the child imports
# sleuth.probes without seeing anything else that lives beside sleuth (a site-packages, a checkout's trainer/).
SLEUTH_PACKAGE = Path(__file__).resolve().parents[1]


class ProbeError(Exception):
    """A probe option the user got wrong (a missing interpreter, a malformed entry); one line."""


@dataclass
class ProbePlan:
    """What to probe. `spec` is the worker's input; None with `reason` when there is nothing to run."""

    subject: str  # a short name for the report: "run v5", "speculators at PATH", "entry mod:fn"
    spec: dict[str, Any] | None = None
    reason: str | None = None


@dataclass
class ProbeOutcome:
    subject: str
    verdicts: list[Verdict] = field(default_factory=list)
    info: dict[str, Any] | None = None  # the subject's describe()
    python: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None  # why no experiment ran (then every verdict is unknown with this reason)


def plan_for_run(run_dir: Path, code_dir: Path | None, name: str) -> ProbePlan:
    """A run is probed through the entry point its own `code/` copy exposes, imported from that copy."""
    subject = f"run {name}"
    if code_dir is None or not code_dir.is_dir():
        return ProbePlan(subject, reason="the run has no code/ copy, so there is no code to run")
    if not (code_dir / "trainer" / "probe.py").is_file():
        return ProbePlan(subject, reason="the run's code/ has no trainer/probe.py: it was recorded before the trainer "
                         "exposed a probe entry point, so its code cannot be run by sleuth")
    spec = {
        "subject": "entry",
        "entry": TRAINER_ENTRY,
        "sys_path": [str(code_dir.resolve())],
        "require_under": {"trainer": str((code_dir / "trainer").resolve())},
        "context": {"run_dir": str(run_dir.resolve())},
    }
    return ProbePlan(subject, spec=spec)


def plan_for_code(code: Path, config: dict[str, Any] | None, config_path: Path | None = None) -> ProbePlan:
    """speculators or SpecForge source (a package directory or a checkout), by its layout. The run's config
    (and its path: a SpecForge recipe names its draft config relative to itself) reach the adapter."""
    code = code.resolve()
    for kind, package, marker in (
        ("speculators", "speculators", Path("models") / "dflash" / "core.py"),
        ("specforge", "specforge", Path("modeling") / "draft" / "dflash.py"),
    ):
        for candidate in (code, code / package, code / "src" / package):
            if (candidate / "__init__.py").is_file() and (candidate / marker).is_file() and candidate.name == package:
                spec = {"subject": kind, "package_dir": str(candidate), "sys_path": [str(candidate.parent)],
                        "context": {"config": config,
                                    "config_path": str(config_path.resolve()) if config_path else None}}
                return ProbePlan(f"{kind} at {candidate}", spec=spec)
    return ProbePlan(f"code at {code}", reason=f"{code} is neither speculators nor SpecForge source and no "
                     "--probe-entry module:function was given, so sleuth has no way to run it")


def check_entry(entry: str) -> None:
    module, _, function = entry.partition(":")
    if not module or not function or not all(part.isidentifier() for part in module.split(".")) \
            or not function.isidentifier():
        raise ProbeError(f"--probe-entry must be module:function (e.g. my_trainer.probe:subject), got {entry!r}")


def check_options(python: str | None, entry: str | None) -> None:
    """Fail fast on probe options a user got wrong, before any slow step."""
    check_python(python)
    if entry is not None:
        check_entry(entry)


def plan_for_entry(entry: str, code: Path | None, run_dir: Path | None, config: dict[str, Any] | None) -> ProbePlan:
    check_entry(entry)
    roots = []
    if code is not None:
        roots.append(str((code if code.is_dir() else code.parent).resolve()))
    spec = {"subject": "entry", "entry": entry, "sys_path": roots,
            "context": {"run_dir": str(run_dir.resolve()) if run_dir else None,
                        "code": str(code.resolve()) if code else None, "config": config}}
    return ProbePlan(f"entry {entry}", spec=spec)


def check_python(python: str | None) -> str:
    """The interpreter to probe in: --probe-python, else the current one."""
    if python is None:
        return sys.executable
    path = Path(python).expanduser()
    if not path.exists():
        raise ProbeError(f"--probe-python {python} does not exist")
    if not os.access(path, os.X_OK) or path.is_dir():
        raise ProbeError(f"--probe-python {python} is not an executable interpreter")
    return str(path)


def run_plan(plan: ProbePlan, *, python: str | None = None, expectations: Expectations | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = None) -> ProbeOutcome:
    """Run the plan's experiments in a child process; never raises for what the subject does."""
    outcome = ProbeOutcome(subject=plan.subject)
    if plan.spec is None:
        outcome.error = plan.reason or "nothing to probe"
        outcome.verdicts = unknown_verdicts(outcome.error)
        return outcome
    interpreter = check_python(python)
    outcome.python = interpreter
    spec = {**plan.spec, "expectations": (expectations or Expectations()).to_json(),
            "threads": threads or 1, "seed": 0}  # tiny tensors: a second thread only adds contention
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sleuth-probe-") as scratch:
        (Path(scratch) / "sleuth").symlink_to(SLEUTH_PACKAGE, target_is_directory=True)
        env["PYTHONPATH"] = os.pathsep.join([scratch, *filter(None, [os.environ.get("PYTHONPATH")])])
        spec_path, out_path = Path(scratch) / "spec.json", Path(scratch) / "out.json"
        spec_path.write_text(json.dumps(spec))
        try:
            done = subprocess.run(
                [interpreter, "-m", "sleuth.probes.worker", str(spec_path), str(out_path)],
                cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            outcome.error = f"the probe process ran past its {timeout_s:g} s limit and was stopped"
        except OSError as exc:
            outcome.error = f"cannot start {interpreter}: {exc.strerror or exc}"
        else:
            if out_path.is_file():
                answer = json.loads(out_path.read_text())
                outcome.info = answer.get("subject")
                outcome.seconds = answer.get("seconds") or {}
                outcome.error = answer.get("error")
                outcome.verdicts = [Verdict.from_json(v) for v in answer.get("verdicts") or []]
            else:
                last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
                outcome.error = f"the probe process ended without an answer ({last})"
    outcome.wall_s = round(time.perf_counter() - started, 3)
    if outcome.error and not outcome.verdicts:
        outcome.verdicts = unknown_verdicts(outcome.error)
    return outcome


def unknown_verdicts(reason: str) -> list[Verdict]:
    return [Verdict(invariant=invariant, status="unknown", experiment=experiment, hypothesis="", perturbed="",
                    measurement="", threshold="", reason=reason)
            for experiment, invariants in DECIDES.items() for invariant in invariants]


__all__ = ["PROBED_INVARIANTS", "ProbeError", "ProbeOutcome", "ProbePlan", "check_entry", "check_options", "check_python", "plan_for_code",
           "plan_for_entry", "plan_for_run", "run_plan", "unknown_verdicts"]
