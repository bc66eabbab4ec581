"""`sleuth diagnose` on the command line: exit codes 0/1/2, stdout formats, one-line errors, no tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_diagnose_agent import FakeEngine, _runs
from test_runs import write_run
from typer.testing import CliRunner

import sleuth.diagnose
from sleuth.commands.diagnose import app

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    engine = FakeEngine()
    monkeypatch.setattr(sleuth.diagnose, "_default_engine", engine.engine)
    return engine


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_mismatches_exit_1_with_a_text_summary(tmp_path: Path, fake: FakeEngine) -> None:
    runs = _runs(tmp_path, v5={"fc_layers": [0, 1, 2, 3]})
    code, out, err = invoke("--run", "v5", "--runs-dir", str(runs))
    assert code == 1, err
    assert "sleuth diagnose v5: 1 mismatch(es), 0 unknown, 3 match" in out
    assert "regression: v5 regressed against v3" in out
    assert "dflash.fc_input_layers" in out
    assert "report: " in out and "report.md" in out
    assert err == ""  # not a TTY: progress stays quiet


def test_a_clean_run_exits_0(tmp_path: Path, fake: FakeEngine) -> None:
    runs = _runs(tmp_path, fixed={})
    code, _, err = invoke("--run", "fixed", "--runs-dir", str(runs))
    assert code == 0, err


def test_format_json_prints_the_versioned_report(tmp_path: Path, fake: FakeEngine) -> None:
    runs = _runs(tmp_path, v5={"loss_decay_gamma": 7.0})
    code, out, _ = invoke("--run", "v5", "--runs-dir", str(runs), "--format", "json")
    assert code == 1
    report = json.loads(out)
    required = {"schema_version", "run", "reference", "regression", "findings", "trace", "summary", "exit_status"}
    assert required <= set(report)
    assert report["schema_version"] == 1 and report["exit_status"] == 1
    assert report["run"]["name"] == "v5"
    assert report["reference"]["name"] == "speculators" and report["reference"]["tier"] == "git-pull"
    assert report["regression"]["baseline"] == "v3"
    assert report["findings"][0]["id"] == "dflash.loss_decay_gamma"
    assert out == (runs / "v5" / "diagnosis" / "report.json").read_text()


def test_format_md_and_sarif_print_the_files(tmp_path: Path, fake: FakeEngine) -> None:
    runs = _runs(tmp_path, v5={"fc_layers": [0, 1]})
    _, md, _ = invoke("--run", "v5", "--runs-dir", str(runs), "--format", "md")
    assert md.startswith("# sleuth diagnosis: v5")
    _, sarif, _ = invoke("--run", "v5", "--runs-dir", str(runs), "--format", "sarif")
    log = json.loads(sarif)
    assert log["version"] == "2.1.0"
    assert [r["ruleId"] for r in log["runs"][0]["results"]] == ["dflash.fc_input_layers"]


def test_code_without_run_writes_to_out(tmp_path: Path, fake: FakeEngine) -> None:
    source = tmp_path / "dflash.py"
    source.write_text("x = 1\n")
    config = tmp_path / "train.yaml"
    config.write_text("loss_decay_gamma: 4.0\n")
    code, _, err = invoke("--code", str(source), "--config", str(config), "--out", str(tmp_path / "diag"))
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "diag").iterdir()) == [
        "fix.yaml", "report.json", "report.md", "report.sarif", "trace.jsonl"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "nothing to diagnose"),
        (("--run", "v9"), "no run 'v9'"),
        (("--run", "v5", "--baseline", "b16"), "baseline b16 cannot be compared with v5: other block size (16 vs 8)"),
        (("--code", "/nonexistent/dflash.py"), "--code /nonexistent/dflash.py does not exist"),
        (("--run", "v5", "--format", "yaml"), "Invalid value for '--format'"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(
    tmp_path: Path, fake: FakeEngine, args: tuple[str, ...], message: str
) -> None:
    runs = _runs(tmp_path, v5={})
    write_run(runs, "b16", config={"block_size": 16})
    code, out, err = invoke(*args, "--runs-dir", str(runs))
    assert code == 2
    assert message in err
    assert "Traceback" not in err + out
    if "--format" not in args:
        assert err.strip().count("\n") == 0 and err.startswith("error: ")


def test_an_internal_failure_is_one_line_too(tmp_path: Path, fake: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> list:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(fake, "check_invariants", broken)
    monkeypatch.delenv("SLEUTH_DEBUG", raising=False)
    runs = _runs(tmp_path, v5={})
    code, _, err = invoke("--run", "v5", "--runs-dir", str(runs))
    assert code == 2
    assert err.strip() == "error: internal error (RuntimeError: boom); rerun with SLEUTH_DEBUG=1 for the traceback"


def test_a_corrupt_run_never_prints_a_traceback(tmp_path: Path, fake: FakeEngine) -> None:
    runs = tmp_path / "runs"
    path = write_run(runs, "v5")
    (path / "config.json").write_text("{garbled")
    (path / "metrics.jsonl").write_text('{"step": 10, "acc"')
    weights = path / "checkpoints" / "step-00000300" / "drafter.safetensors"
    weights.write_bytes(b"\xff" * 20)
    code, out, err = invoke("--run", "v5", "--runs-dir", str(runs), "--format", "json")
    assert code == 1, err  # the config that ran cannot be read: never a clean bill
    report = json.loads(out)
    assert report["input_problems"] and "config.json is not valid JSON" in report["input_problems"][0]
    problems = report["run"]["problems"]
    assert any(p.startswith("config.json is not valid JSON") for p in problems)
    assert any("skipped 1 truncated or garbled line(s)" in p for p in problems)
    assert any("drafter.safetensors is corrupt" in p for p in problems)
    assert {f["status"] for f in report["findings"]} == {"unknown", "match"}


def test_python_dash_m_reports_a_missing_run_in_one_line(tmp_path: Path) -> None:
    # A real process: what a user sees, including that nothing heavy is imported to say it.
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "sleuth.commands.diagnose", "--run", "nope", "--runs-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    expected = f"error: no run 'nope': not a directory, and no run of that name in {tmp_path}/"
    assert done.stderr.strip().splitlines() == [expected]


def test_importing_the_command_does_not_import_torch_or_matplotlib() -> None:
    code = (
        "import sys, sleuth.commands.diagnose, sleuth.diagnose, sleuth.report, sleuth.regression; "
        "print(sorted(m for m in ('torch', 'matplotlib', 'numpy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr
