"""When `sleuth diagnose` probes, and the two steps it adds to the investigation.

Policy (consent, like `trust_remote_code`: code runs when the user asked, or when it is the user's own):
  * `--run`: probed by default only when the run's `code/` copy is a tree the user's own `trainer run`
    recorded (trust.py; a copied, downloaded or edited run directory is not), and has the trainer's entry
    point; any other run's code runs only with `--probe`; `--no-probe` turns probing off. A run recorded
    before the entry point existed gets `unknown` probe verdicts saying so;
  * `--code PATH`: probed only with `--probe` (running code the user pointed at is their decision);
    speculators and SpecForge sources are recognised by their layout; any other trainer is probed without an
    adapter: its pieces are located statically and called one by one (sleuth/probes/locate.py) on a copy of
    its tree, isolated like every other subject, each a `located-piece` step in the trace;
  * `--probe-entry module:function`: the user's own protocol object, probed (it is an explicit request);
  * fetched reference code is never run: probes only ever touch the code under diagnosis.
Whatever runs, runs isolated (runner.py, sandbox.py); before it runs, `announce` hears what will run, in
which interpreter and how isolated. Where the user asked and no experiment ran, the diagnosis exits 2;
where the run's own trusted code should have been probed and was not, it is no clean bill (exit 1).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sleuth.findings import Finding
from sleuth.probes.merge import apply_probes
from sleuth.probes.runner import (
    DEFAULT_TIMEOUT_S,
    ProbeOutcome,
    ProbePlan,
    plan_for_code,
    plan_for_entry,
    plan_for_run,
    run_plan,
)
from sleuth.probes.verdict import Expectations
from sleuth.trace import Trace


def choose_plan(*, probe: bool | None, entry: str | None, run_dir: Path | None, run_name: str | None,
                run_code: Path | None, code: Path | None, config: dict[str, Any] | None,
                config_path: Path | None = None) -> tuple[ProbePlan | None, str]:
    """The plan, or None and why nothing is probed."""
    if probe is False:
        return None, "--no-probe"
    if entry is not None:
        return plan_for_entry(entry, code, run_dir, config), "--probe-entry"
    if code is not None:
        if not probe:
            return None, "--code is probed only with --probe (running the code is the user's decision)"
        return plan_for_code(code, config, config_path), "--probe"
    if run_dir is not None:
        plan = plan_for_run(run_dir, run_code, run_name or run_dir.name)
        plan.asked = bool(probe)
        return plan, ("--probe" if probe else "the run's code/ if your own trainer recorded it (default for --run)")
    return None, "nothing to probe"


def expectations_from_playbook(playbook: Any) -> Expectations:
    """Gamma and loss kinds the playbook accepts, read duck-typed (the playbook's schema is its own)."""
    found = Expectations()
    for invariant in getattr(playbook, "invariants", None) or []:
        expected = getattr(invariant, "expected", None)
        if expected is None:
            continue
        identifier = getattr(invariant, "id", None)
        if identifier == "dflash.loss_decay_gamma":
            value = getattr(expected, "value", None)
            found.gamma = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
            found.gamma_by_block_size = {
                int(c.block_size): float(c.value) for c in getattr(expected, "conditional_accept", None) or []
                if isinstance(getattr(c, "value", None), (int, float))
            }
        elif identifier == "dflash.loss_kind":
            kinds = [getattr(expected, "value", None), *(getattr(expected, "accept", None) or [])]
            found.loss_kinds = tuple(k for k in kinds if k in ("ce", "kl")) or found.loss_kinds
    return found


def probe_findings(
    findings: list[Finding],
    *,
    trace: Trace,
    playbook: Any,
    probe: bool | None,
    entry: str | None,
    python: str | None,
    run_dir: Path | None,
    run_name: str | None,
    run_code: Path | None,
    code: Path | None,
    config: dict[str, Any] | None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    config_path: Path | None = None,
    announce: Callable[[str], None] | None = None,
) -> tuple[list[Finding], ProbeOutcome | None, str]:
    """Run the probes the policy allows and merge their verdicts into the findings; also the outcome (None
    when nothing was planned) and the policy that decided."""
    plan, why = choose_plan(probe=probe, entry=entry, run_dir=run_dir, run_name=run_name, run_code=run_code,
                            code=code, config=config, config_path=config_path)
    if plan is None:
        with trace.step("run-probes", policy=why) as step:
            step.outcome = f"not probed: {why}"
        return findings, None, why
    with trace.step("run-probes", subject=plan.subject, policy=why, python=python) as step:
        outcome = run_plan(plan, python=python, expectations=expectations_from_playbook(playbook), timeout_s=timeout_s,
                           announce=announce)
        decided = sum(1 for v in outcome.verdicts if v.status in ("match", "mismatch"))
        step.inputs.update(code_sha256=outcome.code_sha256, trusted=outcome.trusted, trust=outcome.trust,
                           isolation=outcome.isolation.to_json() if outcome.isolation else None)
        isolation = f"; isolation {outcome.isolation.level}" if outcome.isolation else ""
        if outcome.declined:
            step.outcome = f"{plan.subject}: {outcome.declined}"
        elif outcome.error:
            step.outcome = f"{plan.subject}: no experiment ran: {outcome.error}{isolation}"
        else:
            setup = outcome.seconds.get("setup", 0.0)
            experiments = outcome.seconds.get("total", outcome.wall_s) - setup
            step.outcome = (f"{plan.subject}: {len(outcome.verdicts)} verdicts, {decided} decided; experiments "
                            f"{experiments:.2f} s, imports and set-up {setup:.2f} s, process {outcome.wall_s:.2f} s"
                            f"{isolation}")
    for piece in (outcome.info or {}).get("pieces") or []:  # probes without an adapter: where, how, what decided
        with trace.step("located-piece", kind=piece["kind"], where=piece["where"], piece=piece["qualname"],
                        found_by=piece["found_by"], used_by=piece["used_by"]) as step:
            decided = f"; decides {', '.join(i.split('.', 1)[1] for i in piece['decided'])}" if piece.get("decided") else ""
            step.outcome = f"{piece['qualname']} ({piece['where']}): {piece['outcome']}" + (
                f", called with {piece['called']}" if piece.get("called") else "") + (
                f": {piece['detail']}" if piece.get("detail") else "") + decided
    merged, changed = apply_probes(findings, outcome, trace)
    with trace.step("apply-probes", changed=changed) as step:
        step.outcome = (f"the probe decided {', '.join(changed)} against the static reading" if changed
                        else "no status changed")
    return merged, outcome, why
