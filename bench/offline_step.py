"""Training-step time with the target run online against hidden states read from an offline cache.

Both in the SAME process on the same batches and anchors, alternating step by step: the online step runs
the frozen target's forward (FrozenTarget.forward_packed); the offline step reads the stored layers and
recomputes the teacher logits with the target's lm_head (OfflineTarget). Losses must agree (they are the
same computation); the ratio says what skipping the target body buys on this machine and target.

    PYTHONPATH=. python bench/offline_step.py                 # embedded target, CPU
    PYTHONPATH=. python bench/offline_step.py --target DIR --device cuda --dtype bfloat16 --seq-len 2048
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainer.config import build_config, resolve_for_target
from trainer.data.datasets import batch_for_step, load_documents, pack_documents
from trainer.hidden_states.generate import generate
from trainer.hidden_states.offline import OfflineTarget
from trainer.run.loop import build_drafter
from trainer.run.step import StepPlan, dflash_step, sample_step_anchors
from trainer.target.frozen import FrozenTarget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = build_config(overrides=[f"target={args.target}", f"seq_len={args.seq_len}",
                                     f"batch_size={args.batch_size}", f"dtype={args.dtype}"])
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "hs"
        generate(config, cache, device=device, dtype=dtype, rows_per_shard=32)
        online = FrozenTarget.load(config.target, device, dtype)
        offline = OfflineTarget.load(str(cache), config.target, device, dtype)
        config = resolve_for_target(config, online.num_layers)
        plan = StepPlan.from_config(config, online)
        packed = pack_documents(load_documents(config.data, online.tokenizer, "train"), config.seq_len,
                                online.pad_token_id)
        drafter = build_drafter(config, online, plan)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
        times: dict[str, list[float]] = {"online": [], "offline": []}
        losses: dict[str, list[float]] = {"online": [], "offline": []}
        state = {k: v.clone() for k, v in drafter.state_dict().items()}
        for step in range(1, args.repeats + 2):
            batch = {k: v.to(device) for k, v in batch_for_step(packed, step, config.batch_size, config.seed).items()}
            anchors, valid = sample_step_anchors({k: v.cpu() for k, v in batch.items()}, plan, config.seed, step)
            order = [("online", online), ("offline", offline)]
            for name, target in (order if step % 2 else order[::-1]):
                drafter.load_state_dict(state)  # both start every step from the same weights
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                loss, _ = dflash_step(target, drafter, batch, anchors, valid, plan)
                loss.backward()
                optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if step > 1:  # the first step warms both up
                    times[name].append(time.perf_counter() - start)
                    losses[name].append(loss.item())
        med = {k: statistics.median(v) for k, v in times.items()}
        worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses["online"], losses["offline"]))
        print(f"target {config.target} S={config.seq_len} N={config.batch_size} device={device} dtype={args.dtype}")
        print(f"  online  (target forward)   median {med['online'] * 1e3:8.1f} ms/step")
        print(f"  offline (cached layers)    median {med['offline'] * 1e3:8.1f} ms/step")
        print(f"  offline/online step time x{med['offline'] / med['online']:.3f}; loss max rel diff {worst:.1e}")


if __name__ == "__main__":
    main()
