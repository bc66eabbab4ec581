"""What a reference resolution returns: the files found, where and at which commit, and how we got there.

Every file carries its provenance (tier, path or URL, commit, sha256, time) so a finding built on it can
say exactly which bytes it read.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sleuth.redact import redact

# The tiers, in the order the chain tries them. The first three give source files; `docs` gives pages
# whose facts carry lower confidence; `pinned` gives facts written into the playbook at a stated commit.
TIERS = ("local", "git-pull", "raw", "docs", "pinned")
SOURCE_TIERS = ("local", "git-pull", "raw")

Outcome = Literal["ok", "partial", "miss", "error", "skipped"]


class ReferenceError(Exception):  # noqa: A001 - the name is part of the team interface
    """A user-facing problem (unknown reference, bad --path, unreadable config): one line, exit 2."""


class ResolvedFile(BaseModel):
    path: str = Field(description="path inside the repository, or the URL for a docs page")
    tier: str = Field(description="the tier the bytes came from")
    source: str = Field(description="where they were read: checkout path, git object, URL, cache file")
    commit: str | None = Field(description="full commit SHA the bytes belong to; None for docs or a branch")
    sha256: str
    git_blob_sha: str | None = Field(
        None, description="git's object id for these bytes, checked against what git (or GitHub's tree) says the "
                          "file is; None when nothing could vouch for them (such bytes are never cached)")
    fetched_at: str = Field(description="UTC time, ISO 8601")
    text: str = Field("", exclude=True, description="the content; fetched code is data, never imported")

    # A remote URL may carry a token; whatever enters the model is redacted, so no sink can leak it.
    model_config = ConfigDict(validate_assignment=True)

    @field_validator("path", "source")
    @classmethod
    def _redacted(cls, value: str) -> str:
        return redact(value)


class Attempt(BaseModel):
    tier: str
    tried: str = Field(description="what was tried: a checkout, a remote, a URL pattern")
    outcome: Outcome
    reason: str
    duration_s: float = 0.0

    model_config = ConfigDict(validate_assignment=True)  # the chain fills `tried`/`reason` in as it goes

    @field_validator("tried", "reason")
    @classmethod
    def _redacted(cls, value: str) -> str:
        return redact(value)


class Resolution(BaseModel):
    reference: str
    tier: str | None = Field(description="the best tier that gave something; None when nothing did")
    commit: str | None = Field(description="the commit of `files` (all files share one commit)")
    files: list[ResolvedFile] = Field(default_factory=list)
    docs: list[ResolvedFile] = Field(default_factory=list)
    pinned: dict = Field(default_factory=dict, description="facts by invariant id, each with its commit")
    trace: list[Attempt] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list, description="e.g. the stale-checkout diagnosis")

    @property
    def has_source(self) -> bool:
        return self.tier in SOURCE_TIERS and bool(self.files)

    def file(self, path: str) -> ResolvedFile | None:
        return next((f for f in self.files if f.path == path), None)
