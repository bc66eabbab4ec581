"""The block's inputs: slot 0's token and the mask token in slots 1..B-1."""

from __future__ import annotations


import torch
from torch import Tensor

from sleuth.probes.experiments.lab import Lab
from sleuth.probes.protocol import ProbeHooks
from sleuth.probes.target import EOS_TOKEN, PAD_TOKEN
from sleuth.probes.verdict import Verdict


def _capture_block_tokens(lab: Lab) -> tuple[Tensor | None, float]:
    """The token id behind each block-stream input embedding [N, A*B] (nearest embedding row), and the
    smallest cosine similarity of a match (1.0: every input is exactly one of the target's embeddings)."""
    captured: list[Tensor] = []

    def hook(x: Tensor) -> Tensor:
        captured.append(x.detach().float().clone())
        return x

    lab.logits(None, ProbeHooks(block_embeddings=hook))
    if not captured:
        return None, 0.0
    x = captured[0]
    x = x.reshape(-1, x.shape[-2], x.shape[-1])
    table = lab.target.embed_weight.float()
    cosine = torch.nn.functional.normalize(x, dim=-1) @ torch.nn.functional.normalize(table, dim=-1).T  # [N, T, V]
    best = cosine.max(-1)
    return best.indices, best.values.min().item()


def probe_block_inputs(lab: Lab) -> list[Verdict]:
    b = lab.block_size
    tokens, similarity = _capture_block_tokens(lab)
    source = lab.info.get("mask_token_source") or "the probe target's mask_token_id (handed to the subject)"
    verdict = Verdict(
        invariant="dflash.mask_token_distinct", experiment="block-inputs",
        hypothesis="slots 1..B-1 of every block hold one dedicated mask token: not pad / eos, never a data token",
        perturbed="nothing: the input embeddings of the block tokens are read and matched to the vocabulary",
        measurement="", threshold="every input embedding equals one vocabulary row (cosine >= 0.999)",
        expected="one mask id, distinct from the data tokens and from pad / eos",
        status="unknown", coverage=lab.coverage(mask_token_from=source, tensors_observed=["block input embeddings"]),
    )
    if tokens is None:
        verdict.reason = "the block_embeddings hook was never called"
        return [verdict]
    if similarity < 0.999:
        verdict.reason = f"the block's input embeddings are not rows of the target's embeddings (cosine {similarity:.3f})"
        return [verdict]
    blocks = lab.valid_blocks()
    masks = sorted({int(tokens[min(n, tokens.shape[0] - 1), i * b + j]) for n, i, _ in blocks for j in range(1, b)})
    anchors_wrong = [(n, a, int(tokens[min(n, tokens.shape[0] - 1), i * b])) for n, i, a in blocks
                     if int(tokens[min(n, tokens.shape[0] - 1), i * b]) != int(lab.batch.input_ids[n, a])]
    lab.facts["slot0_tokens_wrong"] = anchors_wrong
    data = set(lab.batch.input_ids[lab.batch.loss_mask.bool()].tolist())
    verdict.measurement = (f"slots 1..B-1 hold token ids {masks}; data tokens use {len(data)} ids; pad {PAD_TOKEN}, "
                           f"eos {EOS_TOKEN}")
    verdict.measured = {"mask_ids": masks}
    if len(masks) != 1:
        verdict.status = "mismatch"
        verdict.observed = f"slots 1..B-1 hold {len(masks)} different ids {masks[:8]} (not one mask token)"
    elif masks[0] in (PAD_TOKEN, EOS_TOKEN) or masks[0] in data:
        verdict.status = "mismatch"
        special = {PAD_TOKEN: "pad", EOS_TOKEN: "eos"}.get(masks[0])
        verdict.observed = (f"mask token {masks[0]} is the {special} token" if special
                            else f"mask token {masks[0]} is a data token")
        verdict.fix = "Use the tokenizer's dedicated mask token or an unused embedding row."
    else:
        verdict.status = "match"
        verdict.observed = f"mask token {masks[0]}: not pad / eos, never a data token"
    return [verdict.gated()]
