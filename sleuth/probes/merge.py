"""Probe verdicts onto the engine's findings: `probe` evidence first, and the probe decides.

Rules:
  * a probe `match` or `mismatch` sets the finding's status; where the static reading said otherwise, the
    finding says so in a note ("probe decided: ...") and its observed value is the measured one;
  * a probe that agrees adds its evidence and raises the confidence;
  * a probe `unknown` adds its reason as evidence (no note) and leaves the status to the static reading;
  * `not_applicable` (e.g. layer ids of a subject that receives pre-selected features) adds nothing.
Every verdict is also a trace step: hypothesis, what was perturbed, the number measured, the verdict.
"""

from __future__ import annotations

from sleuth.findings import Evidence, Finding, Fix
from sleuth.probes.runner import ProbeOutcome
from sleuth.probes.verdict import Verdict
from sleuth.trace import Trace

PROBE_CONFIDENCE = 0.95


def probe_evidence(verdict: Verdict) -> Evidence:
    """The verdict and the number measured in `value` (reports show it whole); the set-up in `snippet`."""
    if verdict.status == "unknown":
        value = f"unknown: {verdict.reason}"
    else:
        value = f"{verdict.status}: {verdict.observed}" if verdict.observed else verdict.status
    if verdict.measurement:
        value += f"; measured {verdict.measurement}"
    parts = [f"hypothesis: {verdict.hypothesis}" if verdict.hypothesis else "",
             f"perturbed: {verdict.perturbed}" if verdict.perturbed else "",
             f"threshold: {verdict.threshold}" if verdict.threshold else ""]
    return Evidence(kind="probe", location=f"probe:{verdict.experiment}", value=value,
                    snippet="; ".join(p for p in parts if p) or None)


def apply_probes(findings: list[Finding], outcome: ProbeOutcome, trace: Trace) -> tuple[list[Finding], list[str]]:
    """Findings with the probe's evidence merged in; also the ids whose status the probe changed."""
    by_id = {f.id: f for f in findings}
    changed: list[str] = []
    for verdict in outcome.verdicts:
        with trace.step("probe", invariant=verdict.invariant, experiment=verdict.experiment,
                        hypothesis=verdict.hypothesis, perturbed=verdict.perturbed, threshold=verdict.threshold,
                        seconds=verdict.seconds) as step:
            step.outcome = f"{verdict.invariant}: {verdict.status}" + (
                f" ({verdict.reason})" if verdict.status in ("unknown", "not_applicable") else
                f", {verdict.observed}") + (f"; measured {verdict.measurement}" if verdict.measurement else "")
        finding = by_id.get(verdict.invariant)
        if finding is None or verdict.status == "not_applicable":
            continue
        updated = merge_one(finding, verdict)
        if updated.status != finding.status:
            changed.append(finding.id)
        by_id[finding.id] = updated
    merged = [by_id[f.id] for f in findings]
    return merged, changed


def merge_one(finding: Finding, verdict: Verdict) -> Finding:
    evidence = [probe_evidence(verdict), *finding.evidence]  # ranked above the static readings
    notes = list(finding.notes)
    update: dict[str, object] = {"evidence": evidence}
    if verdict.status == "unknown":
        pass  # the evidence carries the reason; the static reading keeps the status
    elif verdict.status == finding.status:
        notes.append(f"probe {verdict.experiment} agrees: {verdict.observed or verdict.status}")
        update["confidence"] = max(finding.confidence, PROBE_CONFIDENCE)
    else:
        static = ("agreement, not claimed" if finding.static_agreement else finding.status) + (
            f" ({finding.observed})" if finding.observed else "")
        notes.append(f"probe decided: the static reading said {static}; the experiment measured "
                     f"{verdict.observed or verdict.status}")
        update.update(status=verdict.status, observed=verdict.observed or finding.observed, static_agreement=False,
                      confidence=PROBE_CONFIDENCE,
                      reason=f"probe {verdict.experiment}: {verdict.measurement}" if verdict.measurement else None)
        if verdict.expected and not finding.expected:
            update["expected"] = verdict.expected
        if verdict.status == "mismatch" and (finding.fix is None or not (finding.fix.config_patch or finding.fix.code_hint)):
            update["fix"] = Fix(code_hint=verdict.fix or None, applicability="unsafe")
    update["notes"] = notes
    return finding.model_copy(update=update)
