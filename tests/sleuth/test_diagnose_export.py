"""sleuth diagnoses a drafter exported for serving (z-lab or speculators layout) from its config.json and
the shapes in model.safetensors alone: no run.json, no metrics, no code."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

from sleuth.commands.diagnose import app

H = 16


# The draft layers' config, small; every tensor the loaders read is written with the shape they build
# (dflash.export_contract checks names and shapes, so a partial file would be a finding of its own).
LAYER_CONFIG = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": H, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 32, "vocab_size": 64}


def draft_tensors(k: int) -> dict[str, np.ndarray]:
    hd, heads, kv, inter = 8, 2, 1, 32
    tensors = {"fc.weight": np.zeros((H, k * H), np.float32), "hidden_norm.weight": np.ones(H, np.float32),
               "norm.weight": np.ones(H, np.float32)}
    for i in range(LAYER_CONFIG["num_hidden_layers"]):
        shapes = {"self_attn.q_proj.weight": (heads * hd, H), "self_attn.k_proj.weight": (kv * hd, H),
                  "self_attn.v_proj.weight": (kv * hd, H), "self_attn.o_proj.weight": (H, heads * hd),
                  "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
                  "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
                  "mlp.gate_proj.weight": (inter, H), "mlp.up_proj.weight": (inter, H), "mlp.down_proj.weight": (H, inter)}
        tensors.update({f"layers.{i}.{name}": np.zeros(shape, np.float32) for name, shape in shapes.items()})
    return tensors


def write_export(path: Path, layer_ids: list[int], *, speculators: bool = False, num_target_layers: int = 8) -> Path:
    path.mkdir(parents=True)
    k = len(layer_ids)
    if speculators:  # vLLM's convention counts the embeddings as layer 0
        config = {"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": [i + 1 for i in layer_ids],
                  "block_size": 8, "num_target_layers": num_target_layers, "mask_token_id": 3,
                  "transformer_layer_config": LAYER_CONFIG}
    else:
        config = {**LAYER_CONFIG, "num_target_layers": num_target_layers,
                  "dflash_config": {"target_layer_ids": layer_ids, "block_size": 8, "mask_token_id": 3}}
    (path / "config.json").write_text(json.dumps(config))
    save_file(draft_tensors(k), str(path / "model.safetensors"))
    return path


def diagnose(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, dict]:
    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["--run", str(path), "--offline", "--format", "json"])
    report = json.loads(result.stdout)
    return result.exit_code, {f["id"]: f for f in report["findings"]}


@pytest.mark.parametrize("speculators", [False, True])
def test_an_export_of_the_reference_layers_is_clean(tmp_path, monkeypatch, speculators):
    export = write_export(tmp_path / "fixed", [1, 2, 3, 4, 5], speculators=speculators)
    code, findings = diagnose(export, tmp_path, monkeypatch)
    assert code == 0
    assert findings["dflash.target_layer_ids"]["status"] == "match"
    assert findings["dflash.fc_input_layers"]["status"] == "match"  # fc.weight [H, 5H] reads all 5 ids


@pytest.mark.parametrize("speculators", [False, True])
def test_an_export_of_v5_is_flagged_from_shapes_and_config(tmp_path, monkeypatch, speculators):
    # v5 fed fc 4 of the 5 selected layers: the export names exactly those 4, which no rule selects.
    export = write_export(tmp_path / "v5", [1, 2, 3, 4], speculators=speculators)
    code, findings = diagnose(export, tmp_path, monkeypatch)
    assert code == 1
    layer_ids = findings["dflash.target_layer_ids"]
    assert layer_ids["status"] == "mismatch"
    assert "[1, 2, 3, 4]" in layer_ids["observed"]
    evidence = " ".join(e["location"] for e in layer_ids["evidence"])
    assert "target_layer_ids" in evidence or "aux_hidden_state_layer_ids" in evidence
    # Training-only invariants cannot be read from an export: unknown, never a guess.
    assert findings["dflash.loss_decay_gamma"]["status"] == "unknown"
    assert findings["dflash.context_excludes_anchor"]["status"] == "unknown"
