"""Teacher-forced acceptance: what the training objective says a drafter will accept, on eval sequences.

Training logs `acc`, `position_acc` and `streak` on training batches under the training semantics (the
run's mask, the run's logits source). Real speculative decoding measures tau on held-out prompts. When
the two disagree, the training semantics differ from serving (SpecForge #533, z-lab #41): a leaky mask, a
wrong logits source, a mask token that also occurs in the data. To compare them on equal terms, this
module replays the training semantics on exactly the sequences the eval decoded (prompt + generated
continuation): every generated position p anchors a block, slot j is scored against the training
target at p+j-1 (rule `dflash.target_shift`), with the run's context rule and the run's logits source.

    per-position accuracy acc_k   pooled over all blocks of all eval sequences, slots k = 1..B-1
    acceptance                    1 + sum_k prod_{i<=k} acc_i: the expected acceptance length (tau) a
                                  drafter with these independent per-slot accuracies would reach
                                  (speculators' `eal` + 1 for the bonus token)
    acceptance_per_prompt         the same per eval sequence: the spread gives the noise of the comparison

A drafter trained on the right objective scores about its real tau here; a gap beyond the per-prompt
noise means training optimised something serving does not reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, Field
from torch import nn

from trainer.model.attention_mask import build_attention_mask
from trainer.model.loss import block_metrics, gather_block_logits, metrics_from_counts, slot_weights


@dataclass(frozen=True)
class TrainingSemantics:
    """The parts of the run's training step that decide what a slot is scored against."""

    feature_layer_ids: list[int]  # target layers the drafter's fc reads
    logits_source: str | int  # "final" or an intermediate layer id, as the run trained
    context_includes_anchor: bool  # the run's context rule (False is the reference rule)
    block_size: int
    mask_token_id: int


class TeacherForcedReport(BaseModel):
    acceptance: float = Field(
        description="1 + sum_k prod_{i<=k} position_acc_i over all blocks of all eval sequences: the tau "
        "the training objective predicts on the eval data."
    )
    position_acc: list[float] = Field(description="Slots 1..B-1: draft argmax == training target argmax.")
    streak: float = Field(description="Mean (correct prefix + 1) per block: the per-block acceptance the "
                          "training objective sees, without the independence assumption of `acceptance`.")
    acceptance_per_prompt: list[float | None] = Field(
        description="`acceptance` per eval sequence (null where the sequence has no labelled block)."
    )
    blocks: int = Field(description="Blocks scored (one per generated position with a label).")
    at_verify: float | None = Field(
        None, description="1 + the training objective's correct prefix, averaged over exactly the blocks "
        "serving drafted (the verify steps' anchors) whose B-1 slots all have a label. For a drafter trained "
        "on serving semantics this equals `tau_at_verify` up to float ties: the block, its context and its "
        "labels are the same, so any gap is the training semantics, not sampling.",
    )
    tau_at_verify: float | None = Field(None, description="Real acceptance length over the same verify steps.")
    at_verify_per_prompt: list[float | None] = Field(default_factory=list)
    tau_at_verify_per_prompt: list[float | None] = Field(default_factory=list)
    verify_steps_compared: int = 0
    verify_steps_above: int = Field(
        0, description="Compared verify steps where the training objective's correct prefix is longer than the "
        "real acceptance. With serving semantics a step differs only on a float tie in an argmax, which goes "
        "either way; training semantics that score something serving does not reward push the steps above.",
    )
    verify_steps_below: int = Field(0, description="Compared verify steps where it is shorter.")
    label_agreement: float | None = Field(
        None, description="Fraction of labelled slots (every generated position's block) whose training target "
        "argmax is the decoded token at that position. At temperature 0 the decoded tokens are the target's "
        "greedy output, i.e. what serving verifies against, so training's labels give 1.0; less means training "
        "scores against other labels (logits source, shift), whatever the drafter sees.",
    )
    label_slots: int = Field(0, description="Labelled slots `label_agreement` counts over.")
    logits_source: str = Field(description="The training target the slots were scored against.")
    context_includes_anchor: bool


def _acceptance(counts: dict[str, Any]) -> float:
    return 1.0 + float(metrics_from_counts(counts)["eal"])


@torch.no_grad()
def teacher_forced_acceptance(
    drafter: nn.Module,
    target: Any,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    semantics: TrainingSemantics,
    acceptance_lengths: Sequence[Sequence[int]] | None = None,
) -> TeacherForcedReport:
    """Score every generated position of every (prompt, new_tokens) pair the way training scores a block.

    `target` is a FrozenTarget (forward_packed, embed, logits). The drafter's train/eval mode is left alone;
    call it in eval mode. `acceptance_lengths` (per sequence, per verify step, from the serving loop) also
    compares the two block by block at the anchors serving used: the first anchor is the first generated
    token (position n), each next one is the previous plus its acceptance length.
    """
    B = semantics.block_size
    device = target.device
    pooled: dict[str, Any] = {"correct": [0] * (B - 1), "labels": [0] * (B - 1), "prefix": 0.0, "blocks": 0}
    per_prompt: list[float | None] = []
    at_verify: list[float | None] = []
    tau_at_verify: list[float | None] = []
    matched: list[tuple[float, float]] = []
    labels_equal, labels_scored = 0, 0
    for index, (prompt, new_tokens) in enumerate(sequences):
        ids = list(prompt) + list(new_tokens)
        n, S = len(prompt), len(ids)
        if S - n < 2:  # no generated position has a next token to predict
            per_prompt.append(None)
            at_verify.append(None)
            tau_at_verify.append(None)
            continue
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, S]
        position_ids = torch.arange(S, device=device)[None]  # [1, S]
        doc_ids = torch.zeros(1, S, dtype=torch.long, device=device)  # [1, S] one document
        loss_mask = (position_ids >= n).long()  # [1, S] labels only on the generated continuation
        anchors = torch.arange(n, S - 1, device=device)[None]  # [1, A] every generated position but the last
        anchor_valid = torch.ones_like(anchors, dtype=torch.bool)
        features, target_logits = target.forward_packed(
            input_ids, position_ids, doc_ids, semantics.feature_layer_ids, semantics.logits_source
        )  # [1, S, k*H], [1, S, V]
        A = anchors.shape[1]
        block_ids = torch.full((1, A, B), semantics.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, :, 0] = input_ids.gather(1, anchors)
        block_positions = anchors[:, :, None] + torch.arange(B, device=device)  # [1, A, B]
        all_positions = torch.cat([position_ids, block_positions.reshape(1, A * B)], dim=1)  # [1, S + A*B]
        # The drafter's own layer attention (its sliding windows), as its training step builds the masks.
        mask = build_attention_mask(anchors, anchor_valid, doc_ids, B, semantics.context_includes_anchor, device,
                                    attention=getattr(drafter, "attention", None))
        dtype = next(drafter.parameters()).dtype
        block_embeds = target.embed(block_ids.reshape(1, A * B)).to(dtype)  # [1, A*B, H]
        hidden = drafter(block_embeds, features.to(dtype), all_positions, attention_mask=mask)  # [1, A*B, H]
        draft_logits = target.logits(hidden.to(target.dtype)).reshape(1, A, B, -1)  # [1, A, B, V]
        label_valid = slot_weights(anchors, anchor_valid, loss_mask, doc_ids, B, None) > 0  # [1, A, B]
        block_targets = gather_block_logits(target_logits, anchors, B)  # [1, A, B, V]
        counts = block_metrics(draft_logits, block_targets, label_valid)["counts"]
        # Slot j of the block at p is labelled with the target's prediction at p+j-1, i.e. token p+j.
        decoded = input_ids.gather(1, (block_positions.clamp(max=S - 1)).reshape(1, A * B)).reshape(1, A, B)
        same = (block_targets.argmax(-1) == decoded) & label_valid  # [1, A, B]
        labels_equal += int(same.sum())
        labels_scored += int(label_valid.sum())
        if acceptance_lengths is not None:
            correct = (draft_logits.argmax(-1) == block_targets.argmax(-1))[0, :, 1:]  # [A, B-1]
            prefix = correct.long().cumprod(dim=-1).sum(dim=-1).tolist()  # [A] correct slots before the first miss
            pairs = []
            anchor = n
            for length in acceptance_lengths[index]:
                if anchor + B - 1 > S - 1:  # the block runs past the decoded text: no labels to compare
                    break
                pairs.append((1.0 + prefix[anchor - n], float(length)))
                anchor += length
            matched += pairs
            at_verify.append(sum(p for p, _ in pairs) / len(pairs) if pairs else None)
            tau_at_verify.append(sum(r for _, r in pairs) / len(pairs) if pairs else None)
        per_prompt.append(_acceptance(counts) if counts["blocks"] else None)
        for key in ("correct", "labels"):
            pooled[key] = [a + b for a, b in zip(pooled[key], counts[key])]
        pooled["prefix"] += counts["prefix"]
        pooled["blocks"] += counts["blocks"]
    metrics = metrics_from_counts(pooled)
    blocks = int(pooled["blocks"])
    return TeacherForcedReport(
        acceptance=1.0 + float(metrics["eal"]) if blocks else 0.0,
        position_acc=[float(a) for a in metrics["position_acc"]],
        streak=1.0 + float(metrics["streak"]) if blocks else 0.0,
        acceptance_per_prompt=per_prompt,
        blocks=blocks,
        logits_source=str(semantics.logits_source),
        context_includes_anchor=semantics.context_includes_anchor,
        at_verify=sum(p for p, _ in matched) / len(matched) if matched else None,
        tau_at_verify=sum(r for _, r in matched) / len(matched) if matched else None,
        at_verify_per_prompt=at_verify if acceptance_lengths is not None else [],
        tau_at_verify_per_prompt=tau_at_verify if acceptance_lengths is not None else [],
        verify_steps_compared=len(matched),
        verify_steps_above=sum(1 for p, r in matched if p > r),
        verify_steps_below=sum(1 for p, r in matched if p < r),
        label_agreement=labels_equal / labels_scored if labels_scored else None,
        label_slots=labels_scored,
    )
