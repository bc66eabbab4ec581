"""`dflash.rope_served_as_trained`: serving rotates the drafter's queries and keys as training did.

What matters is not the target's rope but the drafter's own, on both sides of the export: the drafter learned
its attention under one rotation (theta, scaling, how much of each head is rotated, 1-D positions, the pair
layout), and a server builds another from the exported config. A published drafter for Qwen3.6-27B rotates
its whole 128-wide head with 1-D positions although its target rotates a quarter of a 256-wide head with
interleaved mRoPE: correct, and no finding. The failures users hit:
    * speculators #613 / #733, DeepSpec #71: the target's `partial_rotary_factor` 0.25 copied into the drafter
      config; training rotated the whole head, vLLM a quarter: acceptance 1.04;
    * speculators PR #1050: the target's `mrope_section` inherited into a drafter trained with 1-D RoPE;
    * vLLM #53063 / PR #54373: the pair layout (`is_neox_style`) taken from the target, not the drafter.

Compared (sleuth/checks/served.py): the drafter's rotation as trained (run.json `drafter`: the rotated width
read off the module's frequencies, theta, scaling, `rope_layout`; or an export's `dflash_training.drafter`)
against what a server builds from the exported layer config (for a training run, run.json
`drafter.draft_config`, the config its exports write).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sleuth.checks.context import ContractContext, read_json, text_config
from sleuth.checks.served import served_config, trained_record, trained_rope
from sleuth.probes.exported import served_rope
from sleuth.findings import Evidence, Finding, Fix

ID = "dflash.rope_served_as_trained"

def _remedy(key: str, trained: Any) -> str:
    """What the exported config should say to serve the trained value of `key`."""
    if key == "partial_rotary_factor" and trained == 1.0:
        return "drop partial_rotary_factor from the drafter config (it rotated the whole head)"
    if key == "mrope_section" and trained is None:
        return "drop mrope_section / mrope_interleaved (the drafter was trained with 1-D positions)"
    if key == "rope_layout":
        return f"set is_neox_style to {trained == 'neox'} (it trained with the {trained} pair layout)"
    if key == "rope_theta":
        return f"set rope_theta and rope_parameters.rope_theta to {trained!r}"
    return f"set {key} to {trained!r}"


def check_rope_served_as_trained(ctx: ContractContext) -> Finding:
    layer, _top, served_where = served_config(ctx)
    record, record_where = trained_record(ctx)
    if layer is None:
        return ctx.finding(ID, "unknown", reason="no drafter layer config to read (an export's config.json, "
                           "speculators' transformer_layer_config, or run.json `drafter.draft_config`)")
    served = served_rope(layer)
    evidence = [Evidence(kind="config", location=served_where, value=f"served: {_describe(served)}")]
    trained = trained_rope(record) if record is not None else None
    expected = "the rotation the drafter trained with: theta, scaling, rotated fraction, 1-D positions, pair layout"
    if trained is None:
        return ctx.finding(ID, "unknown", expected=expected, observed=f"served: {_describe(served)}",
                           evidence=evidence, notes=_target_notes(ctx, served),
                           reason="nothing records how the drafter rotated in training (run.json `drafter` with "
                                  "`rotary_dim`, an export's `dflash_training.drafter`)")
    evidence.append(Evidence(kind="config", location=record_where, value=f"trained: {_describe(trained)}"))
    differing = [key for key in trained if key != "rope_layout" and trained[key] != served[key]]
    if trained["rope_layout"] is not None and trained["rope_layout"] != served["rope_layout"]:
        differing.append("rope_layout")
    if not differing:
        notes = [] if trained["rope_layout"] is not None else [
            "the run does not record its pair layout (rope_layout); only theta, scaling, the rotated fraction and "
            "mRoPE were compared"]
        return ctx.finding(ID, "match", expected=expected, observed=f"{_describe(served)}, trained and served",
                           evidence=evidence, confidence=0.9, notes=notes)
    observed = "; ".join(f"{key} {served[key]!r} served, {trained[key]!r} trained" for key in differing)
    remedies = [_remedy(key, trained[key]) for key in differing]
    return ctx.finding(
        ID, "mismatch", expected=expected, observed=observed, evidence=evidence, confidence=0.95,
        notes=_target_notes(ctx, served),
        reason="the server rotates the drafter's queries and keys differently from training: every attention "
               "score moves and acceptance collapses (speculators #613: 1.04)",
        fix=Fix(config_patch={}, applicability="safe",
                code_hint="Fix the exported drafter config (no retraining: the weights learned the trained "
                          f"rotation): {'; '.join(remedies)}; or re-export with `trainer export`."),
    )


def _target_notes(ctx: ContractContext, served: dict[str, Any]) -> list[str]:
    """Where a served value is the target's own (the copy signature of speculators #613), say so."""
    target_dir, _ = ctx.resolve_target_dir()
    target = read_json(Path(target_dir) / "config.json") if target_dir is not None else None
    if target is None:
        return []
    theirs = served_rope(text_config(target))
    copied = [key for key in ("partial_rotary_factor", "mrope_section") if served[key] == theirs[key]
              and theirs[key] not in (None, 1.0)]
    return [f"the served {key} {served[key]!r} is the target's own: copied from the target's config"
            for key in copied]


def _describe(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items() if v is not None)
