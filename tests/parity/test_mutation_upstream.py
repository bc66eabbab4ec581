"""Mutation testing on upstream code: speculators' own DFlash source (the installed package), and z-lab /
SpecForge checkouts when their paths are given (SLEUTH_ZLAB_PATH, SLEUTH_SPECFORGE_PATH).

Unmutated, sleuth must find 0 mismatches in them (they are the references); mutated, no planted defect may
come back `match`. Runs under `make parity` (speculators' venv; with SPECULATORS_PARITY_REQUIRED=1 a
missing speculators fails); skips with the reason elsewhere.
Nothing upstream is copied into the repository: the sources are read from where they are installed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mutation"))

from mutation_harness import report, score  # noqa: E402


REQUIRED = os.environ.get("SPECULATORS_PARITY_REQUIRED") == "1"


def _speculators_dflash(tmp_path: Path) -> Path:
    spec = importlib.util.find_spec("speculators")
    if spec is None or not spec.submodule_search_locations:
        if REQUIRED:
            pytest.fail("SPECULATORS_PARITY_REQUIRED=1 but speculators is not installed", pytrace=False)
        pytest.skip("speculators is not installed here (run under `make parity`)")
    package = Path(next(iter(spec.submodule_search_locations)))
    if not (package / "models" / "dflash").is_dir():
        pytest.skip(f"the installed speculators at {package} has no DFlash module")
    root = tmp_path / "speculators"
    shutil.copytree(package / "models" / "dflash", root / "dflash", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(package / "losses", root / "losses", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _check(root: Path) -> None:
    result = score([(root, None)])
    table = report(result)
    print("\n" + table)
    assert not result.baseline_false_alarms, "the reference itself reported as mismatching:\n" + table
    assert not result.silent, "silent false matches on upstream code:\n" + table
    assert not result.false_alarms, table


def test_speculators_dflash_under_mutation(tmp_path: Path) -> None:
    _check(_speculators_dflash(tmp_path))


@pytest.mark.parametrize("env", ["SLEUTH_ZLAB_PATH", "SLEUTH_SPECFORGE_PATH"])
def test_other_upstream_checkouts_under_mutation(env: str, tmp_path: Path) -> None:
    path = os.environ.get(env)
    if not path or not Path(path).is_dir():
        pytest.skip(f"{env} is not set to a checkout")
    root = tmp_path / Path(path).name
    shutil.copytree(path, root, ignore=shutil.ignore_patterns(".git", "__pycache__", "tests", "docs", "examples"))
    _check(root)


def test_the_whole_speculators_package_reads_without_a_mismatch(tmp_path: Path) -> None:
    """All of speculators (EAGLE, XPress, shared mixins beside DFlash): the reference is never a mismatch."""
    _speculators_dflash(tmp_path)  # skips (or fails when required) without speculators
    from sleuth.invariants import check_invariants, load_playbook
    from sleuth.trace import Trace

    package = Path(next(iter(importlib.util.find_spec("speculators").submodule_search_locations)))
    root = tmp_path / "speculators-all"
    shutil.copytree(package, root, ignore=shutil.ignore_patterns("__pycache__"))
    findings = check_invariants(load_playbook("dflash"), code=root, trace=Trace())
    assert [(f.id, f.observed, f.reason) for f in findings if f.status == "mismatch"] == []
