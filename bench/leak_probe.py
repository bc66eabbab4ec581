"""How much does a drafter lean on the anchor's own hidden state?

The v6 bug (`context_includes_anchor: true`) trains a drafter that may read the target's hidden state at
the anchor, which does not exist at inference. This probe takes trained runs and scores each drafter on
the same held-out batches twice: with the mask it was trained with, and with the reference mask (context
strictly before the anchor, what inference gives it). The drop in accuracy is the leak the drafter
learned to use; real tau (eval.json) is what it costs when served.

    PYTHONPATH=. .venv/bin/python bench/leak_probe.py runs/v6 runs/fixed [--batches 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from trainer.data.datasets import batch_for_step, load_documents, pack_documents
from trainer.run.loop import load_run
from trainer.run.step import StepPlan, dflash_step, sample_step_anchors


@torch.no_grad()
def score(run_dir: Path, batches: int) -> dict[str, object]:
    loaded = load_run(run_dir, "cpu")
    config, target = loaded.config, loaded.target
    plan = StepPlan.from_config(config, target)
    # Held-out documents: text neither drafter trained on.
    documents = load_documents(config.data, target.tokenizer, split="heldout")
    packed = pack_documents(documents, config.seq_len, target.pad_token_id)
    result: dict[str, object] = {"run": run_dir.name, "trained_with_anchor": config.context_includes_anchor}
    for label, include in (("with_anchor", True), ("without_anchor", False)):
        probe = dataclasses.replace(plan, context_includes_anchor=include)
        acc, slot1 = [], []
        for step in range(1, 1 + batches):  # the same batches and anchors for every run
            batch = batch_for_step(packed, step, config.batch_size, config.seed + 1)
            anchors, valid = sample_step_anchors(batch, probe, config.seed + 1, step)
            _, metrics = dflash_step(target, loaded.drafter, batch, anchors, valid, probe)
            acc.append(metrics["acc"])
            slot1.append(metrics["position_acc"][0])
        result[f"acc_{label}"] = round(sum(acc) / len(acc), 4)
        result[f"slot1_acc_{label}"] = round(sum(slot1) / len(slot1), 4)
    eval_file = run_dir / "eval.json"
    result["real_tau"] = round(json.loads(eval_file.read_text())["tau"], 4) if eval_file.exists() else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--batches", type=int, default=8)
    args = parser.parse_args()
    for run_dir in args.runs:
        print(json.dumps(score(run_dir, args.batches)))


if __name__ == "__main__":
    main()
