"""Tiny DFlash-family exports, written as the upstream loaders read them: a config.json in speculators' flat layout
(speculators 0.9.0 models/dflash2/config.py, models/dspark/config.py) or z-lab's / SpecForge's nested
`dflash_config`, and a model.safetensors with every tensor the loader builds at its shape (H 16, V 64, B 8).

`clean(variant, layout)` is a drafter as the reference writes it; each planted defect in the tests changes one
field or one tensor of it, so a finding on the clean one is a false alarm and a silence on a defect a miss."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

H, V, B = 16, 64, 8
LAYERS = 2
LAYER_CONFIG = {"model_type": "qwen3", "num_hidden_layers": LAYERS, "hidden_size": H, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 32, "vocab_size": V}
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2048, "use_sliding_window": True}


def base_shapes(k: int = 1) -> dict[str, list[int]]:
    """The DFlash backbone every variant shares (what dflash.export_contract reads)."""
    hd, heads, kv, inter = 8, 2, 1, 32
    shapes = {"fc.weight": [H, k * H], "hidden_norm.weight": [H], "norm.weight": [H]}
    per_layer = {"self_attn.q_proj.weight": [heads * hd, H], "self_attn.k_proj.weight": [kv * hd, H],
                 "self_attn.v_proj.weight": [kv * hd, H], "self_attn.o_proj.weight": [H, heads * hd],
                 "self_attn.q_norm.weight": [hd], "self_attn.k_norm.weight": [hd], "input_layernorm.weight": [H],
                 "post_attention_layernorm.weight": [H], "mlp.gate_proj.weight": [inter, H],
                 "mlp.up_proj.weight": [inter, H], "mlp.down_proj.weight": [H, inter]}
    for i in range(LAYERS):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def dflash2_shapes(k: int = 2, g: int = 8, rank: int = 4) -> dict[str, list[int]]:
    shapes = base_shapes()
    for i in range(LAYERS):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = [2, k, H]
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = [2 * k * (H // g), H]
    shapes.update({"candidate_selector.predecessor_codebook": [V, rank],
                   "candidate_selector.successor_codebook": [V, rank],
                   "candidate_selector.hidden_projection.weight": [rank, H]})
    return shapes


def dspark_shapes(rank: int = 4, with_markov: bool = True) -> dict[str, list[int]]:
    shapes = base_shapes()
    shapes.update({"markov_head.markov_w1.weight": [V, rank], "markov_head.markov_w2.weight": [V, rank],
                   "confidence_head.proj.weight": [1, H + (rank if with_markov else 0)],
                   "confidence_head.proj.bias": [1]})
    return shapes


def _speculators(kind: str, architecture: str, anchor_first: bool, **fields: Any) -> dict[str, Any]:
    return {"speculators_model_type": kind, "architectures": [architecture], "transformer_layer_config": dict(LAYER_CONFIG),
            "draft_vocab_size": V, "block_size": B, "aux_hidden_state_layer_ids": [3], "mask_token_id": 3,
            "num_target_layers": 4, "sample_from_anchor": anchor_first,
            "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": B if anchor_first else B - 1}]},
            **fields}


def _nested(architecture: str, **dflash: Any) -> dict[str, Any]:
    return {**LAYER_CONFIG, "architectures": [architecture], "num_target_layers": 4,
            "dflash_config": {"block_size": B, "mask_token_id": 3, "target_layer_ids": [2], **dflash}}


def clean(variant: str, layout: str = "flat") -> tuple[dict[str, Any], dict[str, list[int]]]:
    """(config.json, {tensor: shape}) of a correct export."""
    if variant == "dflash2" and layout == "flat":
        return _speculators("dflash2", "DFlash2DraftModel", False, sliding_window_non_causal=True, conv_kernel_size=2,
                            conv_group_size=8, selector_rank=4, selector_top_k=4), dflash2_shapes()
    if variant == "dflash2":
        config = _nested("DFlash2DraftModel", conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=4)
        config.update({**SLIDING, "is_causal": False})
        return config, dflash2_shapes()
    if variant == "dspark" and layout == "flat":
        return _speculators("dspark", "DSparkSpeculator", True, sliding_window_non_causal=False, markov_rank=4,
                            markov_head_type="vanilla", enable_confidence_head=True,
                            confidence_head_with_markov=True), dspark_shapes()
    if variant == "dspark":
        return _nested("DFlashDraftModel", projector_type="dspark", sample_from_anchor=True, markov_rank=4,
                       enable_confidence_head=True, confidence_head_with_markov=True), dspark_shapes()
    if variant == "domino":
        shapes = {**base_shapes(), "prefix_gru.weight_ih_l0": [3 * 8, H], "prefix_gru.weight_hh_l0": [3 * 8, 8],
                  "embed_proj.0.weight": [8, H + 8], "embed_proj.2.weight": [V, 8]}
        return _nested("DFlashDraftModel", projector_type="domino", emb_dim=8, gru_hidden_dim=8,
                       pure_draft_prefix_len=1, shift_label=True), shapes
    if variant == "jetspec":
        return _nested("DFlashDraftModel", projector_type="jetspec", causal=True), base_shapes()
    if variant == "dflash":
        return _nested("DFlashDraftModel"), base_shapes()
    raise ValueError(variant)


def planted(variant: str, layout: str, config_edits: dict[str, Any] | None = None,
            tensor_edits: dict[str, list[int] | None] | None = None,
            drop_keys: tuple[str, ...] = ()) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """The clean export with one defect: `config_edits` as dotted keys (`dflash_config.x`), None tensors dropped."""
    config, shapes = clean(variant, layout)
    config = copy.deepcopy(config)
    for dotted, value in (config_edits or {}).items():
        holder = config
        *parents, leaf = dotted.split(".")
        for key in parents:
            holder = holder[key]
        holder[leaf] = value
    for dotted in drop_keys:
        holder = config
        *parents, leaf = dotted.split(".")
        for key in parents:
            holder = holder[key]
        holder.pop(leaf, None)
    for name, shape in (tensor_edits or {}).items():
        if shape is None:
            shapes.pop(name, None)
        else:
            shapes[name] = shape
    return config, shapes


def write_export(path: Path, config: dict[str, Any], shapes: dict[str, list[int]]) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({name: np.zeros(shape, np.float32) for name, shape in shapes.items()}, str(path / "model.safetensors"))
    return path
