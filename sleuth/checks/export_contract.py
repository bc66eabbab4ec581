"""`dflash.export_contract`: an exported drafter directory holds what its serving loader reads.

Weight names are a fail-silent boundary: a loader that finds `fc.weight` missing (or named `model.fc.weight`)
keeps its random initialisation, and a layer-id list in the wrong convention loads fine and feeds the
wrong layers. This check reads the directory the way the two loaders do (z-lab's `DFlashDraftModel`
in dflash/model.py; speculators' `DFlashDraftModel` in src/speculators/models/dflash/core.py, which vLLM
serves): config keys, tensor names and shapes from the safetensors header (no weights loaded).

    names     fc.weight, hidden_norm.weight, norm.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight,
              layers.{i}.self_attn.{q,k}_norm.weight, layers.{i}.{input,post_attention}_layernorm.weight,
              layers.{i}.mlp.{gate,up,down}_proj.weight for i < num_hidden_layers; nothing else unknown
    shapes    fc [H, k*H] with k = the number of layer ids; projections from heads, kv heads, head_dim
    layer ids z-lab `dflash_config.target_layer_ids` in 0..L-1 (id i = output of decoder layer i);
              speculators `aux_hidden_state_layer_ids` in 1..L-1 (vLLM: HF hidden_states[i]; 0 would be
              the embeddings, a z-lab list written unconverted)
    mask      mask_token_id present and inside the vocabulary
    block     block_size >= 2; speculators' greedy proposal drafts block_size - 1 tokens
    vocab     a reduced draft vocabulary (speculators draft_vocab_size < vocab_size) needs d2t / t2d maps that
              name the same tokens (t2d's i-th kept id = i + d2t[i]) and its own lm_head [draft_vocab, H] (the
              rows of the target's head it trained with; a loader cannot rebuild them from the checkpoint)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sleuth.checks.context import ContractContext, int_list, int_or_none
from sleuth.evidence.variant import owned_by
from sleuth.findings import Evidence, Finding, Fix
from sleuth.probes.exported import draft_vocab_problems, drafted_per_step

ID = "dflash.export_contract"
WEIGHTS = "model.safetensors"
_LAYER_TENSORS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
    "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
_OPTIONAL = {"lm_head.weight", "embed_tokens.weight", "d2t", "t2d", "verifier_norm.weight"}


def export_format(config: dict[str, Any] | None) -> str | None:
    if not config:
        return None
    from sleuth.evidence.variant import SPECULATORS_TYPES

    if config.get("speculators_model_type") in SPECULATORS_TYPES:  # the family shares DFlash's loader contract
        return "speculators"
    if isinstance(config.get("dflash_config"), dict):
        return "zlab"
    return None


def expected_shapes(layer: dict[str, Any], k: int) -> dict[str, tuple[int, ...]]:
    hidden = int(layer["hidden_size"])
    heads, kv_heads = int(layer["num_attention_heads"]), int(layer.get("num_key_value_heads") or layer["num_attention_heads"])
    head_dim = int(layer.get("head_dim") or hidden // heads)
    inter = int(layer["intermediate_size"])
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, k * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,),
    }
    per_layer = {
        "self_attn.q_proj.weight": (heads * head_dim, hidden), "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden), "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,),
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden), "mlp.down_proj.weight": (hidden, inter),
    }
    for i in range(int(layer["num_hidden_layers"])):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def contract_problems(directory: Path, config: dict[str, Any]) -> tuple[str | None, list[str], list[Evidence]]:
    """(format, problems, evidence) of an exported directory; raises nothing."""
    from sleuth.evidence.checkpoint import CheckpointError, read_header

    fmt = export_format(config)
    problems: list[str] = []
    evidence = [Evidence(kind="config", location=str(directory / "config.json"), value=f"format {fmt}")]
    if fmt is None:
        return None, ["config.json names neither z-lab's dflash_config nor speculators_model_type dflash"], evidence
    layer = config.get("transformer_layer_config") if fmt == "speculators" else config
    layer = layer if isinstance(layer, dict) else {}
    if fmt == "zlab":
        dflash = config.get("dflash_config") or {}
        ids = int_list(dflash.get("target_layer_ids"))
        mask = int_or_none(dflash.get("mask_token_id", config.get("mask_token_id")))
        block = int_or_none(dflash.get("block_size", config.get("block_size")))
        ids_key, low, convention = "dflash_config.target_layer_ids", 0, "z-lab (id i = output of decoder layer i)"
    else:
        ids = int_list(config.get("aux_hidden_state_layer_ids"))
        mask = int_or_none(config.get("mask_token_id"))
        block = int_or_none(config.get("block_size"))
        ids_key, low, convention = "aux_hidden_state_layer_ids", 1, "vLLM (id i = HF hidden_states[i])"
        methods = ((config.get("speculators_config") or {}).get("proposal_methods") or [{}])
        drafted = int_or_none(methods[0].get("speculative_tokens")) if isinstance(methods[0], dict) else None
        per_step = drafted_per_step(block, bool(config.get("sample_from_anchor")))
        if per_step is not None and drafted is not None and drafted != per_step:
            problems.append(f"proposal speculative_tokens {drafted} but block_size {block} drafts {per_step}")
    num_target_layers = int_or_none(config.get("num_target_layers"))
    vocab = int_or_none(layer.get("vocab_size"))
    if not ids:
        problems.append(f"{ids_key} is missing: the loader cannot tell which target layers fc reads")
    elif num_target_layers is not None:
        high = num_target_layers - 1
        outside = [i for i in ids if not low <= i <= high]
        if outside:
            problems.append(f"{ids_key} {ids} has {outside} outside {low}..{high} for a {num_target_layers}-layer "
                            f"target in the {convention} convention")
    if mask is None:
        problems.append("mask_token_id is missing: the loader falls back to a tokenizer default")
    elif vocab is not None and not 0 <= mask < vocab:
        problems.append(f"mask_token_id {mask} is outside the vocabulary (0..{vocab - 1})")
    if block is None or block < 2:
        problems.append(f"block_size {block!r} must be an integer >= 2")
    try:
        tensors = read_header(directory / WEIGHTS)
    except CheckpointError as exc:
        problems.append(str(exc))
        return fmt, problems, evidence
    evidence.append(Evidence(kind="checkpoint", location=str(directory / WEIGHTS), value=f"{len(tensors)} tensors"))
    required = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
    if ids and all(int_or_none(layer.get(k)) for k in required):
        expected = expected_shapes(layer, len(ids))
        missing = sorted(set(expected) - set(tensors))
        # A variant's own modules (DFlash2's convolutions, DSpark's heads) are read by its loader; their shapes are
        # sleuth/checks/family.py's to judge.
        unknown = sorted(n for n in set(tensors) - set(expected) - _OPTIONAL if owned_by(n) is None)
        wrong = [f"{n} {list(tensors[n].shape)} (loader builds {list(s)})" for n, s in expected.items()
                 if n in tensors and tuple(tensors[n].shape) != s]
        if missing:
            problems.append(f"{len(missing)} tensor(s) the loader reads are missing (left at random init): "
                            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        if unknown:
            problems.append(f"{len(unknown)} tensor(s) no loader reads (ignored, fail-silent): "
                            f"{', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}")
        if wrong:
            problems.append("shapes differ: " + "; ".join(wrong[:3]))
    else:
        problems.append(f"the layer config lacks {', '.join(k for k in required if not layer.get(k))}: shapes not checked")
    draft_vocab = int_or_none(config.get("draft_vocab_size"))
    if fmt == "speculators" and draft_vocab is not None and vocab is not None and draft_vocab < vocab:
        problems += draft_vocab_problems({n: t.shape for n, t in tensors.items()},
                                         lambda: _read_maps(directory / WEIGHTS), draft_vocab, vocab,
                                         int_or_none(layer.get("hidden_size")))
    return fmt, problems, evidence


def check_export_contract(ctx: ContractContext) -> Finding:
    run = ctx.run
    directory = run.path if run is not None else None
    if directory is None or export_format(ctx.config) is None or not (directory / WEIGHTS).is_file():
        return ctx.finding(ID, "unknown", reason="not an exported drafter directory (config.json with dflash_config "
                           "or speculators_model_type, plus model.safetensors); `trainer export` checks its own output")
    fmt, problems, evidence = contract_problems(directory, ctx.config or {})
    expected = f"what {fmt}'s DFlashDraftModel loader reads: names, shapes, layer ids, mask token, block size, vocab maps"
    if problems:
        return ctx.finding(ID, "mismatch", expected=expected, observed="; ".join(problems), evidence=evidence,
                           confidence=0.9, reason="the serving loader would load this directory silently wrong",
                           fix=Fix(code_hint="Re-export with `trainer export` (or fix the exporter's names and "
                                   "config keys to the loader's).", applicability="safe"))
    return ctx.finding(ID, "match", expected=expected, observed=f"{fmt} directory: every name, shape and key as the "
                       "loader reads it", evidence=evidence, confidence=0.85)


def _read_maps(weights: Path) -> tuple[Any, Any]:
    """The d2t and t2d maps alone (two small tensors), not the weights."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as handle:
        return handle.get_tensor("d2t"), handle.get_tensor("t2d")
