"""The engine on our own runs: v5 / v6 / fixed configs, a tiny safetensors checkpoint, our trainer's source.

Config dicts are written out here (sleuth never imports trainer): they mirror a resolved config.json for a
tiny 8-layer target. Our trainer source is copied into the run dir as code/trainer/..., as runs do, and is
only parsed, never imported.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from sleuth.invariants import check_invariants, load_playbook
from sleuth.trace import Trace

REPO = Path(__file__).resolve().parents[2]
NUM_LAYERS, HIDDEN = 8, 16
# These are plain DFlash runs: the invariants scoped to other variants (DFlash2, DSpark, ...) are not checked.
PLAYBOOK_IDS = {i.id for i in load_playbook("dflash").invariants if not i.variants or "dflash" in i.variants}
LAYER_IDS = [1, 2, 3, 4, 5]  # round(1 + i*(8-4)/4) for i < 5

FIXED = {
    "schema_version": 1, "target": "embedded", "data": "embedded", "block_size": 8, "draft_layers": 5,
    "target_layer_ids": LAYER_IDS, "fc_layers": None, "target_logits_source": "final", "loss": "ce",
    "loss_decay_gamma": 4.0, "context_includes_anchor": False, "max_anchors": 32, "mask_token_id": None,
    "optimizer": "adamw", "lr": 0.001, "steps": 300, "batch_size": 8, "seq_len": 256, "seed": 0,
}
PRESETS = {
    "fixed": {},
    "v5": {"fc_layers": [0, 1, 2, 3], "target_logits_source": LAYER_IDS[-1], "loss_decay_gamma": 7.0},
    "v6": {"context_includes_anchor": True},
}
EXPECTED_MISMATCHES = {
    "fixed": set(),
    "v5": {"dflash.fc_input_layers", "dflash.target_logits_source", "dflash.loss_decay_gamma"},
    "v6": {"dflash.context_excludes_anchor"},
}


def make_run(root: Path, preset: str, *, with_code: bool = True) -> Path:
    config = {**FIXED, **PRESETS[preset]}
    run = root / preset
    (run / "checkpoints" / "step-00000300").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(config))
    (run / "run.json").write_text(json.dumps({"name": preset, "preset": preset, "status": "completed",
                                              "target": {"num_layers": NUM_LAYERS, "hidden_size": HIDDEN, "vocab_size": 64}}))
    k = len(config["fc_layers"]) if config["fc_layers"] is not None else len(config["target_layer_ids"])
    tensors = {
        "fc.weight": np.zeros((HIDDEN, k * HIDDEN), np.float32),  # [H, k*H]
        "hidden_norm.weight": np.ones(HIDDEN, np.float32),
        "layers.0.self_attn.k_proj.weight": np.zeros((HIDDEN, HIDDEN), np.float32),
        "norm.weight": np.ones(HIDDEN, np.float32),
    }
    save_file(tensors, str(run / "checkpoints" / "step-00000300" / "drafter.safetensors"))
    if with_code and (REPO / "trainer").is_dir():
        shutil.copytree(REPO / "trainer", run / "code" / "trainer", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return run


def diagnose(run: Path, *, code: bool = True, checkpoint: Path | None = None, trace: Trace | None = None):
    config = json.loads((run / "config.json").read_text())
    return check_invariants(
        load_playbook(), reference=None, config=config, config_source=str(run / "config.json"),
        checkpoint=checkpoint or run / "checkpoints" / "step-00000300" / "drafter.safetensors",
        code=run / "code" if code and (run / "code").exists() else None, trace=trace or Trace(),
    )


@pytest.mark.parametrize("preset", ["v5", "v6", "fixed"])
def test_our_runs_give_exactly_the_planted_mismatches(preset: str, tmp_path: Path):
    run = make_run(tmp_path, preset)
    findings = diagnose(run)
    mismatches = {f.id for f in findings if f.status == "mismatch"}
    assert mismatches == EXPECTED_MISMATCHES[preset], {f.id: (f.status, f.reason) for f in findings if f.status == "mismatch"}
    assert len(findings) == len(PLAYBOOK_IDS) and {f.id for f in findings} == PLAYBOOK_IDS


def test_a_dpace_run_is_not_judged_by_the_gamma_it_does_not_use(tmp_path: Path):
    # recipe-2026's weighting beside a leftover gamma 7 at block 8: D-PACE uses no gamma, so no mismatch; the
    # same gamma under the fixed decay is v5's defect.
    run = make_run(tmp_path, "fixed", with_code=False)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "loss_weighting": "dpace", "loss_decay_gamma": 7.0}))
    gamma = next(f for f in diagnose(run) if f.id == "dflash.loss_decay_gamma")
    assert gamma.status == "match" and gamma.observed == "D-PACE", (gamma.status, gamma.reason)
    assert "one the rule accepts" in gamma.reason
    assert any(e.kind == "config" and e.location.endswith("config.json:loss_weighting") for e in gamma.evidence)
    (run / "config.json").write_text(json.dumps({**config, "loss_weighting": "decay", "loss_decay_gamma": 7.0}))
    assert next(f for f in diagnose(run) if f.id == "dflash.loss_decay_gamma").status == "mismatch"


def test_v5_fixes_are_config_patches_on_our_keys(tmp_path: Path):
    findings = {f.id: f for f in diagnose(make_run(tmp_path, "v5"))}
    assert findings["dflash.fc_input_layers"].fix.config_patch == {"fc_layers": None}
    assert findings["dflash.target_logits_source"].fix.config_patch == {"target_logits_source": "final"}
    assert findings["dflash.loss_decay_gamma"].fix.config_patch == {"loss_decay_gamma": 4.0}
    assert findings["dflash.fc_input_layers"].fix.applicability == "unsafe"  # fc changes shape: retrain
    gamma = findings["dflash.loss_decay_gamma"]
    assert gamma.expected == "4.0" and gamma.observed == "7.0"
    assert any("paper" in note and "7" in note for note in gamma.notes), gamma.notes  # the disagreement is said


def test_v6_fix_and_evidence(tmp_path: Path):
    finding = next(f for f in diagnose(make_run(tmp_path, "v6")) if f.id == "dflash.context_excludes_anchor")
    assert finding.fix.config_patch == {"context_includes_anchor": False}
    kinds = {e.kind for e in finding.evidence}
    assert {"pinned", "config"} <= kinds
    config_evidence = next(e for e in finding.evidence if e.kind == "config")
    assert config_evidence.location.endswith("config.json:context_includes_anchor") and config_evidence.value == "True"


def test_checkpoint_corroborates_fc_and_is_cited(tmp_path: Path):
    finding = next(f for f in diagnose(make_run(tmp_path, "v5")) if f.id == "dflash.fc_input_layers")
    tensor = [e for e in finding.evidence if e.kind == "checkpoint"]
    assert tensor and tensor[0].location.endswith(":fc.weight") and "k=4" in tensor[0].value


def test_checkpoint_contradicting_config_wins(tmp_path: Path):
    run = make_run(tmp_path, "fixed", with_code=False)
    bad = run / "other.safetensors"
    save_file({"fc.weight": np.zeros((HIDDEN, 4 * HIDDEN), np.float32)}, str(bad))  # trained on 4 of 5 layers
    finding = next(f for f in diagnose(run, code=False, checkpoint=bad) if f.id == "dflash.fc_input_layers")
    assert finding.status == "mismatch"
    assert any("checkpoint" in n for n in finding.notes)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_checkpoint_gives_unknown_with_reason_not_mismatch(damage: str, tmp_path: Path):
    run = make_run(tmp_path, "fixed", with_code=False)
    path = run / "checkpoints" / "step-00000300" / "drafter.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x07" * 40, "empty": b""}[damage])
    findings = check_invariants(load_playbook(), reference=None, config=None, config_source=None, checkpoint=path,
                                code=None, trace=Trace())
    by_id = {f.id: f for f in findings}
    assert all(f.status == "unknown" for f in findings)
    assert "unreadable" in by_id["dflash.fc_input_layers"].reason
    # with the config, the config still decides and the note says the checkpoint could not corroborate
    config_findings = {f.id: f for f in diagnose(run, code=False, checkpoint=path)}
    assert config_findings["dflash.fc_input_layers"].status == "match"
    assert any("unreadable" in n for n in config_findings["dflash.fc_input_layers"].notes)


def test_trace_records_each_reading_and_the_deferral_to_config(tmp_path: Path):
    trace = Trace()
    diagnose(make_run(tmp_path, "v6"), trace=trace)
    steps = [(s.step, s.inputs.get("invariant"), s.inputs.get("source"), s.outcome) for s in trace.steps]
    context = [s for s in steps if s[1] == "dflash.context_excludes_anchor"]
    sources = [s[2] for s in context if s[0] == "read-observed"]
    assert sources == ["code", "config"]
    code_step = next(s for s in context if s[2] == "code")
    assert "config-driven" in code_step[3] and "context_includes_anchor" in code_step[3]
    decide = next(s for s in context if s[0] == "decide")
    assert "config" in decide[3]
    assert any(s[0] == "analyse-code" for s in steps) and any(s[0] == "read-checkpoint" for s in steps)


def test_no_inputs_gives_unknown_everywhere_with_reasons():
    findings = check_invariants(load_playbook(), reference=None, config=None, config_source=None, checkpoint=None,
                                code=None, trace=Trace())
    assert {f.status for f in findings} == {"unknown"}
    assert all(f.reason for f in findings)


def test_missing_code_and_checkpoint_paths_are_unknown_not_errors(tmp_path: Path):
    findings = check_invariants(load_playbook(), reference=None, config=None, config_source=None,
                                checkpoint=tmp_path / "absent.safetensors", code=tmp_path / "absent", trace=Trace())
    assert {f.status for f in findings} == {"unknown"}
    fc = next(f for f in findings if f.id == "dflash.fc_input_layers")
    assert "absent" in fc.reason


def test_same_verdict_with_different_counts_is_not_called_agreement(tmp_path: Path):
    run = make_run(tmp_path, "v5", with_code=False)  # config: fc over 4 of 5
    other = run / "other.safetensors"
    save_file({"fc.weight": np.zeros((HIDDEN, 3 * HIDDEN), np.float32)}, str(other))  # weights: 3 of 5
    finding = next(f for f in diagnose(run, code=False, checkpoint=other) if f.id == "dflash.fc_input_layers")
    assert finding.status == "mismatch"
    assert "the checkpoint agrees" not in (finding.reason or "")
    assert any("disagree on the details" in n for n in finding.notes)


def test_fc_indices_outside_the_selected_layers_are_flagged(tmp_path: Path):
    run = make_run(tmp_path, "fixed", with_code=False)
    config = json.loads((run / "config.json").read_text())
    config["fc_layers"] = [0, 1, 2, 3, 4, 5]  # "6 of 5": no trainer could have run this
    (run / "config.json").write_text(json.dumps(config))
    four = run / "four.safetensors"
    save_file({"fc.weight": np.zeros((HIDDEN, 4 * HIDDEN), np.float32)}, str(four))
    finding = next(f for f in diagnose(run, code=False, checkpoint=four) if f.id == "dflash.fc_input_layers")
    assert finding.status == "mismatch"
    assert "the checkpoint agrees" not in (finding.reason or "")
    assert any("indices outside the 5 selected layers" in n for n in finding.notes)
    # With weights that do read all 5 layers, the weights decide, and the broken config is still named.
    finding = next(f for f in diagnose(run, code=False) if f.id == "dflash.fc_input_layers")
    assert finding.status == "match"
    assert any("'invalid'" in n for n in finding.notes)
