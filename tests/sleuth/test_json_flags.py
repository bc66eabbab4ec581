"""`--json` on every sleuth command that prints results: one JSON object on stdout, messages on stderr,
the documented exit codes. (fetch-reference's `--json` is tested with the git tiers in test_fetch_git.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_diagnose_agent import FakeEngine, _runs
from typer.testing import CliRunner

import sleuth.diagnose
from sleuth.commands.diagnose import app as diagnose_app

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "anyprobe"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    engine = FakeEngine()
    monkeypatch.setattr(sleuth.diagnose, "_default_engine", engine.engine)
    return engine


def test_diagnose_json_prints_report_json_and_exits_with_the_findings_code(tmp_path: Path, fake: FakeEngine) -> None:
    runs = _runs(tmp_path, v5={"loss_decay_gamma": 7.0})
    result = CliRunner().invoke(diagnose_app, ["--run", "v5", "--runs-dir", str(runs), "--json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["findings"][0]["id"] == "dflash.loss_decay_gamma" and report["exit_status"] == 1
    assert result.stdout == (runs / "v5" / "diagnosis" / "report.json").read_text()


def test_diagnose_json_with_another_format_is_one_line_exit_2(tmp_path: Path, fake: FakeEngine) -> None:
    runs = _runs(tmp_path, v5={})
    result = CliRunner().invoke(diagnose_app, ["--run", "v5", "--runs-dir", str(runs), "--json", "--format", "md"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip() == "error: --json and --format md ask for two outputs; give one"


def run_sleuth(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLEUTH_CACHE_DIR": str(cwd / "cache")}
    return subprocess.run([sys.executable, "-m", "sleuth.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_probe_init_and_check_json(tmp_path: Path) -> None:
    code = tmp_path / "trainer"
    code.mkdir()
    shutil.copy(EXAMPLE / "tiny_dflash.py", code / "tiny_dflash.py")
    init = run_sleuth("probe", "init", "--code", str(code), "--no-run", "--json", cwd=tmp_path)
    assert init.returncode == 0, init.stderr
    written = json.loads(init.stdout)
    assert written["entry"] == str(code / "probe_entry.py") and (code / "probe_entry.py").is_file()
    assert written["methods"]["loss"] == "wired" and written["todos"] == 0 and written["pieces_called"] is False

    source = (EXAMPLE / "probe_entry_handwritten.py").read_text()
    broken = source.replace(
        "        block = hooks.block_embeddings(F.embedding(ids.view(n, a * b), self.target.embed_weight))",
        "        block = F.embedding(ids.view(n, a * b), self.target.embed_weight)\n        hooks.block_embeddings(block)")
    assert broken != source
    (code / "probe_entry.py").write_text(broken)
    check = run_sleuth("probe", "check", "--probe-entry", "probe_entry:subject", "--code", str(code), "--json",
                   cwd=tmp_path)
    assert check.returncode == 1, check.stderr
    checked = json.loads(check.stdout)
    assert checked["problems"] == 1 and checked["checks"]["describe"] == "ok"
    assert checked["checks"]["draft_logits"].startswith("calls hooks.block_embeddings but does not use its result")


def test_a_usage_error_under_json_is_still_one_line_on_stderr(tmp_path: Path) -> None:
    done = run_sleuth("probe", "check", "--probe-entry", "nope", "--json", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "error: --probe-entry must be module:function (e.g. my_trainer.probe:subject), got 'nope'"
