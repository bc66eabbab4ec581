"""The facts sleuth reports, shared by every part of it: what was checked, what was seen, and the proof.

One model, rendered many ways (text, Markdown, JSON, SARIF). Every claim carries evidence with its
provenance; a check without evidence is `unknown`, never a guess.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Status = Literal["match", "mismatch", "unknown"]
Severity = Literal["critical", "high", "medium", "low", "info"]
# `probe`: measured by running the implementation (sleuth/probes); ranked above static `code` readings.
EvidenceKind = Literal["reference", "code", "config", "checkpoint", "docs", "pinned", "metrics", "probe"]


class Evidence(BaseModel):
    """One place a value was read from."""

    kind: EvidenceKind
    location: str = Field(description="path:line@commit, a config key, a tensor name, or a URL")
    value: str | None = Field(None, description="the value read there, as text")
    snippet: str | None = Field(None, description="the source line(s) it was read from")
    path: str | None = Field(None, description="file path, for SARIF locations")
    line: int | None = None
    commit: str | None = None


class Fix(BaseModel):
    config_patch: dict[str, object] = Field(default_factory=dict, description="keys to set in the run config")
    code_hint: str | None = Field(None, description="what to change in code when config cannot fix it")
    applicability: Literal["safe", "unsafe"] = "safe"


class Finding(BaseModel):
    id: str
    title: str
    status: Status
    severity: Severity
    expected: str | None = None
    observed: str | None = None
    evidence: list[Evidence] = Field(default_factory=list)
    confidence: float = Field(ge=0.0, le=1.0)
    fix: Fix | None = None
    reason: str | None = Field(None, description="why the status is what it is, esp. for unknown")
    notes: list[str] = Field(default_factory=list, description="e.g. references that disagree")
    input_problem: str | None = Field(None, description=(
        "the run's input that left this finding undecided (a config value of the wrong type): the run is then "
        "not reported clean"))
    static_agreement: bool = Field(False, description=(
        "status is unknown, but the code read statically agrees with the rule at the cited site: what the "
        "value's whole path does was not traced or measured, so it is not claimed as a match"))


class TraceStep(BaseModel):
    step: str
    inputs: dict[str, object] = Field(default_factory=dict)
    outcome: str = ""
    duration_s: float = 0.0
