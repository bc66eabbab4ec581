"""Probe verdicts onto the engine's findings: `probe` evidence first, and what the probe may decide.

A probe measures what the code does; the run's config and checkpoint say what the run asked for and what
it trained. The probe decides over static readings of code, never over those run facts:
  * a finding decided by the run's config or checkpoint (its first observed evidence is `config` or
    `checkpoint`) keeps its status when the probe agrees or measures a match: a probe `match` never turns
    a config `mismatch` into `match` (the code doing what a wrong config asks is still a wrong run);
  * where such a finding is a `match` and the probe measures a `mismatch`, the finding becomes a
    `conflict` mismatch naming both: what the config says and what the code was measured doing;
  * a verdict whose value came from the run's config (`config_bound`: "the loss applies the configured
    gamma 7") confirms that the code follows the config; it never makes the value right, so it leaves
    any finding that is not already a config `match` as it is, with its evidence and a note;
  * otherwise (static code readings, or nothing): a probe `match` or `mismatch` sets the finding's status;
    where the static reading said otherwise, the note says so ("probe decided: ...") and the observed
    value is the measured one;
  * a probe `unknown` adds its reason as evidence and changes nothing; `not_applicable` adds nothing.
Every verdict is also a trace step: hypothesis, what was perturbed, the number measured, the verdict.
"""

from __future__ import annotations

from sleuth.findings import Evidence, Finding, Fix
from sleuth.probes.runner import ProbeOutcome
from sleuth.probes.verdict import Verdict
from sleuth.trace import Trace

PROBE_CONFIDENCE = 0.95
# A conflict between the run's facts and a measurement is reported with less confidence than either alone.
CONFLICT_FACTOR = 0.8
RUN_FACTS = ("config", "checkpoint")
_EXPECTED_KINDS = ("reference", "docs", "pinned")


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
             f"threshold: {verdict.threshold}" if verdict.threshold else "",
             f"exercised: {_coverage_text(verdict)}" if verdict.coverage else ""]
    return Evidence(kind="probe", location=f"probe:{verdict.experiment}", value=value,
                    snippet="; ".join(p for p in parts if p) or None)


def _coverage_text(verdict: Verdict) -> str:
    shown = {k: v for k, v in verdict.coverage.items() if k != "config_values"}
    text = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in shown.items())
    values = verdict.coverage.get("config_values") or {}
    if values:
        text += "; config values used: " + ", ".join(
            f"{k} {v.get('value')!r} ({v.get('source')})" for k, v in values.items() if isinstance(v, dict))
    return text


def decided_by(finding: Finding) -> str | None:
    """The kind of evidence a decided finding's status rests on: its first observed (not expected) evidence."""
    if finding.status == "unknown":
        return None
    return next((e.kind for e in finding.evidence if e.kind not in _EXPECTED_KINDS), None)


def apply_probes(findings: list[Finding], outcome: ProbeOutcome, trace: Trace) -> tuple[list[Finding], list[str]]:
    """Findings with the probe's evidence merged in; also the ids whose status the probe changed."""
    by_id = {f.id: f for f in findings}
    changed: list[str] = []
    for verdict in outcome.verdicts:
        with trace.step("probe", invariant=verdict.invariant, experiment=verdict.experiment,
                        hypothesis=verdict.hypothesis, perturbed=verdict.perturbed, threshold=verdict.threshold,
                        seconds=verdict.seconds, not_exercised=verdict.not_exercised) as step:
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
    update: dict[str, object] = {"evidence": evidence, "notes": notes}
    measured = verdict.observed or verdict.status
    fact = decided_by(finding)
    has_config = any(e.kind == "config" for e in finding.evidence)
    if verdict.status == "unknown":
        pass  # the evidence carries the reason; the finding keeps its status
    elif fact in RUN_FACTS and verdict.status == finding.status:
        notes.append(f"probe {verdict.experiment} agrees: {measured}")
        update["confidence"] = max(finding.confidence, PROBE_CONFIDENCE)
    elif fact in RUN_FACTS and finding.status == "mismatch":
        # The code may well do what it is told; the run was told (or trained) something the rule rejects.
        notes.append(f"probe {verdict.experiment} measured {measured}; the run's {fact} decides this finding "
                     f"({finding.observed}), and a measurement of the code cannot make it right")
    elif fact in RUN_FACTS:  # the run's facts say match, the code was measured doing otherwise
        notes.append(f"conflict: the run's {fact} says {finding.observed!r}, the probe {verdict.experiment} "
                     f"measured {measured}")
        update.update(status="mismatch", static_agreement=False,
                      observed=f"{fact}: {finding.observed}; measured: {measured}",
                      confidence=round(PROBE_CONFIDENCE * CONFLICT_FACTOR, 2),
                      reason=f"conflict between the run's {fact} and probe {verdict.experiment}"
                      + (f": {verdict.measurement}" if verdict.measurement else ""))
        if verdict.expected and not finding.expected:
            update["expected"] = verdict.expected
        update["fix"] = _probe_fix(finding, verdict)
    elif verdict.config_bound and verdict.status == "match":
        # "the code applies the configured value": the value's correctness is not the probe's to claim
        why = "the run's config value is not judged yet" if has_config else "no config reading judged the value"
        notes.append(f"probe {verdict.experiment}: {measured} (the code follows the run's config; {why}, so this "
                     "is not claimed)")
        if finding.status == "mismatch" and fact == "code":
            update.update(status="unknown", static_agreement=False, confidence=0.0,
                          reason=f"probe {verdict.experiment} measured the code applying the run's configured value, "
                          "against the static reading; whether that value is right is the config's to say")
        elif finding.status == "unknown":
            # The static reason ("run with --probe to measure it") is stale once the probe has run: say what it
            # measured and why that is still not a claim.
            update["reason"] = (f"probe {verdict.experiment} measured the code applying the run's configured value; "
                                f"{why}, so the value itself is not claimed")
    elif verdict.status == "mismatch" and has_config and finding.status == "unknown":
        notes.append(f"conflict: the run's config is undecided here; the probe {verdict.experiment} measured {measured}")
        update.update(status="mismatch", observed=measured, static_agreement=False, confidence=PROBE_CONFIDENCE,
                      reason=f"probe {verdict.experiment}: {verdict.measurement}" if verdict.measurement else None,
                      fix=_probe_fix(finding, verdict))
        if verdict.expected and not finding.expected:
            update["expected"] = verdict.expected
    elif verdict.status == finding.status:
        notes.append(f"probe {verdict.experiment} agrees: {measured}")
        update["confidence"] = max(finding.confidence, PROBE_CONFIDENCE)
    else:
        static = ("agreement, not claimed" if finding.static_agreement else finding.status) + (
            f" ({finding.observed})" if finding.observed else "")
        notes.append(f"probe decided: the static reading said {static}; the experiment measured {measured}")
        update.update(status=verdict.status, observed=verdict.observed or finding.observed, static_agreement=False,
                      confidence=PROBE_CONFIDENCE,
                      reason=f"probe {verdict.experiment}: {verdict.measurement}" if verdict.measurement else None)
        if verdict.expected and not finding.expected:
            update["expected"] = verdict.expected
        if verdict.status == "mismatch":
            update["fix"] = _probe_fix(finding, verdict)
    return finding.model_copy(update=update)


def _probe_fix(finding: Finding, verdict: Verdict) -> Fix | None:
    if finding.fix is not None and (finding.fix.config_patch or finding.fix.code_hint):
        return finding.fix
    return Fix(code_hint=verdict.fix or None, applicability="unsafe")
