"""The loss path alone, ours against speculators', over a grid of vocabulary V x block slots A*B.

The loss path is everything from the drafter's final hidden states to the gradient on them: the teacher's
logits from the verifier's last hidden state (its norm and lm_head), the drafter's logits (the shared
lm_head), the per-slot CE with the decay weights, the metrics, and the backward. Same inputs for both:
hidden [1, A*B, H] (requires grad), the verifier's last hidden state [1, S, H], one lm_head [V, H], the same
anchors (A of them, every slot label-valid but slot 0).
  * ours: FrozenTarget-style normed teacher states and trainer.model.loss.block_loss, whose peak is set by
    its chunk (`--chunks`: block slots per chunk; `default` = the 256 MiB rule);
  * speculators: `verifier_lm_head(verifier_norm(h[:, p+j-1]))` and `lm_head(hidden)` as DFlashDraftModel
    computes them, then its `compute_metrics` (loss and metrics) with the eager loss on CPU (`--speculators-
    loss fused` on CUDA: its Triton kernels, which need the [A*B, V] logits but no intermediate of that size).
Memory: CPU, the peak resident set above the one before the call (bench/train_step.py's method, under
MALLOC_MMAP_THRESHOLD_=65536); CUDA, torch.cuda.max_memory_allocated above the allocation before. Cells whose
speculators side would need more than --max-gib (its [A*B, V] float32 tensors) are not run and say so.

    PYTHONPATH=. .venv-speculators/bin/python bench/loss_memory.py                       # CPU, eager
    PYTHONPATH=. python bench/loss_memory.py --device cuda --dtype bfloat16 --speculators-loss fused
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and sys.platform.startswith("linux"):
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors leave the resident set (see train_step.py)
    os.execv(sys.executable, [sys.executable, *sys.argv])

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from train_step import peak_rss_probe  # noqa: E402

from trainer.model.loss import BlockTeacher, LogitsHead, block_loss, decay_weights, loss_chunk_slots  # noqa: E402


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def make_inputs(vocab: int, slots: int, block: int, seq_len: int, hidden: int, device, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randperm(seq_len - block, generator=g)[: slots // block]).values
    return {
        "hidden": (torch.randn(1, slots, hidden, generator=g)).to(device, dtype),
        "last": torch.randn(1, seq_len, hidden, generator=g).to(device, dtype),
        "norm": (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype),
        "head": (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(device, dtype),
        "anchors": anchors.to(device),
    }


def ours(x: dict, block: int, chunk: int | None) -> float:
    hidden = x["hidden"][0].detach().requires_grad_(True)  # [A*B, H]
    anchors = x["anchors"]
    seq_len = x["last"].shape[1]
    rows = ((anchors[:, None] + torch.arange(block, device=anchors.device)) - 1).clamp(0, seq_len - 1).flatten()
    with torch.no_grad():
        teacher = rms_norm(x["last"][0], x["norm"])  # [S, H], the target's final-normed states
    weights = (torch.ones(1, anchors.numel(), block) * decay_weights(block, 4.0)).to(anchors.device)
    head = LogitsHead(x["head"])
    result = block_loss(hidden, head, BlockTeacher(teacher, head, rows), weights, "ce", chunk_size=chunk)
    result.loss.backward()
    return float(result.loss.detach())


def theirs(x: dict, block: int, loss_config) -> float:
    from speculators.models.dflash.metrics import compute_metrics

    hidden = x["hidden"].detach().requires_grad_(True)  # [1, A*B, H]
    anchors = x["anchors"]
    indices = (anchors[:, None] + torch.arange(block, device=anchors.device)).flatten()  # [A*B]
    seq_len = x["last"].shape[1]
    with torch.no_grad():  # DFlashDraftModel._backbone_forward, fewer block slots than positions
        targets = F.linear(rms_norm(x["last"][:, (indices - 1) % seq_len], x["norm"]), x["head"])
    logits = F.linear(hidden, x["head"])
    mask = torch.ones(1, indices.numel(), device=anchors.device)
    mask[:, ::block] = 0
    loss, _ = compute_metrics(logits, targets, mask, block, gamma=4.0, loss_config=loss_config,
                              per_position_loss_weight="fixed-exp-decay", sample_from_anchor=False)
    loss.backward()
    return float(loss.detach())


def measure(fn, device, repeats: int) -> tuple[float, int, float]:
    """(median seconds, median peak bytes, loss) over `repeats` calls after one warm-up."""
    reset, read = peak_rss_probe() if device.type == "cpu" else (None, None)
    times, peaks, loss = [], [], 0.0
    for index in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            reset()
        start = time.perf_counter()
        loss = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else read()
        if index:
            times.append(elapsed)
            peaks.append(peak)
    return statistics.median(times), int(statistics.median(peaks)), loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", default="32768,151936,248320")
    parser.add_argument("--slots", default="512,2048,8192", help="A*B block slots (whole blocks)")
    parser.add_argument("--chunks", default="default,512", help="our chunk sizes in block slots; 'default'")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--speculators-loss", default="eager", choices=["eager", "fused", "none"])
    parser.add_argument("--max-gib", type=float, default=6.0, help="skip speculators cells needing more")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    loss_config = None
    if args.speculators_loss != "none":
        from speculators.losses import resolve_loss_config

        loss_config = resolve_loss_config("ce", args.speculators_loss)
    chunks = [None if c == "default" else int(c) for c in args.chunks.split(",")]
    mib = 2**20
    header = (["V", "A*B"] + [f"ours, chunk {c or 'default'}" for c in chunks]
              + (["speculators " + args.speculators_loss, "loss rel diff"] if loss_config else []))
    print("| " + " | ".join(header) + " |  (each cell: median ms / peak MiB)")
    print("|" + "---|" * len(header))
    rows = []
    for vocab in map(int, args.vocabs.split(",")):
        for slots in map(int, args.slots.split(",")):
            x = make_inputs(vocab, slots, args.block_size, args.seq_len, args.hidden, device, dtype)
            cells, row = [], {"vocab": vocab, "slots": slots}
            for chunk in chunks:
                seconds, peak, loss = measure(lambda: ours(x, args.block_size, chunk), device, args.repeats)
                used = loss_chunk_slots(chunk, vocab, args.block_size)
                row[f"ours_{chunk or 'default'}"] = {"chunk_slots": used, "s": seconds, "peak": peak, "loss": loss}
                cells.append(f"{seconds * 1e3:.0f} / {peak / mib:.0f} (chunk {used})")
            if loss_config is not None:
                need = 3 * slots * vocab * 4  # logits, targets, log-softmax: float32 [A*B, V] each, at least
                if need > args.max_gib * 2**30:
                    cells += [f"not run (needs > {need / 2**30:.0f} GiB)", ""]
                else:
                    seconds, peak, loss = measure(lambda: theirs(x, args.block_size, loss_config), device, args.repeats)
                    row["speculators"] = {"s": seconds, "peak": peak, "loss": loss}
                    ours_loss = row[f"ours_{chunks[0] or 'default'}"]["loss"]
                    cells += [f"{seconds * 1e3:.0f} / {peak / mib:.0f}", f"{abs(ours_loss - loss) / abs(loss):.1e}"]
            rows.append(row)
            print(f"| {vocab} | {slots} | " + " | ".join(cells) + " |", flush=True)
            del x
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
