"""The target-fidelity gate: measured before a run trains and before `trainer hidden-states generate` stores
anything (both must pack rows the way the target computes them). Its own module so that the hidden-state
generator, which the run loop imports, does not import the run loop back."""

from __future__ import annotations

import sys

from trainer.config import TrainConfig
from trainer.data.datasets import load_documents
from trainer.run.rundir import RunError
from trainer.target.fidelity import FidelityRecord, check_lengths, choose_packing, token_stream
from trainer.target.frozen import FrozenTarget


def check_target_fidelity(config: TrainConfig, target: FrozenTarget, announce: bool = True) -> FidelityRecord:
    """Measure the packed target forward against the model's own on a held-out document longer than any
    window, choose how rows are packed, and refuse to train above the tolerance unless allowed."""
    heldout = load_documents(config.data, target.tokenizer, split="heldout")
    lead, length = check_lengths(target, config.seq_len)
    stream = token_stream([doc.input_ids for doc in heldout], lead + length)
    record = choose_packing(target, stream, lead, config.target_fidelity_tolerance, config.target_packing)
    if announce and record.packing == "per_document" and config.target_packing == "auto":
        failed = ", ".join(
            f"{mode} {max(diffs.values()):.3g}" if "error" not in diffs else f"{mode} ({diffs['error']})"
            for mode, diffs in record.tried.items()
        )
        print(
            f"note: {type(target.model).__name__} cannot be packed exactly ({failed}); every document goes "
            "through the target alone (exact, slower)",
            file=sys.stderr,
        )
    if not record.passed:
        summary = (
            f"the target's packed forward differs from its own forward on a {record.tokens}-token held-out document "
            f"(max abs hidden diff {record.max_abs_hidden_diff:.3g}, logit diff {record.max_abs_logit_diff:.3g}, "
            f"tolerance {record.tolerance:.3g}, packing {record.packing})"
        )
        if not config.allow_target_fidelity_failure:
            remedy = (
                "set target_packing: auto" if config.target_packing != "auto"
                else "even each document alone differs from it, so raise target_fidelity_tolerance"
            )
            raise RunError(
                f"{summary}: the drafter would learn states the target never produces; {remedy}, or set "
                "allow_target_fidelity_failure: true to train anyway"
            )
        if announce:
            print(f"warning: {summary}; training anyway (allow_target_fidelity_failure)", file=sys.stderr)
    return record
