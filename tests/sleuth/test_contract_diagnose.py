"""`sleuth diagnose` runs the contract checks: the gap is named with its explanation, the mask token is
read from the run's target, and the trace shows the step."""

from __future__ import annotations

import json

import pytest
from contract_fixtures import save_target, write_run
from test_contract_gap import V5_TAU, V5_TF, eval_report
from typer.testing import CliRunner

from sleuth.commands.diagnose import app

V5_CONFIG = {"target_layer_ids": [1, 2, 3, 4, 5], "fc_layers": [0, 1, 2, 3], "target_logits_source": 5,
             "loss": "ce", "loss_decay_gamma": 4.0, "context_includes_anchor": False, "max_anchors": 32,
             "draft_layers": 5}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("t") / "qwen3", layers=8)


def diagnose(run_dir, tmp_path, monkeypatch, *extra):
    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["--run", str(run_dir), "--offline", "--format", "json", *extra])
    report = json.loads(result.stdout)
    return result.exit_code, {f["id"]: f for f in report["findings"]}, report


def test_v5_gap_is_explained_by_the_logits_source(tmp_path, monkeypatch, target):
    run = write_run(tmp_path / "runs" / "v5", target=target, config=V5_CONFIG, data={"mask_token_count": 0},
                    eval_report=eval_report(V5_TAU, V5_TF))
    code, findings, report = diagnose(run, tmp_path, monkeypatch)
    assert code == 1
    gap = findings["dflash.train_serve_gap"]
    assert gap["status"] == "mismatch"
    assert gap["notes"][0] == "explanation found: dflash.target_logits_source"
    assert findings["dflash.mask_token_distinct"]["status"] == "match"
    assert any(step["step"] == "check-contract" for step in report["trace"])


def test_mask_token_set_to_eos_is_flagged_through_the_cli(tmp_path, monkeypatch, target):
    run = write_run(tmp_path / "runs" / "m", target=target, config={**V5_CONFIG, "target_logits_source": "final",
                                                                    "fc_layers": None, "mask_token_id": 0})
    code, findings, _ = diagnose(run, tmp_path, monkeypatch)
    assert code == 1 and findings["dflash.mask_token_distinct"]["status"] == "mismatch"
    assert findings["dflash.train_serve_gap"]["status"] == "unknown"  # no eval numbers in this run


def test_a_missing_target_or_cache_option_is_one_line_exit_2(tmp_path, monkeypatch):
    run = write_run(tmp_path / "runs" / "r")
    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["--run", str(run), "--offline", "--hidden-states", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "--hidden-states" in result.output and "Traceback" not in result.output
