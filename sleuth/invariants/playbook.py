"""Playbooks are data: `playbooks/<name>.yaml`, validated here.

A playbook lists invariants. Each says what the rule is and why (as ruff documents a rule), how bad a
violation is, where the expected value comes from (reference source files + a static extractor, docs,
or a pinned fact at a stated commit), where the observed value comes from (config keys, checkpoint
tensors, a source extractor), and the fix (a config patch and/or a code hint, safe or unsafe).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

PLAYBOOKS_DIR_ENV = "SLEUTH_PLAYBOOKS_DIR"


class PlaybookError(Exception):
    """An unknown or invalid playbook: a one-line message for the user (the CLI maps it to exit 2)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Why(_Strict):
    what: str = Field(description="what the rule requires")
    why: str = Field(description="why a violation matters")
    example: str = Field("", description="a violation, as code or config")


class PinnedValue(_Strict):
    value: object = Field(description="the expected value in the playbook's canonical form")
    location: str = Field(description="path:line(s) in the reference repository")
    commit: str | None = None


class ConditionalAccept(_Strict):
    value: object
    block_size: int
    note: str = ""


class Expected(_Strict):
    value: object = Field(description="the rule's value in canonical form (what the extractors produce)")
    accept: list[object] = Field(default_factory=list, description="other values that also satisfy the rule")
    conditional_accept: list[ConditionalAccept] = Field(default_factory=list)
    reference_files: list[str] = Field(default_factory=list, description="reference files the extractor reads")
    extractor: str | None = Field(None, description="source extractor run over the reference files")
    docs_pattern: str | None = Field(None, description="regex over docs pages; group 1 is the value")
    pinned: PinnedValue | None = None


class ConfigSource(_Strict):
    keys: list[str]
    reader: str = Field(description="a config reader registered with @config_reader (sleuth/evidence/config.py)")


class CheckpointSource(_Strict):
    extractor: str = Field(description="a checkpoint reader registered with @checkpoint_reader (sleuth/evidence/checkpoint.py)")
    tensors: list[str] = Field(default_factory=list, description="tensor names (or module names) the reader looks for")


class Observed(_Strict):
    config: ConfigSource | None = None
    checkpoint: CheckpointSource | None = None
    code: str | None = Field(None, description="a code detector registered with @detector (sleuth/evidence/detectors/)")


class FixSpec(_Strict):
    config_patch: dict[str, object] = Field(default_factory=dict, description="'$expected' = the expected value")
    code_hint: str | None = None
    applicability: Literal["safe", "unsafe"] = "safe"
    why_unsafe: str | None = None


class Invariant(_Strict):
    id: str
    title: str
    why: Why
    severity: Literal["critical", "high", "medium", "low", "info"]
    rank: int = Field(ge=1, description="expected impact on real acceptance, 1 = largest")
    expected: Expected
    observed: Observed
    fix: FixSpec
    notes: list[str] = Field(default_factory=list)
    variants: list[str] = Field(default_factory=list, description="the DFlash-family variants it applies to "
                                "(sleuth/evidence/variant.py); empty = every variant")


class Playbook(_Strict):
    name: str
    version: int = 1
    reference: str = Field(description="the reference definition it is checked against (playbooks/references)")
    invariants: list[Invariant]
    path: str | None = Field(None, description="where it was loaded from")

    def get(self, invariant_id: str) -> Invariant:
        for invariant in self.invariants:
            if invariant.id == invariant_id:
                return invariant
        raise KeyError(invariant_id)

    @property
    def ids(self) -> list[str]:
        return [i.id for i in self.invariants]


def playbooks_dir() -> Path:
    override = os.environ.get(PLAYBOOKS_DIR_ENV)
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "playbooks"


def load_playbook(name_or_path: str | Path = "dflash") -> Playbook:
    """A playbook by name (<playbooks dir>/<name>.yaml) or by path."""
    candidate = Path(name_or_path)
    if candidate.suffix in {".yaml", ".yml"} or candidate.is_file():
        path = candidate
    else:
        path = playbooks_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in playbooks_dir().glob("*.yaml")) if playbooks_dir().is_dir() else []
        raise PlaybookError(f"unknown playbook {str(name_or_path)!r}; known playbooks: {', '.join(known) or 'none'}")
    try:
        # libyaml's loader when present: the playbook is our own file of a few thousand nodes, and the
        # pure-Python parser alone took about a third of a warm `diagnose` (0.1-0.4 s).
        data = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, yaml.YAMLError) as exc:
        raise PlaybookError(f"playbook {path} cannot be read: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise PlaybookError(f"playbook {path} must be a mapping")
    try:
        playbook = Playbook.model_validate({**data, "path": str(path)})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise PlaybookError(f"playbook {path} is invalid at {where}: {error['msg']}") from None
    ids = playbook.ids
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise PlaybookError(f"playbook {path} repeats invariant ids: {', '.join(duplicates)}")
    unknown = unregistered_readers(playbook)
    if unknown:
        raise PlaybookError(f"playbook {path} names readers that are not registered: {'; '.join(unknown)}")
    return playbook


def unregistered_readers(playbook: Playbook) -> list[str]:
    """Every reader id the playbook names that no module registered (sleuth/evidence/registry.py)."""
    from sleuth.evidence.registry import registered

    known = {kind: set(registered(kind)) for kind in ("code", "config", "checkpoint")}
    problems = []
    for inv in playbook.invariants:
        wanted = [("code", inv.observed.code, "observed.code"), ("code", inv.expected.extractor, "expected.extractor"),
                  ("config", inv.observed.config.reader if inv.observed.config else None, "observed.config.reader"),
                  ("checkpoint", inv.observed.checkpoint.extractor if inv.observed.checkpoint else None,
                   "observed.checkpoint.extractor")]
        for kind, reader_id, where in wanted:
            if reader_id is not None and reader_id not in known[kind]:
                problems.append(f"{inv.id} {where} {reader_id!r} (known {kind} readers: {', '.join(sorted(known[kind]))})")
    return problems
