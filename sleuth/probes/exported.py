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


def served_inv_freq(layer: Mapping[str, Any]) -> Tensor | None:
    """The inverse frequencies a server builds from a saved layer config (vLLM's default rope: rotary_dim =
    head_dim x partial_rotary_factor, theta from rope_parameters); None for a scaled rope this does not model."""
    rope = layer.get("rope_parameters") or {}
    if (rope.get("rope_type") or "default") != "default":
        return None
    head_dim = int(layer.get("head_dim") or int(layer["hidden_size"]) // int(layer["num_attention_heads"]))
    factor = float(rope.get("partial_rotary_factor", layer.get("partial_rotary_factor", 1.0)) or 1.0)
    theta = float(rope.get("rope_theta", layer.get("rope_theta", 10000.0)))
    dim = int(head_dim * factor)
    import torch

    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
