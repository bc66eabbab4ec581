"""The two exact rollbacks of a recurrent target, side by side on one trained run: the cache's own per-position
states (`state_history`, transformers >= 5.25) against the saved state plus a replay (`state_replay`).

Same drafter, same target, same prompts, one process: each prompt is decoded both ways (alternating, so load drift
hits both) and by plain greedy decoding. Prints, per way: the tokens (identical?), lossless against greedy, tau,
verify steps, replay forwards and wall time.

    PYTHONPATH=. .venv/bin/python bench/recurrent_rollback.py runs/zl        # a run on a hybrid target
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run directory whose target keeps a recurrent state")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from trainer.data.datasets import heldout_prompts
    from trainer.eval.speculative import greedy_generate, speculative_generate
    from trainer.run.loop import load_run

    loaded = load_run(args.run, "cpu")
    config = loaded.config
    prompts = heldout_prompts(config.data, loaded.target.tokenizer, args.prompts)
    proposer = loaded.proposer()
    totals = {way: {"tokens": [], "accepted": 0, "steps": 0, "replays": 0, "seconds": 0.0, "rollback": set()}
              for way in ("state_history", "state_replay")}
    greedy = []
    with torch.no_grad():
        for prompt in prompts:
            greedy.append(greedy_generate(loaded.target, prompt, max_new_tokens=args.max_new_tokens,
                                          stop_token_ids=[]).new_tokens)
            for way in totals:
                started = time.perf_counter()
                result = speculative_generate(proposer, loaded.target, prompt,
                                              feature_layer_ids=loaded.feature_layer_ids,
                                              block_size=config.block_size, max_new_tokens=args.max_new_tokens,
                                              stop_token_ids=[], record_states=way == "state_history")
                row = totals[way]
                row["seconds"] += time.perf_counter() - started
                row["tokens"].append(result.new_tokens)
                row["accepted"] += sum(result.acceptance_lengths)
                row["steps"] += len(result.acceptance_lengths)
                row["replays"] += result.state_replays
                row["rollback"].add(result.target_rollback)
    print(f"run {args.run} (target {config.target}, block {config.block_size}), {len(prompts)} prompts x "
          f"{args.max_new_tokens} new tokens, {args.threads} thread(s)")
    print("| rollback (recorded as) | lossless | tau | verify steps | replay forwards | wall s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for way, row in totals.items():
        lossless = row["tokens"] == greedy
        print(f"| {way} ({', '.join(sorted(row['rollback']))}) | {lossless} | {row['accepted'] / row['steps']:.3f} | "
              f"{row['steps']} | {row['replays']} | {row['seconds']:.2f} |")
    same = totals["state_history"]["tokens"] == totals["state_replay"]["tokens"]
    print(f"identical outputs both ways: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
