"""What the exact rollback of trainer/eval/target_cache.py costs in `trainer eval`'s speculative loop.

On an attention-only target a rejected block is a crop, as before: the loop must cost what it did. On a
recurrent-state target every rejected block restores the state saved before the verify pass and re-runs the
committed tokens (one more target forward of acc+1 tokens). A random, untrained drafter is the worst case:
nearly every block is rejected at its first draft, so nearly every step replays.

Times the speculative loop alone (`evaluate(..., measure_speedup=False, check_lossless=False)`), median of
--repeats after one untimed warm-up, one thread, as process CPU time (on a shared machine wall time mostly
measures the neighbours; CPU time of one thread much less so). Run it from two checkouts to compare (PYTHONPATH picks the
trainer; the tiny targets come from this checkout's tests/trainer/tiny_targets.py):

    PYTHONPATH=. python bench/eval_rollback.py
    PYTHONPATH=/path/to/other/checkout python /path/to/this/checkout/bench/eval_rollback.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# tests.trainer.tiny_targets; appended, so the checkout on PYTHONPATH supplies the trainer being timed
sys.path.append(str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="embedded,qwen3,gemma2,qwen3_5,kimi_linear",
                        help="'embedded' and/or families of tests/trainer/tiny_targets.py")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from tests.trainer.tiny_targets import save_family_target
    from trainer.eval.speculative import evaluate
    from trainer.model.drafter import DFlashDrafter
    from trainer.target.embedded import build_embedded_tokenizer
    from trainer.target.frozen import FrozenTarget

    scratch = tempfile.TemporaryDirectory(prefix="eval-rollback-")  # every saved target goes with it at exit
    print(f"{'target':<14} {'spec loop cpu s':>16} {'per token ms':>13} {'tau':>6} {'rollback':>13} {'replays':>8}")
    for name in args.targets.split(","):
        if name == "embedded":
            target = FrozenTarget.load("embedded", torch.device("cpu"))
        else:
            directory = Path(scratch.name) / name
            save_family_target(name, directory, build_embedded_tokenizer(small=True))
            target = FrozenTarget.load(str(directory), torch.device("cpu"))
        torch.manual_seed(0)
        layers = [1, target.num_layers - 2]
        drafter = DFlashDrafter.from_target_config(target.model.config, num_layers=1, num_features=len(layers),
                                                   block_size=args.block_size, mask_token_id=target.mask_token_id)
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, target.vocab_size - 10, (args.prompt_tokens,), generator=generator).tolist()
                   for _ in range(args.prompts)]

        def run():
            return evaluate(drafter, target, prompts, feature_layer_ids=layers, block_size=args.block_size,
                            max_new_tokens=args.max_new_tokens, stop_token_ids=[], measure_speedup=False,
                            check_lossless=False)

        run()  # warm-up: allocator growth, kernel selection
        times, report = [], None
        for _ in range(args.repeats):
            started = time.process_time()
            report = run()
            times.append(time.process_time() - started)
        seconds = statistics.median(times)
        print(f"{name:<14} {seconds:>16.3f} {1000 * seconds / report.output_tokens:>13.2f} {report.tau:>6.2f} "
              f"{getattr(report, 'target_rollback', 'crop (old)'):>13} {getattr(report, 'state_replays', '-'):>8}")


if __name__ == "__main__":
    main()
