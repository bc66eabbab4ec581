"""What z-lab's DFlashDraftModel builds from an exported config.json, for the tests (not z-lab's code).

Written from reading z-lab/dflash dflash/model.py @ 44947fb (the inference code of the published drafters):
the config is transformers' Qwen3Config (`config_class = Qwen3Config`, model_type qwen3), and from it
    layer windows     `config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None`
                      (Qwen3DFlashAttention.__init__)
    heads             num_attention_heads, num_key_value_heads, head_dim = getattr(config, "head_dim", H // heads)
    target layers     dflash_config.get("target_layer_ids", build_target_layer_ids(num_target_layers, layers))
    block, mask       config.block_size, dflash_config.get("mask_token_id")
    rotary            Qwen3RotaryEmbedding(config): the rotated width and base are read off its inv_freq
Qwen3Config itself applies transformers' gates: sliding_window is kept only with use_sliding_window true.
"""

from __future__ import annotations

from typing import Any



def zlab_reads(config_json: dict[str, Any]) -> dict[str, Any]:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = Qwen3Config.from_dict(dict(config_json))
    dflash = dict(getattr(config, "dflash_config", None) or {})
    windows = [config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = Qwen3RotaryEmbedding(config).inv_freq  # [rotary_dim / 2]
    return {
        "layer_windows": windows,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": head_dim,
        "rotary_dim": 2 * inv_freq.numel(),
        "inv_freq": inv_freq,
        "rope_theta": float(config.rope_parameters["rope_theta"]),
        "rope_type": config.rope_parameters.get("rope_type", "default"),
        "target_layer_ids": dflash.get("target_layer_ids"),
        "block_size": getattr(config, "block_size", None),
        "mask_token_id": dflash.get("mask_token_id"),
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "intermediate_size": config.intermediate_size,
    }
