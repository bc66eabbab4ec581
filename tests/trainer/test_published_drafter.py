"""The `zlab-qwen3.6` presets against the published Qwen3.6-27B drafter (tests/fixtures/published/, the public
config values): at real size, our export's config is the published one field by field; at CPU size, the
structure is the same. That z-lab's own package (dflash 0.1.0) and SpecForge build the same drafter from both runs
their code: tests/parity/test_zlab_package_reads.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainer.config import PRESETS, build_config, default_target_layer_ids, resolve_for_target

PUBLISHED = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "published" / "qwen3.6-27b-dflash.json")
                       .read_text())
# what the drafter's own shape decides; vocabulary and width are the target's, compared as well
STRUCTURE = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
             "layer_types", "sliding_window", "use_sliding_window", "rope_theta", "rope_scaling", "block_size",
             "num_target_layers", "model_type", "architectures", "hidden_size", "vocab_size", "hidden_act",
             "rms_norm_eps", "attention_bias", "tie_word_embeddings", "max_position_embeddings")


def real_target_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**PUBLISHED["target"])


def exported_config(preset: str, target_config, mask_token_id: int) -> dict:
    """config.json as `trainer export --format zlab` writes it for this preset on this target (no weights needed)."""
    from trainer.export import DrafterSpec, zlab_config
    from trainer.model.drafter import draft_config_from_target

    layers = target_config.num_hidden_layers
    config = resolve_for_target(build_config(preset=preset), layers)
    draft = draft_config_from_target(target_config, config.draft_layers, config.draft_config.as_shape())
    spec = DrafterSpec(draft_config=draft, target_layer_ids=config.fc_layer_ids(layers), num_target_layers=layers,
                       block_size=config.block_size, mask_token_id=mask_token_id, target_path="",
                       target_architectures=[])
    return zlab_config(spec, torch.bfloat16)


def test_real_size_export_is_the_published_config_field_by_field():
    published = PUBLISHED["drafter"]
    # the mask id is the target tokenizer's (not part of the fixture's target); given as published
    ours = exported_config("zlab-qwen3.6-27b", real_target_config(), published["dflash_config"]["mask_token_id"])
    differ = {key: (ours.get(key), published[key]) for key in STRUCTURE if ours.get(key) != published[key]}
    assert differ == {}
    for key, value in published["dflash_config"].items():
        assert ours["dflash_config"][key] == value, key
    # the target's head layout stays out: no partial rotary, no mRoPE sections anywhere in the drafter's config
    assert ours["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    assert "partial_rotary_factor" not in json.dumps(ours) and "mrope" not in json.dumps(ours)


def test_cpu_preset_keeps_the_published_structure():
    tiny, real = PRESETS["zlab-qwen3.6"], PRESETS["zlab-qwen3.6-27b"]
    t, r = tiny["draft_config"], real["draft_config"]
    assert (tiny["block_size"], tiny["draft_layers"]) == (real["block_size"], real["draft_layers"]) == (16, 5)
    assert t["layer_types"] == r["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert t["num_attention_heads"] // t["num_key_value_heads"] == r["num_attention_heads"] // r["num_key_value_heads"] == 4
    assert t["rope_parameters"] == r["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    assert tiny["block_size"] <= t["sliding_window"] < tiny["seq_len"]  # decoding runs past the window
    # both leave the layer ids to the rule: 64 layers -> the published taps, the 8-layer target -> z-lab's rule too
    assert "target_layer_ids" not in tiny and "target_layer_ids" not in real
    assert default_target_layer_ids(64, 5) == PUBLISHED["drafter"]["dflash_config"]["target_layer_ids"]
    assert default_target_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    # the mask token is the target's (its tokenizer's), never set by a preset
    assert "mask_token_id" not in tiny and "mask_token_id" not in real
