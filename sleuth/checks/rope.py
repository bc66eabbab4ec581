"""`dflash.rope_matches_target`: the drafter rotates queries and keys exactly as the target does.

The drafter's context K/V are projections of the target's hidden states at the target's positions, and
its block sits at anchor + j: both only line up if the drafter's rotary embedding is the target's (theta,
scaling type and factors, the rotated fraction `partial_rotary_factor`, head dim). speculators #613 /
#738: `partial_rotary_factor` ignored in training gave good validation and poor served acceptance.

Read from both configs: the drafter's (ours and z-lab's: the top-level config of the exported directory;
speculators': `transformer_layer_config`; a training run directory: run.json `drafter`, the rotary settings
the run trained with, the rotated width read off the module's frequencies) against the target's /
verifier's config.json. Both the
transformers 4 layout (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`, possibly per layer type)
are understood.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sleuth.checks.context import ContractContext, read_json, text_config
from sleuth.findings import Evidence, Finding, Fix

ID = "dflash.rope_matches_target"
_DEFAULT_THETA = 10000.0


def rope_settings(config: dict[str, Any]) -> dict[str, Any]:
    """Canonical rotary settings: theta, type, scaling factors, partial_rotary_factor, head_dim."""
    config = text_config(config)
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per layer type (Gemma 3): the drafter's layers are full attention
    params = dict(params) if isinstance(params, dict) else {}
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    theta = params.pop("rope_theta", config.get("rope_theta", _DEFAULT_THETA))
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    partial = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads and config.get("hidden_size") else None)
    factors = {k: v for k, v in sorted(params.items()) if v is not None}
    return {
        "rope_theta": float(theta) if isinstance(theta, (int, float)) else theta,
        "rope_type": rope_type,
        "scaling": factors,
        "partial_rotary_factor": float(partial) if isinstance(partial, (int, float)) else partial,
        "head_dim": head_dim,
    }


def drafter_config(config: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
    """The drafter's own model config inside a drafter config.json, and where it sits."""
    if not config:
        return None, ""
    layer = config.get("transformer_layer_config")
    if isinstance(layer, dict):
        return layer, "transformer_layer_config"
    if any(k in config for k in ("rope_theta", "rope_parameters", "rope_scaling", "head_dim")):
        return config, "config.json"
    return None, ""


def run_drafter_record(ctx: ContractContext) -> tuple[dict[str, Any] | None, str]:
    """run.json `drafter` of a training run directory (run-directory contract), and where it sits."""
    if ctx.run is None or not isinstance(ctx.run.run_json, dict):
        return None, ""
    record = ctx.run.run_json.get("drafter")
    if isinstance(record, dict) and any(k in record for k in ("rope_parameters", "rope_theta", "head_dim")):
        return record, "drafter"
    return None, ""


def check_rope_matches_target(ctx: ContractContext) -> Finding:
    draft, where = drafter_config(ctx.config)
    draft_file = ctx.config_source or "config.json"
    if draft is None:
        draft, where = run_drafter_record(ctx)
        draft_file = str(ctx.run.path / "run.json") if draft is not None and ctx.run is not None else draft_file
    if draft is None:
        reason = ("neither the config nor the run records the drafter's rotary settings (run.json `drafter`, "
                  "a drafter config.json or speculators' transformer_layer_config)")
        return ctx.finding(ID, "unknown", reason=reason)
    target_dir, source = ctx.resolve_target_dir()
    target_config = read_json(target_dir / "config.json") if target_dir is not None else None
    if target_config is None:
        why = source if target_dir is None else f"{target_dir / 'config.json'} is missing or unreadable"
        return ctx.finding(ID, "unknown", reason=f"the target's config was not read: {why}")
    ours, theirs = rope_settings(draft), rope_settings(target_config)
    differing = [k for k in ours if ours[k] != theirs[k]]
    location = f"{draft_file}: {where}"
    evidence = [
        Evidence(kind="config", location=location, value=_describe(ours)),
        Evidence(kind="config", location=str(Path(target_dir) / "config.json"), value=_describe(theirs)),
    ]
    expected = f"the target's rotary settings ({_describe(theirs)})"
    if not differing:
        return ctx.finding(ID, "match", expected=expected, observed=_describe(ours), evidence=evidence, confidence=0.9)
    observed = "; ".join(f"{k} {ours[k]!r} (target {theirs[k]!r})" for k in differing)
    patch = {k: theirs[k] for k in differing if k in ("rope_theta", "partial_rotary_factor", "head_dim")}
    return ctx.finding(
        ID, "mismatch", expected=expected, observed=observed, evidence=evidence, confidence=0.95,
        reason="the drafter's positions do not line up with the target's features: acceptance drops at serving",
        fix=Fix(config_patch={}, applicability="unsafe",
                code_hint="Build the drafter's rotary embedding from the target's config (copy "
                f"{', '.join(differing)}: {patch or 'the scaling settings'}) and retrain."),
    )


def _describe(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())
