"""Rules on a saved drafter that both sides apply: sleuth's export contract (sleuth/checks/export_contract.py,
on a directory a user hands it) and the probes' saved-drafter checks (in the worker, on what a trainer's own
save path writes). No sleuth import outside sleuth/probes (the worker's copy of sleuth holds it alone), and torch
only inside the functions that take tensors: sleuth's static checks import this module on the CLI's start-up path."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


def draft_vocab_problems(shapes: Mapping[str, Sequence[int]], read_maps: Callable[[], tuple[Tensor, Tensor]],
                         draft_vocab: int, vocab: int, hidden: int | None) -> list[str]:
    """A reduced draft vocabulary (draft_vocab < vocab): both maps saved and naming the same tokens (vLLM drafts
    token i + d2t[i] for draft index i; the head's row i is the i-th id t2d keeps), and lm_head saved at
    [draft_vocab, H] (its rows are picked from the target's head; a loader reading the checkpoint cannot rebuild
    them). `shapes`: tensor name -> shape; `read_maps` loads (d2t, t2d) when both are present."""
    problems = [f"draft_vocab_size {draft_vocab} < vocab_size {vocab} but the {name} map is missing"
                for name in ("d2t", "t2d") if name not in shapes]
    head = shapes.get("lm_head.weight")
    if head is None:
        problems.append(f"draft_vocab_size {draft_vocab} < vocab_size {vocab} but lm_head.weight is not saved: the "
                        "draft head's rows (picked by t2d) cannot be rebuilt by the loader")
    elif hidden is not None and tuple(head) != (draft_vocab, hidden):
        problems.append(f"lm_head.weight {list(head)} but a draft vocabulary of {draft_vocab} needs "
                        f"[{draft_vocab}, {hidden}]")
    if "d2t" not in shapes or "t2d" not in shapes:
        return problems
    import torch

    try:
        d2t, t2d = read_maps()
    except Exception as exc:  # noqa: BLE001 - an unreadable map is reported, not raised
        return problems + [f"the d2t / t2d maps could not be read: {type(exc).__name__}"]
    kept = torch.nonzero(t2d.bool().reshape(-1)).reshape(-1)
    drafted = torch.arange(d2t.numel()) + d2t.reshape(-1).long()
    if kept.numel() != draft_vocab or d2t.numel() != draft_vocab:
        return problems + [f"t2d keeps {kept.numel()} tokens and d2t maps {d2t.numel()}; draft_vocab_size is "
                           f"{draft_vocab}"]
    differ = int((kept != drafted).sum())
    if differ:
        problems.append(f"d2t and t2d name different tokens for {differ} of {draft_vocab} draft ids (draft id i is "
                        "served as i + d2t[i] but trained on t2d's i-th kept id)")
    return problems


def drafted_per_step(block_size: int | None, sample_from_anchor: bool) -> int | None:
    """Tokens a DFlash drafter proposes per step: B - 1 (slot 0 is the anchor), B when it drafts the anchor too."""
    return None if block_size is None else block_size if sample_from_anchor else block_size - 1


DEFAULT_ROPE_THETA = 10000.0


def number_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def rope_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config's rope parameters in one dict: transformers 5's `rope_parameters` (per layer type: its full-attention
    entry) over the legacy `rope_scaling`, which a server still reads where the first is absent."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_type" not in params and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    params = dict(params) if isinstance(params, dict) else {}
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    return params


def served_rope(layer: Mapping[str, Any]) -> dict[str, Any]:
    """What a serving stack rotates, from the exported layer config: theta, rope type and its scaling, the rotated
    fraction of each head, mRoPE sections, the pair layout (vLLM's `is_neox_style`, default neox) and the head size."""
    params = rope_params(layer)
    theta = params.pop("rope_theta", layer.get("rope_theta", DEFAULT_ROPE_THETA))
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    partial = params.pop("partial_rotary_factor", layer.get("partial_rotary_factor", 1.0))
    mrope = params.pop("mrope_section", None)
    params.pop("mrope_interleaved", None)
    neox = layer.get("is_neox_style", True)
    return {
        "rope_theta": number_or_none(theta) if number_or_none(theta) is not None else theta,
        "rope_type": rope_type,
        "scaling": {k: v for k, v in sorted(params.items()) if v is not None},
        "partial_rotary_factor": number_or_none(partial) if number_or_none(partial) is not None else partial,
        "mrope_section": list(mrope) if isinstance(mrope, list) else None,
        "rope_layout": "neox" if neox is not False else "interleaved",
        "head_dim": _head_dim(layer),
    }


def served_inv_freq(layer: Mapping[str, Any]) -> Tensor | None:
    """The inverse frequencies a server builds from a saved layer config (vLLM's default rope: rotary_dim =
    head_dim x partial_rotary_factor); None for a scaled rope, which this does not model."""
    rope = served_rope(layer)
    theta, partial, head_dim = rope["rope_theta"], rope["partial_rotary_factor"], rope["head_dim"]
    partial = 1.0 if partial is None else partial
    if rope["rope_type"] != "default" or not isinstance(theta, float) or not isinstance(partial, float) or not head_dim:
        return None
    dim = int(head_dim * partial)
    import torch

    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _head_dim(config: Mapping[str, Any]) -> int | None:
    def integer(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    head_dim = integer(config.get("head_dim"))
    heads, hidden = integer(config.get("num_attention_heads")), integer(config.get("hidden_size"))
    return head_dim or (hidden // heads if heads and hidden else None)
