"""Every invariant ships valid and invalid fixtures (semgrep-style): valid -> match (from code alone: static
agreement, reported unknown and not claimed), invalid -> mismatch.

tests/fixtures/invariants/<id>/valid_*.py | invalid_*.py   source, analysed statically (never imported)
tests/fixtures/invariants/<id>/valid_*.json | invalid_*.json
    {"config": {...config.json...}, "run": {...run.json...}, "checkpoint": {"tensor": [shape]}}
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from sleuth.checks import CONTRACT_CHECKS
from sleuth.invariants import check_invariants, load_playbook
from sleuth.observe.optimization_judge import OPTIMIZATION_INVARIANTS
from sleuth.probes.verdict import PATH_CHECK_INVARIANTS
from sleuth.trace import Trace

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "invariants"
PLAYBOOK = load_playbook("dflash")


def _cases() -> list[tuple[str, Path]]:
    # The train-to-serve contract invariants are checked by sleuth.checks, not the engine; their fixtures
    # run in test_contract_fixtures.py.
    return [(d.name, f) for d in sorted(FIXTURES.iterdir()) if d.is_dir() and d.name not in CONTRACT_CHECKS
            for f in sorted(d.iterdir())
            if f.suffix in {".py", ".json"} and f.name.startswith(("valid_", "invalid_"))]


def _run_fixture(fixture: Path, tmp_path: Path):
    if fixture.suffix == ".py":
        return check_invariants(PLAYBOOK, reference=None, config=None, config_source=None, checkpoint=None,
                                code=fixture, trace=Trace())
    spec = json.loads(fixture.read_text())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(spec.get("config", {})))
    if "run" in spec:
        (run_dir / "run.json").write_text(json.dumps(spec["run"]))
    checkpoint = None
    if "checkpoint" in spec:
        checkpoint = run_dir / "drafter.safetensors"
        save_file({name: np.zeros(shape, np.float32) for name, shape in spec["checkpoint"].items()}, str(checkpoint))
    return check_invariants(PLAYBOOK, reference=None, config=spec.get("config"), config_source=str(run_dir / "config.json"),
                            checkpoint=checkpoint, code=None, trace=Trace())


def test_every_invariant_has_valid_and_invalid_fixtures():
    # An invariant only the probes' path checks decide has no static reading to give fixtures to: its cases are
    # planted in the upstream trainers (tests/parity/test_specforge_paths.py, test_speculators_probes.py).
    probe_only = set(PATH_CHECK_INVARIANTS) - set(CONTRACT_CHECKS)
    # Likewise those only the user's own command, observed, decides (tests/observe/test_observed_optimizer.py).
    probe_only |= set(OPTIMIZATION_INVARIANTS)
    for invariant in [i for i in PLAYBOOK.ids if i not in probe_only]:
        names = [f.name for f in (FIXTURES / invariant).iterdir()]
        assert any(n.startswith("valid_") for n in names), invariant
        assert any(n.startswith("invalid_") for n in names), invariant


@pytest.mark.parametrize(("invariant", "fixture"), _cases(), ids=lambda v: v if isinstance(v, str) else v.name)
def test_fixture(invariant: str, fixture: Path, tmp_path: Path):
    findings = {f.id: f for f in _run_fixture(fixture, tmp_path)}
    finding = findings[invariant]
    want = "match" if fixture.name.startswith("valid_") else "mismatch"
    if want == "match" and fixture.suffix == ".py":
        # Code alone: the reader must read agreement, and the engine must not claim it (no probe ran).
        assert finding.status == "unknown" and finding.static_agreement, f"{fixture.name}: {finding.status} ({finding.reason})"
    else:
        assert finding.status == want, f"{fixture.name}: {finding.status} ({finding.reason})"
    assert finding.evidence, "a decided status must cite evidence"
    if want == "mismatch":
        assert finding.fix is not None


def test_a_probe_only_invariant_says_so_without_probes(tmp_path: Path):
    fixture = next((FIXTURES / "dflash.fc_norm").glob("valid_*.py"))
    findings = {f.id: f for f in _run_fixture(fixture, tmp_path)}
    finding = findings["dflash.optimizer_schedule"]
    assert finding.status == "unknown" and finding.reason.startswith("only the probes decide this rule"), finding
