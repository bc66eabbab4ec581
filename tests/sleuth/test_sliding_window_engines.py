"""`dflash.sliding_window_served` per serving engine (`sleuth diagnose --served-by ENGINE`): an export whose
config is right is still not served as trained by an engine that counts the window elsewhere (z-lab 0.1.0,
SGLang: from each query) or ignores it (SpecForge's loop); the finding quotes the run's measured loss or
predicts it, and the fix names the engine and its setting or says none exists. Silent for a full-attention
drafter and for an engine that builds the window as trained."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.checks.context import ContractContext
from sleuth.checks.engines import EngineError, load_engines, resolve_engine
from sleuth.checks.sliding_window import check_sliding_window_served

REPO = Path(__file__).resolve().parents[2]
TYPES = ["sliding_attention"] * 4 + ["full_attention"]
MEASURED = {  # an eval.json `served_by_engine`, as the run's final eval writes it (copied into the export)
    "speculators": {"tau": 3.84, "verify_steps": 134, "lossless": True, "serves_as_trained": True,
                    "same_semantics_as": []},
    "zlab": {"tau": 3.25, "verify_steps": 151, "lossless": True, "serves_as_trained": False,
             "same_semantics_as": ["sglang"]},
    "sglang": {"tau": 3.25, "verify_steps": 151, "lossless": True, "serves_as_trained": False,
               "same_semantics_as": ["zlab"]},
    "specforge": {"tau": 2.20, "verify_steps": 229, "lossless": True, "serves_as_trained": False,
                  "same_semantics_as": []},
}


def export_config(sliding: bool = True, measured: dict | None = None) -> dict:
    """An export's config.json in z-lab's layout, as `trainer export` writes it (config and training record)."""
    windows = [32 if t == "sliding_attention" else None for t in TYPES] if sliding else [None] * 5
    config = {"model_type": "qwen3", "num_hidden_layers": 5, "dflash_config": {"mask_token_id": 5},
              "layer_types": TYPES if sliding else ["full_attention"] * 5, "sliding_window": 32 if sliding else None,
              "use_sliding_window": sliding, "max_window_layers": 5,
              "dflash_training": {"drafter": {"layer_windows": windows, "window_origin": "anchor" if sliding else None,
                                              "sliding_window_non_causal": False if sliding else None}}}
    if measured is not None:
        config["dflash_training"]["served_by_engine"] = copy.deepcopy(measured)
    return config


def check(config: dict, served_by: str | None = None):
    return check_sliding_window_served(ContractContext(config=config, config_source="export/config.json",
                                                       served_by=served_by))


def test_the_table_is_the_one_trainer_eval_decodes_with():
    engines = load_engines()
    assert {"speculators", "zlab", "sglang", "specforge", "ik_llama.cpp"} <= set(engines)
    assert resolve_engine("vLLM").key == "speculators" and resolve_engine("z-lab").key == "zlab"
    assert all(engine.read_from and engine.version for engine in engines.values())  # each row names its source
    with pytest.raises(EngineError, match="unknown serving engine 'trt'"):
        resolve_engine("trt")


def test_an_engine_that_counts_from_the_query_is_flagged_with_the_measured_loss():
    finding = check(export_config(measured=MEASURED), "zlab")
    assert finding.status == "mismatch"
    assert "served by z-lab dflash" in finding.observed and "dflash 0.1.0" in finding.observed
    assert any(e.kind == "reference" and "_attention_mask" in e.value for e in finding.evidence)  # the code read
    assert "counts the window from each query" in finding.observed
    assert "tau 3.25 vs 3.84 as trained, 151 vs 134 verify steps" in finding.observed
    assert "none exists" in finding.fix.code_hint and "vLLM / speculators" in finding.fix.code_hint
    assert any(e.kind == "metrics" and "served_by_engine" in e.location for e in finding.evidence)


def test_without_a_measurement_the_loss_is_predicted_and_the_fix_names_the_engines_setting():
    finding = check(export_config(), "specforge")
    assert finding.status == "mismatch" and "ignores the window" in finding.observed
    assert "predicted: acceptance falls" in finding.observed and "measured" not in finding.observed
    llama = check(export_config(), "ik_llama.cpp")  # block causality undocumented; the origin alone differs
    assert llama.status == "mismatch" and "PR #2021" in llama.fix.code_hint


@pytest.mark.parametrize("engine", ["vllm", "speculators"])
def test_an_engine_that_builds_the_window_as_trained_is_silent(engine):
    finding = check(export_config(measured=MEASURED), engine)
    assert finding.status == "match" and "builds them as trained" in finding.observed
    assert not any("NOT served" in note for note in finding.notes)


@pytest.mark.parametrize("engine", [None, "zlab", "specforge"])
def test_a_full_attention_drafter_is_served_as_trained_everywhere(engine):
    finding = check(export_config(sliding=False), engine)
    assert finding.status == "match" and finding.notes == []


def test_without_served_by_the_notes_name_who_serves_it_as_trained_and_who_does_not():
    finding = check(export_config(measured=MEASURED))
    assert finding.status == "match"
    notes = " ".join(finding.notes)
    assert "served as trained by: vLLM / speculators" in notes
    assert "NOT served as trained by: z-lab" in notes and "tau 2.20 vs 3.84" in notes and "--served-by" in notes


def test_a_window_dropped_from_the_config_is_still_the_first_problem():
    config = export_config()
    config["use_sliding_window"] = False
    finding = check(config, "zlab")
    assert finding.status == "mismatch" and "use_sliding_window" in finding.observed


def test_an_unknown_engine_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", "--run", str(tmp_path), "--served-by",
                           "trt", "--offline", "--no-probe"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "--served-by: unknown serving engine 'trt'" in done.stderr and "Traceback" not in done.stderr


def test_a_measurement_without_loss_is_quoted_as_such_and_weighs_less():
    measured = copy.deepcopy(MEASURED)
    measured["zlab"].update(tau=3.84, verify_steps=134)
    finding = check(export_config(measured=measured), "zlab")
    assert finding.status == "mismatch" and "no loss on those prompts" in finding.observed
    assert finding.confidence < check(export_config(measured=MEASURED), "zlab").confidence
