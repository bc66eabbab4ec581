"""The diagnosis report: one versioned model that every output (text, Markdown, JSON, SARIF, fix.yaml) renders.

`report.json` is this model dumped as JSON. Bump `REPORT_SCHEMA_VERSION` on any change a reader of the
JSON would notice (a field removed, renamed or changing meaning); adding a field keeps the version.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from sleuth.findings import Finding, Severity, TraceStep
from sleuth.regression import Regression

REPORT_SCHEMA_VERSION = 1

SEVERITY_ORDER: dict[str, int] = {"critical": 0, "high": 1, "medium": 2, "low": 3, "info": 4}
STATUS_ORDER: dict[str, int] = {"mismatch": 0, "unknown": 1, "match": 2}


class RunSummary(BaseModel):
    """What was read from the run directory, and what could not be read (`problems`)."""

    name: str
    path: str
    preset: str | None = None
    status: str | None = None
    steps_done: int | None = None
    created: str | None = None
    target_fingerprint: str | None = None
    data_fingerprint: str | None = None
    block_size: int | None = None
    metrics_rows: int = 0
    checkpoint: str | None = None
    checkpoint_step: int | None = None
    config_sha256: str | None = Field(None, description="sha256 of the config.json bytes diagnosed (fix.yaml records it)")
    problems: list[str] = Field(default_factory=list)


class ReferenceSummary(BaseModel):
    """Which reference answered, from which tier and commit, and how the chain got there."""

    name: str
    tier: str | None = Field(None, description="local, git-pull, raw, docs or pinned; None when nothing answered")
    commit: str | None = None
    files: list[str] = Field(default_factory=list)
    docs: list[str] = Field(default_factory=list)
    attempts: list[dict[str, object]] = Field(default_factory=list, description="each tier tried, in order")
    notes: list[str] = Field(default_factory=list)


class Rule(BaseModel):
    """A playbook invariant as the report describes it (SARIF rules are built from these)."""

    id: str
    title: str = ""
    what: str = Field("", description="what the rule requires")
    why: str = Field("", description="why a violation matters")
    example: str = Field("", description="a violation, as code or config")
    severity: Severity = "medium"
    rank: int = Field(0, description="the playbook's rank: expected impact, 1 = largest")


class Inputs(BaseModel):
    """The sources the invariants were checked against."""

    config: str | None = None
    checkpoint: str | None = None
    code: str | None = None
    playbook: str | None = None
    variant: str | None = Field(None, description="the DFlash-family variant diagnosed (dflash, dflash2, dspark, domino, "
                                "jetspec) and where it was read (sleuth/evidence/variant.py)")


class ProbeSummary(BaseModel):
    """Whether code under diagnosis ran, why (consent), how isolated, and what its verdicts are worth."""

    subject: str
    ran: bool = Field(description="experiments ran (each verdict may still be unknown for its own reason)")
    consent: Literal["asked", "trusted", "declined", "off"] = Field(
        description="asked: --probe/--probe-entry; trusted: the user's own trainer recorded this code/; "
                    "declined: not run (a run's code/ not recorded, no --probe); off: probing off or nothing to run")
    reason: str | None = Field(None, description="why no experiment ran, or why sleuth did not run the code")
    python: str | None = None
    code_sha256: str | None = Field(None, description="tree hash of the copy that ran (docs/security.md)")
    code_files: int = 0
    trust: str | None = Field(None, description="what the trust record said about this code")
    isolation: dict[str, object] | None = Field(None, description="the isolation obtained: level, network, ...")
    notes: list[str] = Field(default_factory=list)
    honesty: str = ""


class Report(BaseModel):
    schema_version: int = REPORT_SCHEMA_VERSION
    tool: str = "sleuth"
    tool_version: str = ""
    generated_at: str = Field(description="UTC time, ISO 8601")
    run: RunSummary | None = Field(None, description="None when only --code was diagnosed")
    inputs: Inputs = Field(default_factory=Inputs)
    reference: ReferenceSummary | None = None
    regression: Regression | None = None
    findings: list[Finding] = Field(default_factory=list, description="ranked by expected impact")
    rules: list[Rule] = Field(default_factory=list)
    counts: dict[str, int] = Field(default_factory=dict, description="findings by status")
    summary: str = ""
    chart: str | None = Field(None, description="file name of the regression chart, beside the report")
    trace: list[TraceStep] = Field(default_factory=list)
    input_problems: list[str] = Field(
        default_factory=list, description="inputs the run must have but that could not be read; any makes exit 1"
    )
    probes: ProbeSummary | None = None
    exit_status: Literal[0, 1, 2] = Field(
        0, description="0 clean, 1 mismatches or an input problem, 2 probes asked for but no experiment ran")

    @property
    def subject(self) -> str:
        if self.run is not None:
            return self.run.name
        return self.inputs.code or "input"


def rank_findings(findings: list[Finding], rules: list[Rule]) -> list[Finding]:
    """Order by expected impact: mismatches first, then unknowns, then matches; within each, by
    severity, then the playbook's own rank, then higher confidence first."""
    rank_of = {rule.id: rule.rank for rule in rules}
    unranked = len(rank_of)
    return sorted(
        findings,
        key=lambda f: (
            STATUS_ORDER.get(f.status, 3),
            SEVERITY_ORDER.get(f.severity, 5),
            rank_of.get(f.id, unranked),
            -f.confidence,
            f.id,
        ),
    )


def count_findings(findings: list[Finding]) -> dict[str, int]:
    counts = {"mismatch": 0, "unknown": 0, "match": 0}
    for finding in findings:
        counts[finding.status] = counts.get(finding.status, 0) + 1
    return counts
