"""Report building: the Report model from an investigation's findings and state, and the files it writes.

Exit status: 2 when the user asked for probes (--probe, --probe-entry) and no experiment ran; 1 when any
invariant mismatches, when an input the checks need could not be read (the run's own config, a foreign run's
settings record, a field of the wrong type: those checks are unknown, which is not a clean bill), or when the
run's own trusted code/ should have been probed and was not; 0 otherwise.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sleuth.findings import Finding
from sleuth.investigation.request import DEFAULT_REFERENCE, DiagnoseError
from sleuth.regression import Regression
from sleuth.runs import RunInfo

if TYPE_CHECKING:
    from sleuth.report.model import ProbeSummary, Report, Rule

DEFAULT_OUT_WITHOUT_RUN = Path("diagnosis")


def write_diagnosis(inv: Any, findings: list[Finding]) -> tuple[Report, Path, dict[str, Path]]:
    """Build the Report from an investigation's state and write report.md/json/sarif, fix.yaml, chart.png,
    trace.jsonl into its report directory; (report, out_dir, files)."""
    from sleuth import __version__
    from sleuth.artifacts import prepare_dir, shown
    from sleuth.report import count_findings, printable_report, write_report
    from sleuth.report.chart import write_chart
    from sleuth.report.model import Inputs, Report

    out_dir = out_dir_of(inv)
    try:
        # <run>/diagnosis inside a run from elsewhere may be a planted link: only a directory the user named
        # with --out may be one.
        prepare_dir(out_dir, allow_link=inv.request.out is not None)
    except OSError as exc:
        raise DiagnoseError(f"cannot write the report to {shown(out_dir)}: {exc.strerror or exc}") from None
    counts = count_findings(findings)
    probes = probe_summary(inv)
    chart_name: str | None = None
    if inv.run_info is not None and inv.run_info.metrics:
        with inv.trace.step("draw-chart", out=out_dir / "chart.png") as step:
            try:
                outcome = write_chart(out_dir / "chart.png", chart_series(inv), main_label=inv.run_info.name)
            except OSError as exc:
                raise DiagnoseError(f"cannot write the chart to {shown(out_dir)}: {exc.strerror or exc}") from None
            step.outcome = {
                "drawn": "drawn",
                "cached": "metrics unchanged: kept the existing chart",
                "empty": "no acc/streak/tau/loss to plot",
            }[outcome]
            chart_name = "chart.png" if outcome != "empty" else None
    problems = input_problems(inv, findings)
    if probes is not None and not probes.ran and probes.consent == "trusted":
        problems.append(f"the probes of the run's own code did not run: {probes.reason}")
    report = Report(
        tool_version=__version__,
        generated_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        run=_run_summary(inv.run_info) if inv.run_info is not None else None,
        inputs=Inputs(
            config=inv.config_source,
            checkpoint=str(inv.checkpoint) if inv.checkpoint else None,
            code=str(inv.code) if inv.code else None,
            playbook=_playbook_name(inv.playbook, inv.request.playbook),
            variant=getattr(inv, "variant", None),
        ),
        reference=_reference_summary(inv.resolution),
        regression=inv.regression,
        findings=findings,
        rules=_rules_in_scope(inv),
        counts=counts,
        summary=build_summary(inv.regression, findings, inv.run_info, inv.config_problem, problems, probes),
        input_problems=problems,
        chart=chart_name,
        trace=list(inv.trace.steps),
        probes=probes,
        # A run whose inputs cannot be read, or whose own code should have been probed and was not, is not
        # clean, whatever the other checks say; probes asked for that did not run are an error.
        exit_status=2 if probes is not None and probes.consent == "asked" and not probes.ran
        else 1 if counts.get("mismatch") or problems else 0,
    )
    report = printable_report(report)  # a non-UTF-8 file name in any string: spelled out, never a crash
    with inv.trace.step("write-report", out=out_dir) as step:
        try:
            files = write_report(report, out_dir)
            files["chart.png"] = out_dir / "chart.png"
            files["trace.jsonl"] = out_dir / "trace.jsonl"
        except OSError as exc:
            raise DiagnoseError(f"cannot write the report to {shown(out_dir)}: {exc.strerror or exc}") from None
        step.outcome = ", ".join(name for name, path in files.items() if name != "chart.png" or chart_name)
    if chart_name is None:
        files.pop("chart.png")
    try:
        inv.trace.write_jsonl(files["trace.jsonl"])
    except OSError as exc:
        raise DiagnoseError(f"cannot write the trace to {shown(out_dir)}: {exc.strerror or exc}") from None
    return report, out_dir, files


def _rules_in_scope(inv: Any) -> list[Rule]:
    """The playbook's rules less those for another DFlash-family variant than the one diagnosed (their checks
    did not run)."""
    kind = getattr(inv, "variant_kind", None)
    if kind is None:
        return inv.rules
    other = {i.id for i in getattr(inv.playbook, "invariants", None) or []
             if getattr(i, "variants", None) and kind not in i.variants}
    return [rule for rule in inv.rules if rule.id not in other]


def input_problems(inv: Any, findings: list[Finding]) -> list[str]:
    """Every input the checks needed but could not read, one line each: the run's config, what the run's
    reader flagged (a foreign run's settings record, a field of the wrong type), a config value of the wrong
    type for a rule. Any of them makes the exit status 1."""
    problems: list[str] = []
    if inv.config_problem:
        problems.append(f"{inv.config_problem}: the checks the config decides are unknown")
    if inv.run_info is not None:
        problems += inv.run_info.input_problems
    for finding in findings:
        if finding.input_problem:
            problems.append(f"{finding.input_problem}: {finding.id} is unknown")
    return list(dict.fromkeys(problems))


def out_dir_of(inv: Any) -> Path:
    """--out, else <run>/diagnosis, else ./diagnosis."""
    if inv.request.out is not None:
        return inv.request.out
    if inv.run_info is not None:
        return inv.run_info.path / "diagnosis"
    return DEFAULT_OUT_WITHOUT_RUN


def chart_series(inv: Any) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """The diagnosed run and up to three baselines, per chart metric."""
    from sleuth.report.chart import CHART_METRICS

    assert inv.run_info is not None
    runs = [inv.run_info, *inv.baseline_infos[:3]]
    return {info.name: {m: info.series(m) for m in CHART_METRICS if info.series(m)[0]} for info in runs}


def rules_from_playbook(playbook: Any) -> list[Rule]:
    """The playbook's invariants as report rules (id, title, what/why/example, severity, rank)."""
    from sleuth.report.model import Rule

    rules = []
    for position, invariant in enumerate(getattr(playbook, "invariants", None) or [], start=1):
        identifier = getattr(invariant, "id", None)
        if not identifier:
            continue
        why = getattr(invariant, "why", None)
        if isinstance(why, str):  # a plain sentence rather than what/why/example
            what_text, why_text, example = "", why, ""
        else:
            what_text, why_text, example = (str(getattr(why, key, "") or "") for key in ("what", "why", "example"))
        severity = getattr(invariant, "severity", None)
        rank = getattr(invariant, "rank", None)
        rules.append(
            Rule(
                id=str(identifier),
                title=str(getattr(invariant, "title", None) or identifier),
                what=" ".join(what_text.split()),
                why=" ".join(why_text.split()),
                example=" ".join(example.split()),
                severity=severity if severity in ("critical", "high", "medium", "low", "info") else "medium",
                rank=rank if isinstance(rank, int) else position,
            )
        )
    return rules


def build_summary(
    regression: Regression | None, findings: list[Finding], run: RunInfo | None, config_problem: str | None = None,
    problems: list[str] | None = None, probes: ProbeSummary | None = None,
) -> str:
    """One paragraph: the regression verdict with numbers, then the mismatches and what stayed unknown."""
    parts: list[str] = []
    others = [p for p in (problems or []) if config_problem is None or not p.startswith(config_problem)]
    if probes is not None and not probes.ran and probes.consent == "asked":
        parts.append(f"No experiment ran: {probes.reason} (exit 2).")
    elif probes is not None and not probes.ran and probes.consent == "trusted":
        parts.append(f"Not a clean bill: the probes of the run's own code did not run: {probes.reason} (exit 1).")
        others = [p for p in others if not p.startswith("the probes of the run's own code")]
    if config_problem is not None:
        parts.append(f"Not a clean bill: {config_problem}, so the checks the config decides are unknown (exit 1).")
    elif others:
        more = f" (and {len(others) - 1} more)" if len(others) > 1 else ""
        parts.append(f"Not a clean bill: {others[0]}{more} (exit 1).")
    if regression is not None:
        parts.append(regression.summary.rstrip(".") + "." if regression.summary else "")
    mismatches = [f for f in findings if f.status == "mismatch"]
    unknown = [f for f in findings if f.status == "unknown"]
    if mismatches:
        named = "; ".join(
            f"{f.title} ({f.id}, {f.severity}" + (f": {f.observed}" if f.observed else "") + ")" for f in mismatches
        )
        parts.append(f"{len(mismatches)} mismatch(es) with the reference: {named}.")
    elif findings and config_problem is None and not others:
        parts.append("No mismatch with the reference.")
    if unknown:
        parts.append(f"{len(unknown)} check(s) stayed unknown: " + ", ".join(f.id for f in unknown) + ".")
    if run is not None and run.problems:
        parts.append("Reading the run: " + "; ".join(run.problems) + ".")
    return " ".join(p for p in parts if p)


def probe_summary(inv: Any) -> ProbeSummary | None:
    """What the report says about the probes: consent, whether anything ran, isolation, and its worth."""
    from sleuth.report.model import ProbeSummary

    outcome = getattr(inv, "probe_outcome", None)
    if outcome is None:
        policy = getattr(inv, "probe_policy", None)
        return ProbeSummary(subject="none", ran=False, consent="off", reason=policy) if policy else None
    consent = ("declined" if outcome.declined else "asked" if outcome.asked else "trusted" if outcome.trusted
               else "off")  # a run with nothing to run (no code/, or recorded before the entry point)
    if outcome.trusted:
        honesty = ("Probe verdicts come from running the run's own code, which your trainer recorded: they are as "
                   "honest as that code.")
    else:
        honesty = ("Probe verdicts are only as honest as the code that produced them: this code is not one your own "
                   "trainer recorded, and a hostile copy can report anything, so its verdicts never overturn what the "
                   "run's config and checkpoint say.")
    from sleuth.probes.answer import safe_text

    def text(value: str | None) -> str | None:  # names and paths from the run directory: no escapes
        return safe_text(value) if value is not None else None

    return ProbeSummary(
        subject=text(outcome.subject) or "", ran=outcome.ran, consent=consent,
        reason=text(outcome.declined or outcome.error), python=text(outcome.python), code_sha256=outcome.code_sha256,
        code_files=outcome.code_files, trust=text(outcome.trust),
        isolation=outcome.isolation.to_json() if outcome.isolation else None,
        notes=[safe_text(note) for note in outcome.notes], honesty=honesty if outcome.ran else "",
    )


def _playbook_name(playbook: Any, requested: str) -> str:
    name = getattr(playbook, "name", None) or requested
    version = getattr(playbook, "version", None)
    return f"{name} v{version}" if version is not None else str(name)


def _reference_summary(resolution: Any) -> Any:
    from sleuth.report.model import ReferenceSummary

    if resolution is None:
        return None
    attempts = [
        a.model_dump(mode="json") if hasattr(a, "model_dump") else dict(a) for a in getattr(resolution, "trace", [])
    ]
    return ReferenceSummary(
        name=getattr(resolution, "reference", DEFAULT_REFERENCE),
        tier=getattr(resolution, "tier", None),
        commit=getattr(resolution, "commit", None),
        files=[f.path for f in getattr(resolution, "files", [])],
        docs=[d.path for d in getattr(resolution, "docs", [])],
        attempts=attempts,
        notes=list(getattr(resolution, "notes", [])),
    )


def _run_summary(info: RunInfo) -> Any:
    from sleuth.report.model import RunSummary

    run_json = info.run_json or {}
    return RunSummary(
        name=info.name,
        path=str(info.path),
        preset=run_json.get("preset") if isinstance(run_json.get("preset"), str) else None,
        status=info.status,
        steps_done=info.steps_done,
        created=run_json.get("created") if isinstance(run_json.get("created"), str) else None,
        target_fingerprint=info.target_fingerprint,
        data_fingerprint=info.data_fingerprint,
        block_size=info.block_size,
        metrics_rows=len(info.metrics),
        checkpoint=str(info.checkpoint) if info.checkpoint else None,
        checkpoint_step=info.checkpoint_step,
        config_sha256=info.config_sha256,
        problems=list(info.problems),
    )
