"""A drafter as it trained and as serving builds it: the two sides of `dflash.sliding_window_served` and
`dflash.rope_served_as_trained`.

As trained (read off the modules by the trainer, never from a config it may ignore):
    * a training run directory: run.json `drafter` (docs/reference/run-directory.md): `rope_parameters`,
      `rotary_dim` / `head_dim` (the rotated width from the rotary embedding's frequencies), `rope_layout`,
      `layer_types` and `layer_windows` (each attention module's window, null = full attention),
      `sliding_window_non_causal`;
    * an export made by `trainer export`: the same record under config.json `dflash_training.drafter`.
As served: the drafter's layer config (a z-lab config.json itself, speculators' `transformer_layer_config`;
for a training run, run.json `drafter.draft_config`, the config its exports write), read the way the loaders
build it:
    * transformers' Qwen3Config (z-lab's DFlashDraftModel config class, speculators' layer config, vLLM's
      hf_config): `sliding_window` is set to None unless `use_sliding_window` is true, and `layer_types`, when
      absent, slides layers i >= `max_window_layers` (default 28) only; a layer is then windowed iff its type
      is sliding_attention and the window survived (z-lab model.py Qwen3DFlashAttention, speculators
      model_definitions.py). speculators' sliding layers attend causally within the block unless its
      top-level `sliding_window_non_causal`;
    * RoPE: theta, type and scaling from `rope_parameters` (transformers 5) or `rope_theta` / `rope_scaling`;
      vLLM rotates `partial_rotary_factor` of each head and builds mRoPE from `mrope_section`; its DFlash
      drafter reads the pair layout from `is_neox_style` (default neox since vLLM PR #54373; between #51655
      and it, the target's was taken: vLLM #53063).
Import-light: plain dicts, no torch, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sleuth.checks.context import ContractContext, int_or_none
from sleuth.probes.exported import DEFAULT_ROPE_THETA, number_or_none, rope_params

SLIDING = "sliding_attention"
QWEN3_MAX_WINDOW_LAYERS = 28  # transformers Qwen3Config's default


@dataclass
class Side:
    """One side of the comparison: the values and where they were read."""

    values: dict[str, Any]
    where: str
    notes: list[str] = field(default_factory=list)


def layer_config(config: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
    """The drafter's own layer config inside a drafter config.json, and its key path."""
    if not isinstance(config, dict):
        return None, ""
    layer = config.get("transformer_layer_config")
    if isinstance(layer, dict):
        return layer, "transformer_layer_config"
    if isinstance(config.get("dflash_config"), dict) or config.get("model_type") == "qwen3":
        return config, "config.json"
    return None, ""


def trained_record(ctx: ContractContext) -> tuple[dict[str, Any] | None, str]:
    """The drafter as it trained: run.json `drafter`, or an export's `dflash_training.drafter`."""
    if ctx.run is not None and isinstance(ctx.run.run_json, dict) and isinstance(ctx.run.run_json.get("drafter"), dict):
        record = ctx.run.run_json["drafter"]
        if record:
            return record, f"{ctx.run.path / 'run.json'}: drafter"
    training = (ctx.config or {}).get("dflash_training")
    if isinstance(training, dict) and isinstance(training.get("drafter"), dict):
        return training["drafter"], f"{ctx.config_source or 'config.json'}: dflash_training.drafter"
    return None, ""


def served_config(ctx: ContractContext) -> tuple[dict[str, Any] | None, dict[str, Any], str]:
    """(layer config, top-level config, where) of what serving builds: an export's (or a foreign run's)
    drafter config, else a training run's run.json `drafter.draft_config` (what its exports write)."""
    layer, where = layer_config(ctx.config)
    if layer is not None:
        return layer, ctx.config or {}, f"{ctx.config_source or 'config.json'}: {where}"
    record, record_where = trained_record(ctx)
    draft = (record or {}).get("draft_config")
    if isinstance(draft, dict):
        top = {"sliding_window_non_causal": record.get("sliding_window_non_causal")}
        return draft, top, f"{record_where}.draft_config"
    return None, {}, ""


# --- attention ------------------------------------------------------------------------------------------


@dataclass
class Attention:
    windows: list[int | None]  # per layer, as built; None = full attention
    declared: list[int | None]  # per layer, as the file states it before transformers' gates
    non_causal: bool | None  # sliding layers bidirectional within the block; None = not stated
    gate: str | None = None  # why declared and built differ


def served_attention(layer: dict[str, Any], top: dict[str, Any]) -> Attention:
    layers = int_or_none(layer.get("num_hidden_layers")) or len(layer.get("layer_types") or [])
    raw_window = int_or_none(layer.get("sliding_window"))
    use = layer.get("use_sliding_window", False) is True
    window = raw_window if use else None  # Qwen3Config.__post_init__
    types = layer.get("layer_types")
    gates: list[str] = []
    if raw_window is not None and not use:
        gates.append(f"use_sliding_window is {layer.get('use_sliding_window', 'absent')!s}: transformers' "
                     f"Qwen3Config then sets sliding_window {raw_window} to None")
    if isinstance(types, list) and types:
        declared_types, built_types = list(types), list(types)
    else:  # Qwen3Config derives them: layers i >= max_window_layers slide, when a window survived
        threshold = int_or_none(layer.get("max_window_layers"))
        threshold = QWEN3_MAX_WINDOW_LAYERS if threshold is None else threshold
        derived = [SLIDING if i >= threshold else "full_attention" for i in range(layers)]
        built_types = derived if window is not None else ["full_attention"] * layers
        declared_types = derived if raw_window is not None else ["full_attention"] * layers
        if raw_window is not None and SLIDING not in derived:
            # a window and no layer types: meant for the layers, and Qwen3Config slides none of them
            declared_types = [SLIDING] * layers
            gates.append(f"layer_types is absent and max_window_layers {threshold} >= the {layers} layers: "
                         "Qwen3Config slides none of them")
    declared = [raw_window if t == SLIDING else None for t in declared_types]
    built = [window if t == SLIDING else None for t in built_types]
    non_causal = top.get("sliding_window_non_causal", layer.get("sliding_window_non_causal"))
    return Attention(built, declared, non_causal if isinstance(non_causal, bool) else None,
                     "; ".join(gates) if declared != built else None)


def trained_attention(record: dict[str, Any]) -> tuple[list[int | None] | None, bool | None]:
    windows = record.get("layer_windows")
    if not isinstance(windows, list) or not all(w is None or int_or_none(w) is not None for w in windows):
        return None, None
    non_causal = record.get("sliding_window_non_causal")
    return windows, non_causal if isinstance(non_causal, bool) else None


def describe_windows(windows: list[int | None]) -> str:
    if not any(windows):
        return f"{len(windows)} full-attention layers"
    return "[" + ", ".join("full" if w is None else f"window {w}" for w in windows) + "]"


# --- RoPE (the served side: sleuth.probes.exported.served_rope) ------------------------------------------


def trained_rope(record: dict[str, Any]) -> dict[str, Any] | None:
    """What the drafter rotated in training (run.json `drafter`); None without a rotated width."""
    head_dim, rotary_dim = int_or_none(record.get("head_dim")), int_or_none(record.get("rotary_dim"))
    if not head_dim or rotary_dim is None:
        return None
    params = rope_params(record)
    theta = params.pop("rope_theta", DEFAULT_ROPE_THETA)
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    params.pop("partial_rotary_factor", None)
    mrope = params.pop("mrope_section", None)
    params.pop("mrope_interleaved", None)
    return {
        "rope_theta": number_or_none(theta) if number_or_none(theta) is not None else theta,
        "rope_type": rope_type,
        "scaling": {k: v for k, v in sorted(params.items()) if v is not None},
        "partial_rotary_factor": rotary_dim / head_dim,
        "mrope_section": list(mrope) if isinstance(mrope, list) else None,
        "rope_layout": record.get("rope_layout") if isinstance(record.get("rope_layout"), str) else None,
        "head_dim": head_dim,
    }

