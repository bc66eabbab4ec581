"""report.md: the report a person reads: summary, chart, ranked findings with evidence and fix, the trace.

Every value that came from the run or from code (names, paths, keys, config values, reasons, notes, probe
text) is written through sleuth.escape: `md` for inline text, `code` for a code span, so none can open a
heading, a link, an image, an HTML tag or a table cell, or break the line it is on. Only sleuth's own
template text is markdown.
"""

from __future__ import annotations

from sleuth.escape import markdown as md
from sleuth.escape import markdown_code as code
from sleuth.findings import Evidence, Finding
from sleuth.regression import Regression, fmt
from sleuth.report.model import Report

STATUS_MARK = {"mismatch": "✗ mismatch", "unknown": "? unknown", "match": "✓ match"}


def render_markdown(report: Report) -> str:
    out: list[str] = [f"# sleuth diagnosis: {md(report.subject)}", ""]
    counts = report.counts
    out.append(
        f"**{counts.get('mismatch', 0)} mismatch(es), {counts.get('unknown', 0)} unknown, "
        f"{counts.get('match', 0)} match** (exit {report.exit_status}). Generated {md(report.generated_at)} "
        f"by sleuth {md(report.tool_version)}, report schema v{report.schema_version}."
    )
    if report.inputs.variant:
        out += ["", f"Drafter variant: {md(report.inputs.variant)}."]
    out += ["", "## Summary", "", md(report.summary) if report.summary else "(nothing to summarise)", ""]
    if report.chart:
        out += [f"![Metric trajectories of {md(report.subject)} and its baseline]({report.chart})", ""]
    if report.regression is not None:
        out += _regression(report.regression)
    out += ["## Findings, ranked by expected impact", ""]
    if not report.findings:
        out += ["No invariant was checked.", ""]
    for rank, finding in enumerate(report.findings, start=1):
        out += _finding(rank, finding)
    out += _probes(report)
    out += _reference(report)
    out += _inputs(report)
    out += ["## Trace", "", "| # | step | outcome | duration |", "|---|---|---|---|"]
    for number, step in enumerate(report.trace, start=1):
        out.append(f"| {number} | {md(step.step)} | {md(step.outcome)} | {step.duration_s:.3f} s |")
    out += ["", "The full trace, with each step's inputs, is `trace.jsonl` beside this report.", ""]
    return "\n".join(out)


def _regression(regression: Regression) -> list[str]:
    out = ["## Regression", ""]
    if regression.baseline is None:
        out += [f"Not compared: {md(regression.reason)}", ""]
    else:
        source = "named with --baseline" if regression.baseline_source == "explicit" else "best comparable earlier run"
        out += [f"Baseline: **{md(regression.baseline)}** ({source}). Verdict: **{md(regression.verdict)}**.", ""]
        out += [
            "| metric | step | run | baseline | gap | threshold | verdict "
            "| baseline reached run's final at | run needed | ratio |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in regression.metrics:
            if c.verdict == "unknown":
                out.append(f"| {md(c.metric)} | | | | | | unknown: {md(c.reason or '')} | | | |")
                continue
            for i, gap in enumerate(c.gaps):
                last = i == len(c.gaps) - 1
                out.append(
                    f"| {md(c.metric)} | {gap.step} | {fmt(gap.run)} | {fmt(gap.baseline)} | {fmt(gap.gap)} | "
                    + (
                        f"{fmt(c.threshold)} | {md(c.verdict)} | {c.baseline_reached_step or 'never'} | "
                        f"{c.run_reached_step} | {f'{c.speedup:.1f}x' if c.speedup else ''} |"
                        if last
                        else " | | | | |"
                    )
                )
        out += [
            "",
            "Values are smoothed (rolling median) and interpolated to common steps; a positive gap means the "
            "run is worse. The verdict compares the median gap over the last third of the common range with "
            "the noise threshold.",
            "",
        ]
    others = [c for c in regression.candidates if not c.chosen]
    if others:
        out += ["Other runs considered:", ""]
        for candidate in others:
            what = f"comparable, lead {fmt(candidate.score)}" if candidate.score is not None else "not used"
            out.append(f"- {md(candidate.name)}: {what}" + (f" ({md(candidate.reason)})" if candidate.reason else ""))
        out.append("")
    return out


def _finding(rank: int, finding: Finding) -> list[str]:
    out = [
        f"### {rank}. {STATUS_MARK.get(finding.status, md(finding.status))}"
        f"{' (static agreement, not claimed)' if finding.static_agreement else ''}: {md(finding.title)}",
        "",
        f"{code(finding.id)}, severity **{md(finding.severity)}**, confidence {finding.confidence:.2f}",
        "",
    ]
    if finding.expected is not None:
        out.append(f"- **Expected:** {md(finding.expected)}")
    if finding.observed is not None:
        out.append(f"- **Observed:** {md(finding.observed)}")
    if finding.reason:
        out.append(f"- **Why {md(finding.status)}:** {md(finding.reason)}")
    if finding.evidence:
        out.append("- **Evidence:**")
        out += [f"  - {_evidence(e)}" for e in finding.evidence]
    if finding.fix is not None and (finding.fix.config_patch or finding.fix.code_hint):
        parts = []
        if finding.fix.config_patch:
            keys = ", ".join(code(f"{k}: {_yaml_value(v)}") for k, v in finding.fix.config_patch.items())
            parts.append(f"set {keys} (in fix.yaml)")
        if finding.fix.code_hint:
            parts.append(f"code: {md(finding.fix.code_hint)}")
        out.append(f"- **Fix ({md(finding.fix.applicability)}):** " + "; ".join(parts))
    for note in finding.notes:
        out.append(f"- Note: {md(note)}")
    out.append("")
    return out


def _evidence(evidence: Evidence) -> str:
    text = f"{md(evidence.kind)} {code(evidence.location)}"
    if evidence.commit and evidence.commit[:7] not in evidence.location:
        text += f" @ {md(evidence.commit[:12])}"
    if evidence.value is not None:
        text += f": {md(evidence.value)}"
    if evidence.snippet:
        text += f" ({code(' '.join(evidence.snippet.split())[:160])})"
    return text


def _probes(report: Report) -> list[str]:
    probes = report.probes
    if probes is None:
        return []
    out = ["## Probes", ""]
    if probes.consent == "off":
        return out + [f"Not probed: {md(probes.reason or 'probing off')}.", ""]
    why = {"asked": "run at your request", "trusted": "run because your own trainer recorded this code",
           "declined": "not run"}[probes.consent]
    out.append(f"**{md(probes.subject)}**: {why}" + (f"; no experiment ran: {md(probes.reason)}" if not probes.ran and
                                                  probes.consent != "declined" else "") + ".")
    out.append("")
    if probes.consent == "declined":
        out += [f"- {md(probes.reason)}"]
    if probes.code_sha256:
        out.append(f"- code: {probes.code_files} file(s), tree {code('sha256:' + probes.code_sha256)}"
                   + (f" ({md(probes.trust)})" if probes.trust and probes.consent != "declined" else ""))
    if probes.python:
        out.append(f"- interpreter: {code(probes.python)}")
    if probes.isolation:
        iso = probes.isolation
        out.append(f"- isolation: **{md(iso.get('level'))}**: network {md(iso.get('network'))}; file system "
                   f"{md(iso.get('filesystem'))}; processes {md(iso.get('processes'))}; "
                   f"privileges {md(iso.get('privileges'))}")
    out += [f"- {md(note)}" for note in probes.notes]
    if probes.honesty:
        out += ["", md(probes.honesty)]
    return out + [""]


def _reference(report: Report) -> list[str]:
    ref = report.reference
    if ref is None:
        return []
    out = ["## Reference", ""]
    commit = f" at commit {code(ref.commit[:12])}" if ref.commit else ""
    out += [f"**{md(ref.name)}**, answered by the **{md(ref.tier or 'no')}** tier{commit}.", ""]
    if ref.attempts:
        out += ["| tier | tried | outcome | reason |", "|---|---|---|---|"]
        for attempt in ref.attempts:
            out.append(
                f"| {md(attempt.get('tier', ''))} | {md(attempt.get('tried', ''))} | "
                f"{md(attempt.get('outcome', ''))} | {md(attempt.get('reason', ''))} |"
            )
        out.append("")
    out += [f"- {md(note)}" for note in ref.notes]
    return out + ([""] if ref.notes else [])


def _inputs(report: Report) -> list[str]:
    out = ["## Inputs", ""]
    for label, value in (
        ("config", report.inputs.config),
        ("checkpoint", report.inputs.checkpoint),
        ("code", report.inputs.code),
        ("playbook", report.inputs.playbook),
        ("variant", report.inputs.variant),
    ):
        out.append(f"- {label}: {code(value) if value else 'none'}")
    if report.run is not None and report.run.problems:
        out += ["", "Problems reading the run directory:", ""]
        out += [f"- {md(problem)}" for problem in report.run.problems]
    return out + [""]


def _yaml_value(value: object) -> str:
    import json

    return "null" if value is None else json.dumps(value) if not isinstance(value, str) else value
