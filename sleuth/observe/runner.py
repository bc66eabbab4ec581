"""sleuth's side of an observed run: copy the code, run the user's command isolated, read the observation back.

The command runs only with consent (`--probe`: diagnose refuses a command without it), with the probes'
isolation (sleuth/probes/sandbox.py: `Box`, `run_confined`, the child environment, the limits), on a copy of
the code (runner.copy_code: regular files, no links, bounded). The child's first process is launch.py; the
observer reaches the command's Python through a `sitecustomize.py` first on its PYTHONPATH. The answer file is
the only thing read back: bounded, JSON, judged by judge.py, every string made safe.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sleuth.observe.judge import OBSERVED_INVARIANTS, judge
from sleuth.observe.needs import missing_need, named_inputs, unreadable_by_others
from sleuth.observe.optimization_judge import OPTIMIZATION_INVARIANTS, horizon_hint, run_configuration
from sleuth.probes.answer import safe_text
from sleuth.probes.runner import (
    SLEUTH_PACKAGE,
    CodeCopy,
    CopyError,
    ProbeOutcome,
    _read_regular,
    check_python,
    copy_code,
)
from sleuth.probes.sandbox import (
    Box,
    Limits,
    SandboxError,
    child_environment,
    interpreter_facts,
    planned_level,
    read_paths_for,
    run_confined,
)
from sleuth.probes.trust import tree_sha256
from sleuth.probes.verdict import Expectations, Verdict

DEFAULT_STEPS = 1
SITE = Path(__file__).resolve().with_name("site") / "sitecustomize.py"


def _unknown_all(reason: str) -> list[Verdict]:
    return [Verdict(invariant=i, status="unknown", experiment="observed-step", hypothesis="", perturbed="",
                    measurement="", threshold="", reason=reason) for i in OBSERVED_INVARIANTS + OPTIMIZATION_INVARIANTS]


def _failed(outcome: ProbeOutcome, reason: str) -> ProbeOutcome:
    outcome.error = safe_text(reason, limit=600)
    outcome.verdicts = _unknown_all(outcome.error)
    return outcome


def observe_command(command: list[str], code: Path, *, cwd: Path | None = None, python: str | None = None,
                    expectations: Expectations | None = None, timeout_s: float = 300.0, steps: int = DEFAULT_STEPS,
                    threads: int = 2, announce: Callable[[str], None] | None = None,
                    config: dict[str, Any] | None = None) -> ProbeOutcome:
    """Run `command` on a copy of `code` (in the copy of `cwd` when it lies inside `code`) for `steps` optimizer
    steps, observed; never raises for what the command does."""
    shown = shlex.join(command)
    outcome = ProbeOutcome(subject=f"command `{shown}`", asked=True)
    started = time.perf_counter()
    code = code.resolve()
    if not code.is_dir():
        return _failed(outcome, f"--code {code} is not a directory: the command runs in a copy of its directory")
    interpreter = check_python(python)
    outcome.python = interpreter
    here = (cwd or Path.cwd()).resolve()
    relative = os.path.relpath(here, code) if here == code or code in here.parents else "."
    if relative == "." and here != code:
        outcome.notes.append(f"the command runs at the root of the copy of {code} (the current directory is "
                             "outside it)")
    box = Box.create()
    try:
        try:
            files = copy_code(CodeCopy(code), box.code, outcome.notes)
        except CopyError as exc:
            return _failed(outcome, str(exc))
        outcome.code_files, outcome.code_sha256 = len(files), tree_sha256(files)
        (box.lib / "sleuth").mkdir()
        (box.lib / "sleuth" / "__init__.py").write_bytes((SLEUTH_PACKAGE / "__init__.py").read_bytes())
        copy_code(CodeCopy(SLEUTH_PACKAGE, only="observe", python_only=True), box.lib / "sleuth", [], worker=True)
        (box.lib / "sitecustomize.py").write_bytes(SITE.read_bytes())
        # What the command configures (its arguments, a config file they name): the optimizer's groups and the
        # schedule are judged against it, and the observer steps its copy of the scheduler over that horizon.
        configured = run_configuration(command, here, config)
        spec = {"answer": str(box.answer), "command": command, "code": str(box.code),
                "name": code.name or "code", "cwd": relative, "steps": max(1, int(steps)),
                "schedule": horizon_hint(configured)}
        spec_path = box.box / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = child_environment(box, interpreter, threads)
        try:
            facts = interpreter_facts(interpreter, env, box.work)
        except SandboxError as exc:
            return _failed(outcome, str(exc))
        if facts.torch is None:
            return _failed(outcome, f"the command's interpreter {interpreter} has no torch: give --probe-python an "
                           "environment where `import torch` works")
        limits = Limits.for_timeout(timeout_s, threads)
        # What the user prepared for the command (a target, a feature cache) is what its arguments name: visible to
        # it read-only at the same path, and nothing else of the user's files.
        inputs = [str(path) for path in named_inputs(command, here, code)]
        if inputs:
            outcome.notes.append("visible to the command read-only, as its arguments name them: " + ", ".join(inputs))
        hidden = [str(p) for p in unreadable_by_others([Path(p) for p in inputs])] if hasattr(os, "geteuid") \
            and os.geteuid() == 0 and not planned_level().startswith("process") else []
        if hidden:
            # sleuth as root runs the command as nobody: the user's 0600 files are there but unreadable to it.
            outcome.notes.append("not readable by other users, so not by the observed command (it runs as an "
                                 f"unprivileged user): {', '.join(hidden)}; chmod o+r (o+rx for folders) to let it")
        if announce:
            announce(safe_text(f"observing: `{shown}` on a copy of {code} ({len(files)} files, "
                               f"sha256:{(outcome.code_sha256 or '')[:16]}), at your request (--probe), for "
                               f"{spec['steps']} optimizer step(s), in {interpreter}; isolation {planned_level()}; "
                               f"at most {timeout_s:g} s" + (f"; it may read {', '.join(inputs)}" if inputs else "")))
        try:
            finished = run_confined([interpreter, "-m", "sleuth.observe.launch", str(spec_path)], box=box, env=env,
                                    read_paths=[*read_paths_for(facts, interpreter), *inputs], timeout_s=timeout_s,
                                    limits=limits)
        except SandboxError as exc:
            return _failed(outcome, str(exc))
        outcome.isolation = finished.isolation
        if finished.isolation.fallback:
            outcome.notes.append(f"isolation fell back to {finished.isolation.level}: {finished.isolation.fallback}")
        if finished.swept:
            outcome.notes.append(f"{finished.swept} process(es) the command left running were killed")
        last = safe_text((finished.stderr_tail.strip().splitlines() or [""])[-1].strip(), limit=300)
        needed = missing_need(finished.stderr_tail, interpreter) or missing_need(finished.stdout_tail, interpreter)
        if finished.timed_out:
            # The sandbox refuses unix sockets (docs/security.md), and worker processes that hand tensors back over
            # them (torch's DataLoader with num_workers > 0) then wait forever instead of failing: say so.
            return _failed(outcome, f"the command ran past {timeout_s:g} s without completing {spec['steps']} "
                           f"optimizer step(s) and was stopped" + (f" (last output: {last})" if last else "")
                           + "; worker processes that pass tensors over unix sockets (a DataLoader with "
                           "num_workers > 0) cannot in the sandbox: give the command num_workers=0")
        observation = _read_observation(box.answer, limits.answer_bytes)
        if not isinstance(observation, dict):
            return _failed(outcome, f"the command gave no observation ({observation or finished.ending(limits)}"
                           + (f"; {last}" if last else "") + ")")
        ended = observation.get("ended")
        if ended != "observed":
            why = observation.get("error")
            steps_done = observation.get("steps") or 0
            returncode = observation.get("returncode")
            if hidden and not steps_done and returncode not in (None, 0):
                needed = needed or (f"to read {', '.join(hidden[:3])}, which other users cannot read (the observed "
                                    "command runs as an unprivileged user): chmod o+r (o+rx for folders)")
            if needed and not steps_done and returncode not in (None, 0):
                # What it lacked says more than how the observer saw it end (no torch imported, no step).
                why = (f"the command cannot run here: {needed} (exit status {observation.get('returncode')}"
                       + (f"; last output: {last}" if last else "") + ")")
            if not why and ended == "no_observation":
                why = (f"the command ended (exit status {observation.get('returncode')}) and sleuth's observer never "
                       "reported: not a Python command, a Python started with -I, -E or -S (which skip the observer), "
                       "or a process killed before it could" + (f"; last output: {last}" if last else ""))
            if not why and not steps_done and returncode not in (None, 0) and not observation.get("backward_calls"):
                why = (f"the command failed (exit status {returncode}) before its first training step"
                       + (f": {last}" if last else ""))
            if not why and ended == "command_ended" and not observation.get("optimizers"):
                why = (f"the command ended (exit status {observation.get('returncode')}) without a torch.optim "
                       f"optimizer ({observation.get('backward_calls') or 0} backward call(s) seen): a hand-written "
                       "update or torch.func transforms are not observed yet" + (f"; last output: {last}" if last else ""))
            if not why:
                code_text = observation.get("returncode")
                why = (f"the command ended (exit status {code_text if code_text is not None else '?'}) after "
                       f"{steps_done} optimizer step(s), before the {spec['steps']} observed"
                       + (f": {last}" if last else ""))
            return _failed(outcome, str(why))
        observation["configured"] = configured
        outcome.verdicts, notes = judge(observation, expectations or Expectations())
        outcome.notes.extend(notes)
        outcome.info = {"observed": True, "command": shown, "steps": observation.get("steps")}
        outcome.seconds = {"total": float(observation.get("seconds") or 0.0)}
    finally:
        left = box.remove()
        if left is not None:
            outcome.notes.append(left)
        outcome.wall_s = round(time.perf_counter() - started, 3)
    return outcome


def _read_observation(path: Path, limit: int) -> dict[str, Any] | str:
    """The answer as a JSON object, or one phrase on why not (the child controls this file)."""
    try:
        data, _info = _read_regular(path, limit)
    except OSError as exc:
        return f"its answer cannot be read: {exc.strerror or exc}"
    if data is None:
        return f"its answer is not a regular file under {limit // 2**20} MiB"
    if not data.strip():
        return "it wrote no answer"
    try:
        value = json.loads(data, parse_constant=lambda name: name)
    except (ValueError, RecursionError):
        return "its answer is not JSON"
    if not isinstance(value, dict):
        return "its answer is not a JSON object"
    try:
        return _clean(value)
    except RecursionError:
        return "its answer is nested too deeply"


def _clean(value: Any) -> Any:
    """Every string of the observation made safe to print (no escapes, no line breaks, bounded): the observation
    comes from the user's process, and its text ends up in verdicts and reports."""
    if isinstance(value, str):
        return safe_text(value, limit=2000)
    if isinstance(value, list):
        return [_clean(item) for item in value]
    if isinstance(value, dict):
        return {safe_text(str(key), limit=200): _clean(item) for key, item in value.items()}
    return value


def observe_findings(findings: list[Any], *, trace: Any, playbook: Any, command: list[str], code: Path,
                     python: str | None, timeout_s: float, announce: Callable[[str], None] | None = None,
                     steps: int = DEFAULT_STEPS, config: dict[str, Any] | None = None) -> tuple[list[Any], ProbeOutcome]:
    """Observe the command and merge the verdicts into the findings, as the probes' are (probe evidence first)."""
    from sleuth.probes.agent import expectations_from_playbook
    from sleuth.probes.merge import apply_probes

    with trace.step("observe-command", command=shlex.join(command), code=code, python=python) as step:
        outcome = observe_command(command, code, python=python, expectations=expectations_from_playbook(playbook),
                                  timeout_s=timeout_s, steps=steps, announce=announce, config=config)
        decided = sum(1 for v in outcome.verdicts if v.status in ("match", "mismatch"))
        step.inputs.update(code_sha256=outcome.code_sha256,
                           isolation=outcome.isolation.to_json() if outcome.isolation else None)
        step.outcome = (f"{outcome.subject}: nothing observed: {outcome.error}" if outcome.error else
                        f"{outcome.subject}: {len(outcome.verdicts)} verdicts, {decided} decided; process "
                        f"{outcome.wall_s:.2f} s")
    for note in outcome.notes:
        with trace.step("observed", note=note) as step:
            step.outcome = note
    merged, changed = apply_probes(findings, outcome, trace)
    with trace.step("apply-probes", changed=changed) as step:
        step.outcome = (f"the observed step decided {', '.join(changed)} against the static reading" if changed
                        else "no status changed")
    return merged, outcome
