"""sleuth judges run.json's target_fidelity record (dflash.target_forward_fidelity) against its tolerance.

Runs come from the real trainer (a two-step run on a tiny gpt-oss, whose sliding window the "positions"
packing drops) and from hand-written run directories for what the trainer no longer writes: no record at
all (an older trainer), and a record whose `passed` contradicts its own numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sleuth.invariants import check_invariants, load_playbook
from sleuth.trace import Trace

PLAYBOOK = load_playbook("dflash")
RULE = "dflash.target_forward_fidelity"
TARGET = {"path": "/models/t", "num_layers": 4, "hidden_size": 32, "vocab_size": 64}


def finding_for(run_dir: Path):
    config = json.loads((run_dir / "config.json").read_text())
    findings = check_invariants(PLAYBOOK, reference=None, config=config, config_source=str(run_dir / "config.json"),
                                checkpoint=None, code=None, trace=Trace())
    return {f.id: f for f in findings}[RULE]


def write_run(tmp_path: Path, run: dict) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"block_size": 4}))
    (run_dir / "run.json").write_text(json.dumps(run))
    return run_dir


def test_a_run_without_the_record_is_unknown_and_says_why(tmp_path):
    finding = finding_for(write_run(tmp_path, {"target": TARGET}))
    assert finding.status == "unknown"
    assert "no target_fidelity record" in finding.reason and "never measured" in finding.reason


def test_no_run_json_is_unknown(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"block_size": 4}))
    finding = finding_for(run_dir)
    assert finding.status == "unknown" and "run.json" in finding.reason


def test_a_record_is_judged_by_its_numbers_not_its_passed_flag(tmp_path):
    record = {"max_abs_hidden_diff": 0.5, "max_abs_logit_diff": 0.01, "tolerance": 0.001, "tokens": 42, "passed": True}
    finding = finding_for(write_run(tmp_path, {"target": TARGET, "target_fidelity": record}))
    assert finding.status == "mismatch" and finding.observed == "above tolerance"
    assert any("passed=True" in note for note in finding.notes)
    assert any(e.location.endswith("run.json:target_fidelity") for e in finding.evidence)


def test_a_check_shorter_than_the_window_is_noted(tmp_path):
    record = {"max_abs_hidden_diff": 1e-6, "max_abs_logit_diff": 1e-7, "tolerance": 0.001, "tokens": 200,
              "longest_window": 4096, "passed": True}
    finding = finding_for(write_run(tmp_path, {"target": TARGET, "target_fidelity": record}))
    assert finding.status == "match"
    assert any("not longer than the target's window" in note for note in finding.notes)


@pytest.mark.slow
def test_sleuth_flags_a_real_run_that_dropped_the_window_and_passes_a_real_exact_one(tmp_path):
    from tests.trainer.tiny_targets import save_family_target
    from trainer.config import build_config
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir
    from trainer.target.embedded import build_embedded_tokenizer

    target = save_family_target("gpt_oss", tmp_path / "target", build_embedded_tokenizer(small=True))
    common = dict(target=str(target), data="embedded", steps=1, batch_size=2, seq_len=48, draft_layers=2, block_size=4,
                  max_anchors=2, eval_prompts=1, eval_max_new_tokens=4, eval_every=None, warmup_steps=0)
    dropped = RunDir(tmp_path / "runs" / "dropped")
    train(dropped, build_config(extra={**common, "target_packing": "positions", "allow_target_fidelity_failure": True}),
          preset=None, device="cpu", progress=False)
    exact = RunDir(tmp_path / "runs" / "exact")
    train(exact, build_config(extra=common), preset=None, device="cpu", progress=False)

    flagged = finding_for(dropped.path)
    assert flagged.status == "mismatch" and flagged.observed == "above tolerance"
    assert flagged.fix is not None and flagged.fix.config_patch == {"target_packing": "auto",
                                                                    "allow_target_fidelity_failure": False}
    assert finding_for(exact.path).status == "match"
