"""The planted defects as data: load `defects.yaml`, find each upstream source, apply one defect to a copy.

A defect is a list of exact text edits in files relative to a source's package directory (the directory
that `sleuth diagnose --code` reads: `speculators/`, SpecForge's `specforge/`, z-lab's `dflash/`). An edit
whose `find` does not occur exactly once, or an edited file that no longer parses, is an error of the
benchmark itself (the upstream moved, or the defect was written wrong): it stops the run rather than
measuring a defect that was never planted.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

REPO = Path(__file__).resolve().parents[2]
CATALOG_PATH = Path(__file__).with_name("defects.yaml")

SourceName = Literal["speculators", "specforge", "zlab"]
SOURCE_NAMES: tuple[SourceName, ...] = ("speculators", "specforge", "zlab")


class CatalogError(Exception):
    """The catalog or a source does not fit: the benchmark cannot run as written."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Edit(_Strict):
    file: str  # relative to the source's package directory
    find: str = Field(min_length=1)
    replace: str


class Expectation(_Strict):
    # mismatch: a planted defect; clean (or match): a behaviour-preserving rewrite, for which a diagnosis
    # should report no mismatch beyond the unmodified source's
    status: Literal["mismatch", "clean", "match"] = "mismatch"
    observed: str | None = None  # the value sleuth should read, where it is obvious


class Defect(_Strict):
    id: str
    source: SourceName
    invariant: str
    what: str
    edits: list[Edit] = Field(min_length=1)
    expect: Expectation = Expectation()


class SourceSpec(_Strict):
    package: str  # the package directory inside a checkout, and the name of the copy sleuth reads
    written_against: str  # the upstream version every `find` was read from
    env: str  # environment variable that points at a checkout (or the package directory itself)


class Catalog(_Strict):
    sources: dict[SourceName, SourceSpec]
    defects: list[Defect]

    def for_sources(self, names: list[str]) -> list[Defect]:
        return [d for d in self.defects if d.source in names]


def resolve_catalog_path(given: str | Path) -> Path:
    """The catalog file: `given` as a path, else a bare file name looked up next to defects.yaml.

    A bare name lets `--catalog defects_heldout.yaml` work from any directory, like the default does.
    """
    path = Path(given).expanduser()
    if path.is_file():
        return path.resolve()
    beside = CATALOG_PATH.parent / path
    if path.name == str(given) and beside.is_file():
        return beside.resolve()
    raise CatalogError(f"no catalog file {given} (neither a path nor a file in {CATALOG_PATH.parent})")


def load_catalog(path: Path = CATALOG_PATH) -> Catalog:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise CatalogError(f"{path.name} is not valid YAML: {exc}") from exc
    catalog = Catalog.model_validate(data)
    ids = [d.id for d in catalog.defects]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise CatalogError(f"{path.name}: duplicate defect ids {duplicates}")
    return catalog


def apply_edits(texts: Mapping[str, str], defect: Defect) -> dict[str, str]:
    """The edited text of every file the defect touches (edits apply in order, each exactly once)."""
    edited: dict[str, str] = {}
    for edit in defect.edits:
        if edit.file not in texts and edit.file not in edited:
            raise CatalogError(f"defect {defect.id}: {edit.file} does not exist in the {defect.source} source")
        text = edited.get(edit.file, texts.get(edit.file, ""))
        count = text.count(edit.find)
        if count != 1:
            raise CatalogError(
                f"defect {defect.id}: the text to replace occurs {count} times in {edit.file} (must be exactly "
                f"once): {edit.find.strip().splitlines()[0][:80]!r}"
            )
        edited[edit.file] = text.replace(edit.find, edit.replace)
    for file, text in edited.items():
        try:
            ast.parse(text, filename=file)
        except SyntaxError as exc:
            raise CatalogError(f"defect {defect.id}: {file} no longer parses after the edit: {exc}") from exc
    return edited


def read_touched_files(root: Path, defects: list[Defect]) -> dict[str, str]:
    files = {edit.file for defect in defects for edit in defect.edits}
    return {file: (root / file).read_text() for file in files if (root / file).is_file()}


def check_defects_apply(root: Path, defects: list[Defect]) -> None:
    """Every defect applies to this source as written; raises CatalogError naming the first that does not."""
    texts = read_touched_files(root, defects)
    for defect in defects:
        apply_edits(texts, defect)


def copy_with_defect(root: Path, destination: Path, defect: Defect | None) -> Path:
    """A copy of the package directory (named like the package) with the defect planted in it."""
    shutil.copytree(root, destination, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if defect is not None:
        texts = read_touched_files(root, [defect])
        for file, text in apply_edits(texts, defect).items():
            (destination / file).write_text(text)
    return destination


def package_dir(path: Path, package: str) -> Path | None:
    """The package directory for a checkout root, a `src/` layout, or the package directory itself."""
    for candidate in (path / package, path / "src" / package, path):
        if candidate.name == package and (candidate / "__init__.py").is_file():
            return candidate
    return None


def _installed_fallbacks(package: str) -> list[Path]:
    # This interpreter's package when it has one (the parity venv), else the repo's parity venv (which holds
    # speculators and SpecForge: bench/setup_speculators_env.sh).
    found: list[Path] = []
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        found.append(Path(next(iter(spec.submodule_search_locations))))
    pattern = REPO / ".venv-speculators" / "lib" / "python3*" / "site-packages" / package
    found += [Path(p) for p in sorted(glob.glob(str(pattern)))]
    return found


def resolve_source(name: SourceName, spec: SourceSpec, given: str | None) -> tuple[Path | None, str]:
    """(package directory, how it was found) or (None, why the source is skipped)."""
    explicit = given or os.environ.get(spec.env)
    if explicit:
        root = package_dir(Path(explicit).expanduser().resolve(), spec.package)
        if root is None:
            return None, f"{explicit} holds no {spec.package}/ package (from {'--' + name if given else spec.env})"
        return root, f"{'--' + name if given else spec.env}"
    if name in ("speculators", "specforge"):
        for candidate in _installed_fallbacks(spec.package):
            root = package_dir(candidate, spec.package)
            if root is not None:
                return root, "installed package"
        return None, (f"{name} is not installed here and {spec.env} is unset (`make parity` builds "
                      ".venv-speculators with speculators 0.9.0 and SpecForge 0.2.0)")
    return None, (f"no checkout: set {spec.env} or pass --{name} PATH (defects were written against "
                  f"{spec.written_against})")


def describe_version(name: SourceName, root: Path) -> str:
    """The upstream version actually read: the installed distribution, or the checkout's commit."""
    # An installed distribution first: a site-packages inside some git work tree is not that tree's commit.
    metadata = sorted(root.parent.glob(f"{root.name}-*.dist-info"))
    if metadata:
        return metadata[-1].name.removesuffix(".dist-info").replace("-", " ")
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        return f"commit {commit}"
    except (OSError, subprocess.SubprocessError):
        return "unknown version (not a git checkout, no distribution metadata)"
