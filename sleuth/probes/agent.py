"""When `sleuth diagnose` probes, and the two steps it adds to the investigation.

Policy:
  * `--run`: probed by default when the run's `code/` copy has the trainer's entry point (`--no-probe`
    turns it off); a run recorded before the entry point existed gets `unknown` probe verdicts saying so;
  * `--code PATH`: probed only with `--probe` (running code the user pointed at is their decision);
    speculators and SpecForge sources are recognised by their layout, anything else needs `--probe-entry`;
  * `--probe-entry module:function`: the user's own protocol object, probed (it is an explicit request);
  * fetched reference code is never run: probes only ever touch the code under diagnosis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sleuth.findings import Finding
from sleuth.probes.merge import apply_probes
from sleuth.probes.runner import (
    DEFAULT_TIMEOUT_S,
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
        return plan_for_run(run_dir, run_code, run_name or run_dir.name), "the run's code/ (default for --run)"
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
) -> list[Finding]:
    """Run the probes the policy allows and merge their verdicts into the findings."""
    plan, why = choose_plan(probe=probe, entry=entry, run_dir=run_dir, run_name=run_name, run_code=run_code,
                            code=code, config=config, config_path=config_path)
    if plan is None:
        with trace.step("run-probes", policy=why) as step:
            step.outcome = f"not probed: {why}"
        return findings
    with trace.step("run-probes", subject=plan.subject, policy=why, python=python) as step:
        outcome = run_plan(plan, python=python, expectations=expectations_from_playbook(playbook), timeout_s=timeout_s)
        decided = sum(1 for v in outcome.verdicts if v.status in ("match", "mismatch"))
        if outcome.error:
            step.outcome = f"{plan.subject}: no experiment ran: {outcome.error}"
        else:
            setup = outcome.seconds.get("setup", 0.0)
            experiments = outcome.seconds.get("total", outcome.wall_s) - setup
            step.outcome = (f"{plan.subject}: {len(outcome.verdicts)} verdicts, {decided} decided; experiments "
                            f"{experiments:.2f} s, imports and set-up {setup:.2f} s, process {outcome.wall_s:.2f} s")
    merged, changed = apply_probes(findings, outcome, trace)
    with trace.step("apply-probes", changed=changed) as step:
        step.outcome = (f"the probe decided {', '.join(changed)} against the static reading" if changed
                        else "no status changed")
    return merged
