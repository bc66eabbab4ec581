"""Training-step throughput and peak memory: our DFlash step against speculators' DFlashDraftModel
(`--drafter dspark`: our DSpark step against speculators' DSparkDraftModel, heads and confidence loss included;
`--drafter dflash2`: our DFlash2 step against speculators' DFlash2DraftModel, block convolutions and candidate
selector included, at DFlash2's default settings and with speculators' model loaded from our drafter's weights).

Both run in the SAME process on the same inputs and the same starting weights, alternating step by step
(the order flips every repeat), so machine load hits both alike and the ratio is measured, not assembled
from two runs. One step = forward, loss, backward, AdamW step, for both:
  * ours: trainer.run.step.dflash_step (anchors, mask, drafter, target lm_head, loss) + backward + AdamW;
  * speculators: DFlashDraftModel.forward (anchors, mask, drafter, verifier lm_head, loss) + the same.
Inputs are what each side consumes: the selected-layer features and the verifier's last hidden state.
Both compute the teacher's logits inside the timed step: ours norm(h_last) over the S positions, then the
lm_head at the distinct positions its label-valid slots learn from, chunk by chunk (trainer/model/loss.py);
speculators the lm_head at all A*B block positions. `--vocab` reruns each size at real vocabularies. Both draw the same anchors: on CPU speculators' sampler seeded through the global
generator picks exactly what ours picks with the same seed (tests/parity checks this); on CUDA its
sampler would use the CUDA generator, so ours replaces it there. Losses can therefore be compared
step by step: the "loss rel diff" column is the largest relative difference over all timed steps while
both models train side by side. DFlash2 is the exception past a few dozen steps: its selector trains on the
drafter's own top-K candidates, a discrete choice, so float-rounding differences flip a near-tied candidate
and the trajectories part (at `small` about step 23, then ~1e-3 by step 43). Ours against a copy of itself
with weights perturbed by 1e-7 parts the same way, and with selector_loss_alpha 0 both stay within 1e-6, so
a large DFlash2 value over many steps is this noise; over the first steps it stays near 1e-7.

Memory (CPU): peak resident memory of one step above the resident memory just before it, read from
/proc/self/status VmHWM after resetting the high-water mark (/proc/self/clear_refs "5"). glibc would
otherwise keep freed blocks resident and hide later peaks, so the script runs with a fixed mmap threshold
(MALLOC_MMAP_THRESHOLD_=65536: every tensor above 64 KiB is its own mapping, returned on free). It also
reports the bytes autograd saves for backward (saved_tensors_hooks), an allocator-independent number.
Memory (CUDA): torch.cuda.max_memory_allocated above the allocation before the step.

    PYTHONPATH=. .venv-speculators/bin/python bench/train_step.py                  # CPU, all sizes
    PYTHONPATH=. .venv-speculators/bin/python bench/train_step.py --drafter dspark --loss kl   # DSpark
    PYTHONPATH=. .venv-speculators/bin/python bench/train_step.py --drafter dflash2 --loss kl  # DFlash2
    PYTHONPATH=. python bench/train_step.py --device cuda --dtype bfloat16 --sizes large   # bench/gpu.sh
Without speculators importable it times ours alone and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and sys.platform.startswith("linux"):
    # Must be set before the allocator starts: re-exec once with it (see the module docstring).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "parity")]

import torch  # noqa: E402
from parity_harness import (  # noqa: E402
    ModelDims,
    ParityCase,
    StandInTarget,
    build_our_drafter,
    make_inputs,
)

from trainer.model.attention_mask import sdpa_mask  # noqa: E402
from trainer.run.step import StepPlan, sample_step_anchors  # noqa: E402
from trainer.run.steps import training_step  # noqa: E402


@dataclass(frozen=True)
class Size:
    name: str
    dims: ModelDims
    seq_len: int
    max_anchors: int
    block_size: int
    docs: int


SIZES = {
    "tiny": Size("tiny", ModelDims(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, draft_layers=2,
                                   vocab=128, num_features=5), seq_len=256, max_anchors=32, block_size=8, docs=3),
    "small": Size("small", ModelDims(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768, draft_layers=2,
                                     vocab=2048, num_features=5), seq_len=512, max_anchors=64, block_size=8, docs=3),
    "medium": Size("medium", ModelDims(hidden=512, heads=8, kv_heads=4, head_dim=64, intermediate=1536,
                                       draft_layers=3, vocab=4096, num_features=5),
                   seq_len=1024, max_anchors=64, block_size=16, docs=3),
    # GPU only: a Qwen3-1.7B-shaped drafter (H 2048, 16/8 heads, 5 layers), 4k context, 512 anchors x 16.
    "large": Size("large", ModelDims(hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=6144,
                                     draft_layers=5, vocab=32768, num_features=5),
                  seq_len=4096, max_anchors=512, block_size=16, docs=4),
}


def peak_rss_probe() -> tuple[Callable[[], None], Callable[[], int]]:
    """(reset, read): reset the resident high-water mark; read the peak above the RSS at reset, in bytes."""
    baseline = [0]

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{key} not in /proc/self/status")

    def reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        baseline[0] = status("VmRSS:")

    def read() -> int:
        return status("VmHWM:") - baseline[0]

    return reset, read


class SavedBytes:
    """Bytes autograd keeps for backward during the wrapped forward (each storage counted once)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return t

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def drafter_train_flops(size: Size, inputs, anchors, anchor_valid) -> float:
    """Model FLOPs of one training step of the drafter (the same count for both implementations).

    2*m*n*k per matmul; backward is twice the forward for trainable weights and once for the frozen draft
    lm_head (input gradient only). Attention counts only the query/key pairs the DFlash mask lets through.
    The target's logits are the frozen target's work, not the drafter's, and are left out.
    """
    d = size.dims
    n_rows, s = inputs.input_ids.shape
    q = size.max_anchors * size.block_size
    kv = s + q
    visible = int(sdpa_mask(anchors, anchor_valid, inputs.doc_ids, size.block_size, False).sum())
    per_layer = (
        2 * q * d.hidden * d.heads * d.head_dim  # q_proj
        + 2 * 2 * kv * d.hidden * d.kv_heads * d.head_dim  # k_proj, v_proj over context and block
        + 2 * q * d.heads * d.head_dim * d.hidden  # o_proj
        + 3 * 2 * q * d.hidden * d.intermediate  # gate, up, down
    ) * n_rows + 2 * 2 * d.heads * d.head_dim * visible  # scores and weighted values
    trainable = 2 * s * d.num_features * d.hidden * d.hidden * n_rows + d.draft_layers * per_layer
    draft_head = 2 * q * d.hidden * d.vocab * n_rows
    return 3.0 * trainable + 2.0 * draft_head


def bench_size(size: Size, args, speculators_attn: str | None) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    dspark = args.drafter == "dspark"
    dflash2_case = None
    if dspark:  # one document per row, supervised to its end (dspark_harness.py says why)
        import dspark_harness

        case = dspark_harness.DSparkCase(size.name, size.block_size, size.max_anchors, 1, size.seq_len, 4.0,
                                         args.loss, speculators_attn or "sdpa", seed=7, markov_rank=args.markov_rank,
                                         dims=size.dims)
        inputs = dspark_harness.make_inputs(case)
        drafter = dspark_harness.build_our_drafter(case)
    else:
        case = ParityCase(size.name, size.block_size, size.max_anchors, (size.docs,), size.seq_len, 4.0, args.loss,
                          speculators_attn or "sdpa", seed=7, dims=size.dims)
        inputs = make_inputs(case)
        if args.drafter == "dflash2":  # the parity test's drafter: every weight random, convolutions off identity
            import dflash2_harness

            from trainer.config import DFlash2Config

            dflash2_case = dflash2_harness.Case(case, DFlash2Config())
            drafter = dflash2_harness.build_our_drafter(dflash2_case)
        else:
            drafter = build_our_drafter(case)
    model = None
    their_options: dict = {}
    if speculators_attn is not None:
        from parity_harness import build_speculators_model, speculators_loss_config

        if dspark:
            from speculators.losses import resolve_loss_config as resolve

            model = dspark_harness.build_speculators_model(case, drafter, inputs)
            their_options = {"tv_loss_fn": resolve("tv", args.speculators_loss)["tv"][0],
                             "confidence_head_alpha": case.confidence_head_alpha}
        elif dflash2_case is not None:
            from speculators.losses import resolve_loss_config as resolve

            model = dflash2_harness.build_speculators_model(dflash2_case, drafter, inputs)
            their_options = {"tv_loss_fn": resolve("tv", args.speculators_loss)["tv"][0],
                             "selector_loss_alpha": dflash2_case.settings.selector_loss_alpha}
        else:
            model = build_speculators_model(case, drafter, inputs)
        loss_config = speculators_loss_config(case.loss_kind)
        if args.speculators_loss == "fused":  # its Triton kernels (CUDA); eager is the harness's default
            from speculators.losses import resolve_loss_config

            loss_config = resolve_loss_config({"ce": "ce", "kl": "kl_div"}[case.loss_kind], "fused")
    # Move everything to the device and dtype after the weights are shared (the harness builds on CPU).
    for name in ("features", "last_hidden", "embed_weight", "lm_head_weight", "verifier_norm_weight"):
        setattr(inputs, name, getattr(inputs, name).to(device=device, dtype=dtype))
    for name in ("input_ids", "position_ids", "doc_ids", "loss_mask"):
        setattr(inputs, name, getattr(inputs, name).to(device))
    drafter.to(device=device, dtype=dtype)
    if model is not None:
        model.to(device=device, dtype=dtype)

    target = StandInTarget(inputs, size.dims.rms_eps)
    recipe = args.recipe == "recipe-2026"  # D-PACE weighting + Muon/AdamW on both sides (speculators' defaults)
    plan = StepPlan(feature_layer_ids=list(range(1, size.dims.num_features + 1)), logits_source="final",
                    block_size=size.block_size, max_anchors=size.max_anchors, gamma=4.0, loss_kind=args.loss,
                    context_includes_anchor=False, mask_token_id=case.mask_token_id,
                    loss_weighting="dpace" if recipe else "decay", drafter_kind=args.drafter,
                    dspark=case.dspark() if dspark else None,
                    selector_loss_alpha=dflash2_case.settings.selector_loss_alpha if dflash2_case else 1.0)
    batch = {"input_ids": inputs.input_ids, "position_ids": inputs.position_ids, "doc_ids": inputs.doc_ids,
             "loss_mask": inputs.loss_mask}
    tokens = int((inputs.doc_ids >= 0).sum())
    seed = 0

    def ours(step: int, saved: SavedBytes | None = None) -> float:
        with saved.context() if saved else _null():
            anchors, anchor_valid = sample_step_anchors(batch, plan, seed, step)  # as the training loop does
            loss, _ = training_step(target, drafter, batch, anchors, anchor_valid, plan)
        loss.backward()
        our_opt.step()
        our_opt.zero_grad(set_to_none=True)
        return loss.item()

    def forced_anchors(loss_mask, num_anchors, block_size):
        # On CUDA speculators' randperm runs on the CUDA generator, which draws other anchors than our CPU
        # one; there its sampler is replaced by ours (same cost, inside the timed step) for equal losses.
        anchors, valid = sample_step_anchors(batch, plan, seed, current_step[0])
        return anchors[0], valid[0]

    current_step = [0]

    def theirs(step: int, saved: SavedBytes | None = None) -> float:
        torch.manual_seed(seed * 1_000_003 + step)  # on CPU: the anchors ours draws for this step
        current_step[0] = step
        with saved.context() if saved else _null(), _forcing(device.type == "cuda", forced_anchors):
            _, loss, _ = model(
                hidden_states=inputs.features, input_ids=inputs.input_ids, loss_mask=inputs.loss_mask,
                verifier_last_hidden_states=inputs.last_hidden, document_ids=inputs.doc_ids,
                position_ids=inputs.position_ids, loss_config=loss_config, gamma=4.0,
                max_anchors=size.max_anchors, per_position_loss_weight="dpace" if recipe else "fixed-exp-decay",
                **their_options,
            )
        loss.backward()
        their_opt.step()
        their_opt.zero_grad(set_to_none=True)
        return loss.item()

    class Chain:  # speculators' trainer steps its optimizer list in tandem
        def __init__(self, parts):
            self.parts = parts

        def step(self):
            for part in self.parts:
                part.step()

        def zero_grad(self, set_to_none=True):
            for part in self.parts:
                part.zero_grad(set_to_none=set_to_none)

    if recipe:
        from trainer.config import build_config
        from trainer.run.optim import build_optimizer

        our_opt = build_optimizer(build_config(preset="recipe-2026", overrides=["lr=1e-4"]), drafter)
    else:
        our_opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    runners = {"ours": ours}
    if model is not None:
        if recipe:
            from types import SimpleNamespace

            from speculators.train.optimizers import build_optimizers

            their_opt = Chain(build_optimizers(model, SimpleNamespace(
                optimizer="muon", lr=1e-4, weight_decay=0.01, muon_lr=1e-4, muon_momentum=0.95,
                muon_weight_decay=0.1, muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw")))
        else:
            their_opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        runners["speculators"] = theirs

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = {k: [] for k in runners}
    cpu_times = {k: [] for k in runners}
    peaks = {k: [] for k in runners}
    losses = {k: [] for k in runners}
    saved_bytes = {}
    reset, read = peak_rss_probe() if device.type == "cpu" else (None, None)
    for step in range(1, args.warmup + args.repeats + 1):
        order = list(runners) if step % 2 else list(reversed(runners))
        for name in order:
            saved = SavedBytes() if step == 1 else None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            else:
                reset()
            sync()
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = runners[name](step, saved)
            sync()
            elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
            peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else read()
            if saved is not None:
                saved_bytes[name] = saved.bytes
            losses[name].append(loss)
            if step > args.warmup:
                times[name].append(elapsed)
                cpu_times[name].append(cpu_elapsed)
                peaks[name].append(peak)

    anchors, valid = sample_step_anchors({k: v.cpu() for k, v in batch.items()}, plan, seed, 1)
    flops = drafter_train_flops(size, _cpu(inputs), anchors, valid)
    result = {
        "size": size.name, "dims": asdict(size.dims), "seq_len": size.seq_len, "max_anchors": size.max_anchors,
        "block_size": size.block_size, "tokens_per_step": tokens, "device": str(device), "dtype": args.dtype,
        "drafter": args.drafter, **({"markov_rank": args.markov_rank} if dspark else {}),
        "loss": args.loss, "speculators_attn": speculators_attn, "speculators_loss": args.speculators_loss,
        "repeats": args.repeats, "warmup": args.warmup,
        "threads": torch.get_num_threads(), "drafter_train_flops": flops,
    }
    for name in runners:
        median = statistics.median(times[name])
        result[name] = {
            "median_step_s": median,
            "tokens_per_s": tokens / median,
            "step_s": times[name],
            "median_cpu_s": statistics.median(cpu_times[name]),
            "peak_mem_median_bytes": statistics.median(peaks[name]),
            "autograd_saved_bytes": saved_bytes.get(name),
            "tflops": flops / median / 1e12,
            "first_loss": losses[name][0],
            "last_loss": losses[name][-1],
        }
    if model is not None:
        result["throughput_ratio_ours_over_speculators"] = (
            result["speculators"]["median_step_s"] / result["ours"]["median_step_s"]
        )
        result["cpu_time_ratio_speculators_over_ours"] = (
            result["speculators"]["median_cpu_s"] / result["ours"]["median_cpu_s"]
        )
        result["peak_mem_ratio_ours_over_speculators"] = (
            result["ours"]["peak_mem_median_bytes"] / max(result["speculators"]["peak_mem_median_bytes"], 1)
        )
        result["loss_max_rel_diff"] = max(
            abs(a - b) / abs(b) for a, b in zip(losses["ours"], losses["speculators"])
        )
    return result


def _forcing(active: bool, sampler):
    if not active:
        return _null()
    from parity_harness import patched
    from speculators.models.dflash import core as speculators_core

    return patched(speculators_core, "select_anchors", sampler)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cpu(inputs):
    class View:
        input_ids = inputs.input_ids.cpu()
        doc_ids = inputs.doc_ids.cpu()

    return View


def speculators_available() -> bool:
    try:
        import speculators.models.dflash.core  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: time ours alone
        print(f"speculators is not importable ({exc!r}): timing ours alone", file=sys.stderr)
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small,medium", help=f"comma list of {', '.join(SIZES)}")
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per implementation (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--loss", default="ce", choices=["ce", "kl"])
    parser.add_argument("--speculators-attn", default=None,
                        help="speculators' attention: sdpa | eager | simple_flex_attention "
                             "(default: sdpa on CPU, simple_flex_attention on CUDA)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="accelerator peak for MFU (default: 989 for H100/H200 bf16 dense)")
    parser.add_argument("--vocab", default=None,
                        help="comma list of vocabulary sizes to run each size at instead of its own (e.g. "
                             "32768,151936,248320: real vocabularies, where the loss path dominates)")
    parser.add_argument("--speculators-loss", default="eager", choices=["eager", "fused"],
                        help="speculators' loss implementation: eager (CPU) or its fused Triton kernels (CUDA)")
    parser.add_argument("--recipe", default="decay", choices=["decay", "recipe-2026"],
                        help="decay: fixed gamma + AdamW; recipe-2026: D-PACE + Muon/AdamW on both sides")
    parser.add_argument("--drafter", default="dflash", choices=["dflash", "dflash2", "dspark"],
                        help="dspark: the DSpark step (Markov head of --markov-rank, confidence head) on both sides; "
                             "dflash2: the DFlash2 step (block convolutions, candidate selector) at its defaults")
    parser.add_argument("--markov-rank", type=int, default=16, help="DSpark's Markov rank (with --drafter dspark)")
    parser.add_argument("--json", type=Path, default=None, help="also write all results here")
    args = parser.parse_args()
    if args.drafter != "dflash" and args.recipe != "decay":
        parser.error(f"--drafter {args.drafter} trains with fixed decay only (--recipe decay)")
    if args.threads:
        torch.set_num_threads(args.threads)
    attn = args.speculators_attn or ("simple_flex_attention" if args.device.startswith("cuda") else "sdpa")
    have_speculators = speculators_available()
    peak = args.peak_tflops
    if peak is None and args.device.startswith("cuda") and args.dtype == "bfloat16":
        name = torch.cuda.get_device_name()
        peak = 989.0 if ("H100" in name or "H200" in name) else None

    sizes = [SIZES[name] for name in args.sizes.split(",")]
    if args.vocab:
        sizes = [replace(size, name=f"{size.name}@{vocab}", dims=replace(size.dims, vocab=vocab))
                 for size in sizes for vocab in map(int, args.vocab.split(","))]
    results = []
    for size in sizes:
        r = bench_size(size, args, attn if have_speculators else None)
        results.append(r)
        line = (f"{r['drafter']}  {r['size']:>6}  S={r['seq_len']} A={r['max_anchors']} B={r['block_size']} H={r['dims']['hidden']} "
                f"V={r['dims']['vocab']} L={r['dims']['draft_layers']}  tokens/step={r['tokens_per_step']}\n"
                f"        ours:        {r['ours']['tokens_per_s']:10.1f} tok/s  median {r['ours']['median_step_s']*1e3:8.2f} ms"
                f"  peak {r['ours']['peak_mem_median_bytes']/2**20:8.1f} MiB"
                f"  saved-for-backward {(r['ours']['autograd_saved_bytes'] or 0)/2**20:7.1f} MiB")
        if peak:
            line += f"  MFU {r['ours']['tflops']/peak:.1%}"
        if "speculators" in r:
            s = r["speculators"]
            line += (f"\n        speculators: {s['tokens_per_s']:10.1f} tok/s  median {s['median_step_s']*1e3:8.2f} ms"
                     f"  peak {s['peak_mem_median_bytes']/2**20:8.1f} MiB"
                     f"  saved-for-backward {(s['autograd_saved_bytes'] or 0)/2**20:7.1f} MiB")
            if peak:
                line += f"  MFU {s['tflops']/peak:.1%}"
            line += (f"\n        ratio ours/speculators: throughput x{r['throughput_ratio_ours_over_speculators']:.3f}"
                     f" (by process CPU time x{r['cpu_time_ratio_speculators_over_ours']:.3f})"
                     f", peak memory x{r['peak_mem_ratio_ours_over_speculators']:.3f}"
                     f"; loss max rel diff over {args.warmup + args.repeats} side-by-side steps "
                     f"{r['loss_max_rel_diff']:.1e}")
        print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "torch": torch.__version__, "results": results}, indent=1))


if __name__ == "__main__":
    main()
