"""`sleuth diagnose` end to end with the real playbook, invariant engine and reference chain.

The reference is resolved offline with an empty cache, so the chain ends at the playbook's pinned facts
(no network, deterministic); one test gives it a stale local checkout that lacks the DFlash module, so
the chain has to go down past it. Runs are built by hand per the run-directory contract.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from test_runs import metrics_rows, write_run
from typer.testing import CliRunner

from sleuth.commands.diagnose import app
from sleuth.diagnose import DiagnoseRequest, diagnose

STEPS = list(range(10, 301, 10))
REFERENCE_CONFIG = {
    "block_size": 8, "draft_layers": 5, "target_layer_ids": [1, 3, 5, 7, 9], "fc_layers": None,
    "target_logits_source": "final", "loss": "ce", "loss_decay_gamma": 4.0, "context_includes_anchor": False,
    "max_anchors": 32,
}
# The seed's regressed run: fc over 4 of 5 layers, targets from layer 9 (L-3 of 12), gamma 7.
V5_CONFIG = {**REFERENCE_CONFIG, "fc_layers": [0, 1, 2, 3], "target_logits_source": 9, "loss_decay_gamma": 7.0}


@pytest.fixture(autouse=True)
def isolated_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user config, no configured checkout, an empty cache: the chain can only reach pinned facts."""
    monkeypatch.setenv("SLEUTH_CONFIG_FILE", str(tmp_path / "no-config.yaml"))
    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SLEUTH_SPECULATORS_PATH", raising=False)


def seed_runs(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    write_run(runs, "v3", created="2026-11-01T09:00:00+00:00", config={**REFERENCE_CONFIG, "loss_decay_gamma": 7.0},
              rows=metrics_rows(STEPS, acc=[0.002 * s for s in STEPS], loss=[5 - 0.01 * s for s in STEPS]), code={})
    write_run(runs, "v5", created="2026-11-01T10:00:00+00:00", config=V5_CONFIG, fc_inputs=4,
              rows=metrics_rows(STEPS, acc=[0.001 * s for s in STEPS], loss=[5 - 0.005 * s for s in STEPS]), code={})
    return runs


def test_v5_regresses_against_v3_and_the_config_mismatches_are_found(tmp_path: Path) -> None:
    runs = seed_runs(tmp_path)
    result = diagnose(DiagnoseRequest(run="v5", runs_dir=runs, offline=True))
    report = result.report
    assert result.exit_code == 1
    assert report.regression is not None and report.regression.baseline == "v3"
    assert report.regression.verdict == "regression"
    assert report.reference is not None and report.reference.tier == "pinned"
    mismatches = [f.id for f in report.findings if f.status == "mismatch"]
    assert {"dflash.fc_input_layers", "dflash.target_logits_source", "dflash.loss_decay_gamma"} <= set(mismatches)
    # Ranked by expected impact: the critical ones before gamma (medium).
    assert mismatches.index("dflash.loss_decay_gamma") > mismatches.index("dflash.target_logits_source")
    assert {r.id for r in report.rules} >= set(mismatches)
    fix = yaml.safe_load((result.out_dir / "fix.yaml").read_text())
    assert fix["diagnosed_run"] == "v5"
    assert fix["config_patch"]["target_logits_source"] == "final"
    assert fix["config_patch"]["loss_decay_gamma"] == 4.0
    assert "fc_layers" in fix["config_patch"] and fix["config_patch"]["fc_layers"] is None
    steps = [json.loads(line)["step"] for line in (result.out_dir / "trace.jsonl").read_text().splitlines()]
    assert steps[:4] == ["read-run", "regression", "load-playbook", "resolve-reference"]
    assert "check-invariants" in steps and steps[-1] == "write-report"
    assert len(steps) > 15  # the engine's own steps are recorded inside check-invariants


def test_a_stale_reference_checkout_sends_the_chain_down(tmp_path: Path) -> None:
    # A git checkout without the DFlash module (as speculators was before f324209).
    checkout = tmp_path / "speculators"
    checkout.mkdir()
    (checkout / "README.md").write_text("speculators, before DFlash\n")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    subprocess.run([*git, "add", "README.md"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "old"], check=True)
    runs = seed_runs(tmp_path)
    result = diagnose(DiagnoseRequest(run="v5", runs_dir=runs, offline=True, reference_path=checkout))
    reference = result.report.reference
    assert reference is not None and reference.tier == "pinned"
    local = [a for a in reference.attempts if a["tier"] == "local" and a["outcome"] != "skipped"]
    assert local and local[0]["outcome"] in ("miss", "partial")
    assert "src/speculators/models/dflash" in str(local[0]["reason"])
    outcome = next(s.outcome for s in result.report.trace if s.step == "resolve-reference")
    assert outcome.startswith("pinned tier answered") and "local: miss" in outcome


def test_damaged_inputs_become_unknown_findings_and_no_traceback(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    path = write_run(runs, "broken", config=REFERENCE_CONFIG,
                     code={"trainer/model/attention_mask.py": "def mask(:\n", "trainer/model/loss.py": "x = 1\n"})
    (path / "config.json").write_text('{"block_size": 8,')  # truncated
    (path / "checkpoints" / "step-00000300" / "drafter.safetensors").write_bytes(b"\x00" * 12)
    with (path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 310, "acc": 0.3')
    result = CliRunner().invoke(app, ["--run", "broken", "--runs-dir", str(runs), "--offline", "--format", "json"])
    # The config that ran cannot be read: not a clean bill (exit 1), though nothing mismatches.
    assert result.exit_code == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert {f["status"] for f in report["findings"]} <= {"unknown", "match"}
    unknown = [f for f in report["findings"] if f["status"] == "unknown"]
    assert unknown and all(f["reason"] for f in unknown)
    problems = report["run"]["problems"]
    assert any(p.startswith("config.json is not valid JSON") for p in problems)
    assert any("drafter.safetensors is corrupt" in p for p in problems)
    assert any("truncated or garbled" in p for p in problems)
    code_step = next(s for s in report["trace"] if s["step"] == "analyse-code")
    assert "attention_mask.py" in code_step["outcome"]  # the unparseable file is named


def test_code_only_diagnosis_of_a_source_tree(tmp_path: Path) -> None:
    tree = tmp_path / "their_dflash"
    tree.mkdir()
    (tree / "model.py").write_text("import torch\n\nclass Drafter(torch.nn.Module):\n    pass\n")
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({**REFERENCE_CONFIG, "loss_decay_gamma": 7.0}))
    result = CliRunner().invoke(app, ["--code", str(tree), "--config", str(config), "--offline",
                                      "--out", str(tmp_path / "diag"), "--format", "json"])
    assert result.exit_code == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["run"] is None and report["regression"] is None
    assert report["inputs"]["code"] == str(tree) and report["inputs"]["config"] == str(config)
    assert "dflash.loss_decay_gamma" in [f["id"] for f in report["findings"] if f["status"] == "mismatch"]
    assert (tmp_path / "diag" / "report.sarif").is_file()


def test_an_unknown_reference_is_a_one_line_error(tmp_path: Path) -> None:
    runs = seed_runs(tmp_path)
    result = CliRunner().invoke(app, ["--run", "v5", "--runs-dir", str(runs), "--reference", "nope", "--offline"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: unknown reference 'nope'; known references: ")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
