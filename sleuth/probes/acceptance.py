"""The acceptance a run reports (speculators' `eal`; SpecForge's `accept_len`, which only its Domino objective
computes) against the acceptance serving would see for the same drafts: the rule both servers apply, per block, is
the leading run of correct draft slots plus the verifier's bonus token, averaged over the blocks that have a trained
slot.

A metric that counts every correct slot (a cumulative product over the wrong axis), or drops the blocks a document
end cuts short from its denominator, still trains; it only reports a number serving will not reach, and every run
compared by it is compared wrongly. The experiment replaces the drafter's predictions, inside the run's own forward,
by a designed pattern over the run's own targets and trained slots, so the expected value is known exactly:

  * block k's first wrong slot sits at a slot chosen per block (different blocks, different runs), or, where the
    block's first untrained slot comes before it, on the first trained slot after that one: the two upstream
    conventions for an untrained slot inside a run (speculators ends the run there, SpecForge skips it) then agree;
  * every slot after the first wrong one is correct again: a metric that counts correct slots instead of the leading
    run sees them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Designed:
    """Designed predictions for a set of blocks and what serving's rule gives for them."""

    predictions: Tensor  # [..., blocks, B] token ids
    accepted_sum: float  # sum over blocks with a trained slot of (leading correct run + 1)
    blocks: int  # blocks with a trained slot
    partial_blocks: int  # of those, blocks with an untrained slot too (a document end, a hole in the loss mask)


def design(targets: Tensor, trained: Tensor, first_slot: int, vocab: int, offset: int = 0) -> Designed:
    """Predictions over blocks shaped [..., B] (`targets` the run's target ids, `trained` its trained slots);
    `first_slot` is the first drafted slot (1 where slot 0 is the anchor's own token). `offset` counts the blocks
    designed before these (a metric evaluated in chunks): the first wrong slot keeps varying across chunks."""
    b = targets.shape[-1]
    flat_t, flat_v = targets.reshape(-1, b), trained.reshape(-1, b).bool()
    wrong_token = (flat_t + 1) % vocab
    predictions = flat_t.clone()
    accepted, blocks, partial = 0.0, 0, 0
    drafted = b - first_slot
    for k in range(flat_t.shape[0]):
        valid = flat_v[k, first_slot:]
        if not valid.any():
            continue
        untrained = (~valid).nonzero().flatten()
        first_untrained = int(untrained[0]) if untrained.numel() else drafted
        chosen = (k + offset) % drafted
        if chosen < first_untrained:
            run, wrong = chosen, chosen
        else:
            # the run ends at the first untrained slot; the wrong prediction goes on the next trained slot, so a
            # metric that skips untrained slots (SpecForge's) stops at the same length as one that ends there
            run = first_untrained
            later = valid[first_untrained:].nonzero().flatten()
            wrong = first_untrained + int(later[0]) if later.numel() else None
        if wrong is not None:
            predictions[k, first_slot + wrong] = wrong_token[k, first_slot + wrong]
        accepted += run + 1.0
        blocks += 1
        partial += int(untrained.numel() > 0)
    return Designed(predictions.reshape(targets.shape), accepted, blocks, partial)


def one_hot_logits(predictions: Tensor, vocab: int, like: Tensor) -> Tensor:
    """Logits whose argmax is `predictions` (a margin of 10 over every other token)."""
    logits = torch.zeros(*predictions.shape, vocab, dtype=like.dtype, device=like.device)
    return logits.scatter(-1, predictions.unsqueeze(-1).to(like.device), 10.0)


def verdict_fields(reported_sum: float, reported_blocks: float, plan: Designed, metric: str) -> dict[str, object]:
    """The reported sum and block count against the plan's, as Verdict keyword arguments (status, measurement,
    observed, expected, fix). Both parts, not only their ratio: a denominator that drops blocks can leave the mean
    where it was by chance."""
    reported = reported_sum / reported_blocks if reported_blocks else float("nan")
    expected = plan.accepted_sum / plan.blocks if plan.blocks else float("nan")
    measurement = (f"{metric} reported {reported:.4f} over designed drafts on {plan.blocks} blocks with a trained "
                   f"slot ({plan.partial_blocks} of them cut short by an untrained slot); serving's rule gives "
                   f"{expected:.4f}; reported sum / blocks {reported_sum:g} / {reported_blocks:g}, serving's "
                   f"{plan.accepted_sum:g} / {plan.blocks}")
    if abs(reported_sum - plan.accepted_sum) > 1e-3 or abs(reported_blocks - plan.blocks) > 1e-3:
        return dict(status="mismatch", measurement=measurement,
                    observed=f"the run reports {metric} {reported:.3f} where serving would accept {expected:.3f} "
                             "tokens per block on the same drafts: the metric the runs are compared by is not what "
                             "serving sees",
                    expected=f"{metric} = mean over blocks with a trained slot of (leading run of correct slots + 1)",
                    fix="Count each block's leading run of correct slots (a cumulative product over the slot axis), "
                        "plus one, over every block with at least one trained slot.")
    return dict(status="match", measurement=measurement,
                observed=f"{metric} {reported:.3f}, as serving's rule gives on the designed drafts")
