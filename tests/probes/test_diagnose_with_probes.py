"""`sleuth diagnose` with probes, end to end through the CLI: the README's protocol example, and the flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def sleuth(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLEUTH_CACHE_DIR": str(cwd / "cache")}
    return subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_protocol_example_is_probed_and_the_probe_decides(tmp_path: Path):
    config = tmp_path / "run.yaml"
    config.write_text("defects: [teacher_last_selected]\nblock_size: 6\n")
    done = sleuth("--code", str(REPO / "examples" / "probe_protocol.py"), "--probe-entry", "probe_protocol:subject",
                  "--config", str(config), "--offline", "--out", str(tmp_path / "out"), "--format", "json",
                  cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    by_id = {f["id"]: f for f in report["findings"]}
    source = by_id["dflash.target_logits_source"]
    assert source["status"] == "mismatch"
    assert source["evidence"][0]["kind"] == "probe"
    assert "lm_head(norm(hidden_states[6]))" in source["evidence"][0]["value"]
    # Every probe-able invariant carries probe evidence, and the run's steps are in the trace.
    from sleuth.probes.verdict import PROBED_INVARIANTS

    probed = [f for f in report["findings"] if any(e["kind"] == "probe" for e in f["evidence"])]
    assert len(probed) == len(PROBED_INVARIANTS) == 16
    steps = [s["step"] for s in report["trace"]]
    assert "run-probes" in steps and "apply-probes" in steps and steps.count("probe") == 16
    mismatched = sorted(f["id"] for f in report["findings"] if f["status"] == "mismatch")
    assert mismatched == ["dflash.target_logits_source"]
    assert "## Findings" in (tmp_path / "out" / "report.md").read_text()


def test_code_is_not_run_without_probe(tmp_path: Path):
    done = sleuth("--code", str(REPO / "examples" / "probe_protocol.py"), "--offline", "--out", str(tmp_path / "o"),
                  "--format", "json", cwd=tmp_path)
    report = json.loads(done.stdout)
    step = next(s for s in report["trace"] if s["step"] == "run-probes")
    assert step["outcome"].startswith("not probed: --code is probed only with --probe")
    assert not any(e["kind"] == "probe" for f in report["findings"] for e in f["evidence"])


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--probe-python", "/nonexistent/python", "error: --probe-python /nonexistent/python does not exist"),
    ("--probe-entry", "not-an-entry", "error: --probe-entry must be module:function"),
])
def test_bad_probe_flags_exit_2_with_one_line(tmp_path: Path, flag: str, value: str, message: str):
    done = sleuth("--code", str(REPO / "examples" / "probe_protocol.py"), flag, value, "--offline", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().startswith(message) and len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_code_whose_imports_fail_here_is_unknown_with_the_import_error(tmp_path: Path):
    from sleuth.probes.runner import plan_for_code, run_plan
    from sleuth.probes.verdict import PROBED_INVARIANTS

    package = tmp_path / "checkout" / "specforge"
    (package / "modeling" / "draft").mkdir(parents=True)
    (package / "__init__.py").write_text("import sglang_kernels_that_need_a_gpu  # noqa: F401\n")
    (package / "modeling" / "draft" / "dflash.py").write_text("")
    outcome = run_plan(plan_for_code(tmp_path / "checkout", None))
    assert outcome.error.startswith("cannot set up the subject: ModuleNotFoundError: No module named "
                                    "'sglang_kernels_that_need_a_gpu'")
    assert {v.invariant for v in outcome.verdicts} == set(PROBED_INVARIANTS)
    assert all(v.status == "unknown" and v.reason == outcome.error for v in outcome.verdicts)
