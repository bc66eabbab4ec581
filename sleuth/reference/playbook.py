"""Reference definitions are data: `playbooks/references/<name>.yaml`.

A definition names the repository, its default branch, the files a playbook needs, the docs pages, the
hosts the HTTP tiers may talk to, and facts pinned at a stated commit (the offline last resort).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator

from sleuth.reference.model import ReferenceError

PLAYBOOKS_DIR_ENV = "SLEUTH_PLAYBOOKS_DIR"


class DocsPage(BaseModel):
    url: str
    title: str = ""


class PinnedFact(BaseModel):
    expected: object = Field(description="the value the reference implementation has")
    location: str = Field(description="path:line(s) in the repository at `commit`")
    commit: str | None = Field(None, description="defaults to the definition's pinned_commit")
    note: str = ""


class ReferenceSpec(BaseModel):
    name: str
    repository: str = Field(description="owner/name on GitHub")
    url: str = Field(description="git remote URL for clones and fetches")
    default_branch: str = "main"
    files: list[str] = Field(description="files every playbook check needs, repository-relative")
    module_dirs: list[str] = Field(default_factory=list, description="directories named when missing")
    docs: list[DocsPage] = Field(default_factory=list)
    allowed_hosts: list[str] = Field(default_factory=list, description="hosts the HTTP tiers may contact")
    pinned_commit: str | None = None
    pinned: dict[str, PinnedFact] = Field(default_factory=dict)

    @field_validator("files")
    @classmethod
    def _relative_paths(cls, files: list[str]) -> list[str]:
        for path in files:
            if path.startswith("/") or ".." in Path(path).parts:
                raise ValueError(f"file path must be repository-relative: {path!r}")
        return files

    def pinned_facts(self) -> dict[str, dict]:
        return {
            fact_id: {
                "expected": fact.expected,
                "location": fact.location,
                "commit": fact.commit or self.pinned_commit,
                "note": fact.note,
            }
            for fact_id, fact in self.pinned.items()
        }


def playbooks_dir() -> Path:
    """`<playbooks>/references`: SLEUTH_PLAYBOOKS_DIR moves the playbooks root, as for the invariants."""
    override = os.environ.get(PLAYBOOKS_DIR_ENV)
    root = Path(override) if override else Path(__file__).resolve().parents[2] / "playbooks"
    return root / "references"


def known_references() -> list[str]:
    directory = playbooks_dir()
    return sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else []


# A reference name is a file stem in playbooks/references/ and a folder name in the cache: one path
# segment of plain characters, never `..`, a separator or a drive.
_REFERENCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_reference_name(name: str) -> str:
    if not isinstance(name, str) or not _REFERENCE_NAME.fullmatch(name) or ".." in name:
        known = ", ".join(known_references()) or "none"
        raise ReferenceError(f"{name!r} is not a reference name (letters, digits, '.', '_', '-'); "
                             f"known references: {known}")
    return name


def load_reference_spec(name: str) -> ReferenceSpec:
    check_reference_name(name)
    path = playbooks_dir() / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(known_references()) or "none"
        raise ReferenceError(f"unknown reference {name!r}; known references: {known}")
    from sleuth.safe_yaml import YamlLimitError, load_yaml, read_text_file

    try:
        data = load_yaml(read_text_file(path, what="reference definition"))
        return ReferenceSpec.model_validate({**(data if isinstance(data, dict) else {}), "name": name})
    except (yaml.YAMLError, ValidationError, TypeError, YamlLimitError, UnicodeDecodeError, OSError) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ReferenceError(f"reference definition {path} is invalid: {first_line}") from None
