"""The training loop of a named run: build, (resume,) train, log, checkpoint, evaluate.

Determinism is by construction rather than by saved iterators: the batch and the anchors of step t are
functions of (seed, t), the drafter's init of the seed, and the optimizer and RNG state are restored from
the checkpoint. So a run killed at any point and resumed produces the same metrics as one that never
stopped.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config import ConfigError, TrainConfig, resolve_for_target
from trainer.data.datasets import batch_for_step, chat_rendering, load_documents, pack_documents
from trainer.data.draft_vocab import VOCAB_FILE, draft_token_ids, load_vocab, save_vocab, token_frequencies
from trainer.model.attention_mask import WINDOW_FROM_ANCHOR
from trainer.model.drafter import DFlashDrafter
from trainer.model.loss import loss_chunk_slots, metrics_from_counts
from trainer.run.memory import check_fits_memory
from trainer.run.checkpoint import (
    DRAFTER_FILE,
    check_checkpoint_files,
    latest_checkpoint,
    load_drafter_weights,
    restore_training_state,
    save_checkpoint,
)
from trainer.run.distributed import Distributed, init_distributed
from trainer.run.fidelity_gate import check_target_fidelity
from trainer.run.optim import build_optimizer
from trainer.run.sharding import (
    ShardedOptimizerLoader,
    gather_full_state,
    load_sharded_target,
    shard_drafter,
    target_shard_record,
    unsharded_copy,
)
from trainer.run.trackers import open_trackers, require_trackers
from trainer.run.progress import RunProgress
from trainer.run.rundir import (
    RUN_FORMAT_VERSION,
    RunDir,
    RunError,
    RunLock,
    atomic_write_json,
    claim_run,
    now_iso,
)
from trainer.run.step import StepPlan, sample_step_anchors
from trainer.run.steps import training_step
from trainer.target.fidelity import FidelityRecord
from trainer.target.frozen import PACKING_MODES, FrozenTarget


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """`auto` is CUDA when torch sees a GPU; under torchrun each rank takes the GPU of its local rank."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RunError("--device cuda was asked for, but torch sees no CUDA device")
        return torch.device("cuda", local_rank) if device == "cuda" else torch.device(device)
    if device != "cpu":
        raise RunError(f"unknown device {device!r}; use auto, cpu or cuda")
    return torch.device("cpu")


def compute_dtype(config: TrainConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "bfloat16" and device.type == "cuda":
        return torch.bfloat16
    return torch.float32


def lr_at(config: TrainConfig, step: int) -> float:
    """Linear warmup, then the configured decay down to min_lr_ratio * lr at the last step."""
    if config.warmup_steps and step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    if config.schedule == "constant":
        return config.lr
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    if config.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape)


def build_drafter(config: TrainConfig, target: FrozenTarget, plan: StepPlan) -> DFlashDrafter:
    torch.manual_seed(config.seed)  # the drafter's init depends on the seed alone
    kind_options: dict[str, Any] = {}
    drafter_class: type[DFlashDrafter] = DFlashDrafter
    if config.drafter_kind == "dflash2":
        from trainer.model.dflash2 import DFlash2Drafter

        drafter_class, kind_options = DFlash2Drafter, {"dflash2": config.dflash2}
    elif config.drafter_kind == "dspark":
        from trainer.model.dspark import DSparkDrafter

        drafter_class, kind_options = DSparkDrafter, {"dspark": plan.dspark}
    drafter = drafter_class.from_target_config(
        target.model.config,
        num_layers=config.draft_layers,
        num_features=len(plan.feature_layer_ids),
        block_size=config.block_size,
        mask_token_id=plan.mask_token_id,
        shape=config.draft_config.as_shape(),
        **kind_options,
    )
    return drafter.to(device=target.device, dtype=target.dtype)


def optimizer_step(
    config: TrainConfig, drafter: torch.nn.Module, optimizer: Any, loss: torch.Tensor
) -> None:
    """One update: clear, backward, clip to config.grad_clip, step (the optimizer of trainer.run.optim).
    trainer/probe.py calls this too, so sleuth's probe measures the update the loop makes."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if config.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), config.grad_clip)
    optimizer.step()


@dataclass
class TrainResult:
    run: RunDir
    steps_done: int
    last_metrics: dict[str, Any]


def train(
    run: RunDir,
    config: TrainConfig | None,
    *,
    preset: str | None,
    device: str = "auto",
    resume: bool = False,
    progress: bool = True,
    steps: int | None = None,
    claim: RunLock | None = None,
) -> TrainResult:
    """Train `run` (resuming it when asked); under torchrun, every rank calls this and rank 0 writes.

    Rank 0 claims the run's name first (or takes `claim`, already held): a concurrent `trainer run` of
    the same name fails at once without touching anything. A failure after the run directory is written
    marks run.json `failed` (or `interrupted`) with the reason, so no run stays `running` without a process.
    """
    dist = init_distributed(device)
    try:
        if dist.is_main and claim is None:
            claim = claim_run(run, resume=resume)
        return _train(
            run, config, preset=preset, device=device, resume=resume, progress=progress, dist=dist, steps=steps
        )
    except BaseException as exc:
        failure = _as_user_error(exc, config or _saved_config(run))
        if run.header_written:
            _mark_stopped(run, exc if failure is None else failure)
        if failure is not None:
            raise failure from None
        raise
    finally:
        if claim is not None:
            claim.release()
        dist.close()


def _train(
    run: RunDir,
    config: TrainConfig | None,
    *,
    preset: str | None,
    device: str,
    resume: bool,
    progress: bool,
    dist: Distributed,
    steps: int | None = None,
) -> TrainResult:
    created = now_iso()  # when the run was asked for, not when its target finished loading
    torch_device = resolve_device(device, dist.local_rank)
    checkpoint = None
    if not dist.is_main:  # rank 0 checked under its claim; the others check the same (read-only): all fail alike
        if resume:
            run.check_resumable()
        else:
            run.check_new()
    if resume:
        # Every run file is read and checked before any model loads: a damaged one fails in a second.
        saved = run.load_config()
        run.read_info()
        rows = run.read_metrics()
        run.read_fingerprint()
        checkpoint = latest_checkpoint(run.checkpoints_dir)
        if checkpoint is not None:
            check_checkpoint_files(checkpoint, run.path)
            _check_metrics_cover(run, rows, checkpoint.step, checkpoint.state, saved.log_every)
        # --steps may extend a resumed run; every other field is what the run started with.
        asked = max(steps or 0, config.steps if config else 0)
        config = saved.model_copy(update={"steps": max(asked, saved.steps)})
    assert config is not None
    # The run record names its inputs absolutely, so eval and export work from any directory.
    config = config.model_copy(update=absolute_inputs(config))
    if config.batch_size % dist.world_size:
        raise ConfigError(
            f"batch_size {config.batch_size} must divide evenly over {dist.world_size} processes "
            "(it is the global batch)"
        )
    dist.barrier()  # every rank has checked the directory before rank 0 writes into it

    display = RunProgress(run.name, total=config.steps, enabled=progress and dist.is_main)
    if config.warmup_steps >= config.steps:
        display.note(
            f"warmup_steps {config.warmup_steps} >= steps {config.steps}: the whole run is warmup, the learning "
            f"rate never reaches lr {config.lr:g} (lower warmup_steps or raise --steps)"
        )
    display.message(f"loading target {config.target}")
    # Sharding the target makes every target forward a collective: all ranks run each one together.
    target_sharded = dist.enabled and config.target_parallelism == "fsdp2"
    if config.hidden_states:
        from trainer.hidden_states.offline import OfflineTarget

        target = OfflineTarget.load(config.hidden_states, config.target, torch_device,
                                    compute_dtype(config, torch_device), mask_token_id=config.mask_token_id,
                                    speculators_layer_ids=config.hidden_states_layers)
    elif target_sharded:
        target = load_sharded_target(
            lambda: FrozenTarget.load(config.target, torch.device("cpu"), compute_dtype(config, torch_device),
                                      mask_token_id=config.mask_token_id),
            torch_device, dist.world_size, dist.rank, dist.barrier,
        )
    else:
        target = FrozenTarget.load(
            config.target, torch_device, compute_dtype(config, torch_device), mask_token_id=config.mask_token_id
        )
    config = resolve_for_target(config, target.num_layers)
    # The loss chunk the run uses, saved in config.json: a resume, and sleuth's probe of the run's code,
    # then chunk exactly as this run does.
    config = config.model_copy(update={"loss_chunk_size": loss_chunk_slots(
        config.loss_chunk_size, min(config.draft_vocab_size or target.vocab_size, target.vocab_size), config.block_size)})
    check_fits_memory(config, target, dist.world_size)
    if target.eos_token_id is None and dist.is_main:
        print(
            f"note: the target's tokenizer has no eos token: documents are packed without an end marker and "
            f"eval decodes each prompt to eval_max_new_tokens ({config.eval_max_new_tokens})",
            file=sys.stderr,
        )

    documents = load_documents(config.data, target.tokenizer, split="train")
    packed = pack_documents(documents, config.seq_len, target.pad_token_id)
    vocab_ids = None
    if config.draft_vocab_size:  # from the supervised tokens of exactly these rows: a resume rebuilds the same
        vocab_ids = draft_token_ids(token_frequencies(packed.input_ids, packed.loss_mask), config.draft_vocab_size,
                                    target.vocab_size)
    plan = StepPlan.from_config(config, target, vocab_ids)
    if config.hidden_states:  # the cache must be of this target, these rows and every layer the run reads
        needed = sorted(set(plan.feature_layer_ids) | ({plan.logits_source} if isinstance(plan.logits_source, int) else set()))
        target.cache.check_serves(target_fingerprint=target.fingerprint, data_fingerprint=packed.fingerprint,
                                  seq_len=config.seq_len, layers=needed)
    if config.hidden_states:
        # The cache's generator ran the target and measured it; this run never does: carry its record.
        stored = target.cache.manifest.get("target_fidelity")
        fidelity = FidelityRecord(**stored) if isinstance(stored, dict) else None
    else:
        display.message("checking the target's packed forward against its own")
        fidelity = check_target_fidelity(config, target, announce=dist.is_main)
        if target_sharded and fidelity.packing == "per_document":
            raise RunError("target_parallelism 'fsdp2' needs a packed target forward, but this target is exact "
                           "only one document at a time (per_document): use target_parallelism 'none'")

    drafter = build_drafter(config, target, plan)
    rotary = drafter_rotary_record(drafter)  # before sharding: what the drafter's rotary embedding really does
    start_step = 0
    if checkpoint is not None:
        # Checkpoints hold full tensors, so they resume under any world size and either parallelism.
        load_drafter_weights(drafter, checkpoint)
    fsdp = dist.enabled and config.parallelism == "fsdp2"
    # Eval runs on rank 0, or on every rank in lockstep when the target is sharded (its forwards are collectives).
    eval_ranks = dist.is_main or target_sharded
    eval_template = copy.deepcopy(drafter) if fsdp and eval_ranks else None  # unsharded shape for eval
    param_names = shard_drafter(drafter) if fsdp else []
    optimizer = build_optimizer(config, drafter)  # after sharding: FSDP2 optimizers hold shards
    if checkpoint is not None:
        restore_training_state(checkpoint, ShardedOptimizerLoader(drafter, optimizer, param_names) if fsdp else optimizer)
        start_step = checkpoint.step

    def full_drafter() -> torch.nn.Module | None:
        """The drafter as one process holds it, for eval (rank 0); a collective under FSDP2."""
        if not fsdp:
            return drafter
        # None on the ranks that only took part in the gather
        return unsharded_copy(eval_template, drafter, every_rank=target_sharded)
    # Everything a user can get wrong (held-out prompts included) fails before the run directory is written.
    # Every run ends with eval.json, whether or not it also evaluates periodically (eval_every).
    evaluator = _Evaluator(config, target, vocab_ids) if eval_ranks else None
    validator = _Validator(config, target, plan, dist, torch_device) if config.val_every else None
    require_trackers(config)
    if resume:
        _check_same_inputs(run, target.fingerprint, packed.fingerprint)
    if dist.is_main:
        run.header_written = True  # from here on a failure is recorded in run.json (see train())
        # What sleuth's train-to-serve checks read: does the mask id occur in the data, how was chat rendered.
        real_tokens = packed.input_ids[packed.doc_ids >= 0]
        data_record = {
            "mask_token_count": int((real_tokens == plan.mask_token_id).sum()),
            **chat_rendering(documents, target.tokenizer),
        }
        _write_run_header(
            run, config, preset, target, packed.fingerprint, resume, start_step, torch_device, dist, created, fidelity,
            data_record, rotary,
        )
    if dist.is_main and target_sharded:
        run.update_info(target_sharding=target_shard_record(target, dist.world_size))
    if dist.is_main and vocab_ids is not None:
        save_vocab(run.path / VOCAB_FILE, vocab_ids, target.vocab_size)
    dist.barrier()
    trackers = open_trackers(config, run) if dist.is_main else None

    model = drafter
    if dist.enabled and not fsdp:
        device_ids = [torch_device.index] if torch_device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(drafter, device_ids=device_ids)

    model.train()
    last: dict[str, Any] = {}
    display.start(completed=start_step)
    tokens_since, clock = 0, time.perf_counter()
    started = time.perf_counter()
    for step in range(start_step + 1, config.steps + 1):
        lr = lr_at(config, step)
        for group in optimizer.param_groups:  # the schedule scales every group's own peak lr (Muon's may differ)
            group["lr"] = lr * group.get("lr_scale", 1.0)
        global_batch = batch_for_step(packed, step, config.batch_size, config.seed)
        anchors, anchor_valid = sample_step_anchors(global_batch, plan, config.seed, step)
        rows = dist.rows(config.batch_size)
        batch = {key: value[rows].to(torch_device) for key, value in global_batch.items()}
        loss, metrics = training_step(target, model, batch, anchors[rows], anchor_valid[rows], plan)
        optimizer_step(config, drafter, optimizer, loss)
        tokens_since += metrics.pop("tokens")
        counts = metrics.pop("counts")
        # a drafter kind's own per-step scalars (DFlash2's and DSpark's loss terms), averaged over ranks like loss
        kind_metrics = metrics.pop("kind_metrics", {})

        eval_due = config.eval_every is not None and step % config.eval_every == 0
        if step % config.log_every == 0 or step == config.steps or eval_due:
            # The loss is a mean over rows and every rank holds as many rows: the mean of rank losses is the
            # global loss. Accuracy-type metrics are recomputed from counts summed over ranks.
            summed = dist.sum({"loss": float(loss.detach()), "tokens": tokens_since, **counts, **kind_metrics})
            global_metrics = {"loss": summed["loss"] / dist.world_size, **metrics_from_counts(summed),
                              **{key: summed[key] / dist.world_size for key in kind_metrics}}
            elapsed = time.perf_counter() - clock
            row: dict[str, Any] = {
                "step": step,
                **{key: _round(value) for key, value in global_metrics.items()},
                "lr": lr,
                "tokens_per_s": round(summed["tokens"] / elapsed, 1) if elapsed > 0 else None,
                "elapsed_s": round(time.perf_counter() - started, 3),
            }
            evaluated = full_drafter() if eval_due and (fsdp or evaluator is not None) else None
            if eval_due and evaluator is not None and evaluated is not None:
                evaluated.eval()
                row.update(evaluator.tau(evaluated))
                evaluated.train()
            if dist.is_main:
                run.append_metrics(row)
                trackers.log(row, "train")
            if not math.isfinite(row["loss"]):
                raise RunError(
                    f"the loss is {row['loss']} at step {step} (lr {lr:g}): the run diverged; start a new run "
                    "with a lower lr"
                )
            last = row
            tokens_since, clock = 0, time.perf_counter()
            display.metrics(row)
        if validator is not None and (step % config.val_every == 0 or step == config.steps):
            val_row = {"step": step, "split": "val", **validator.metrics(model)}
            if dist.is_main:
                run.append_metrics(val_row)
                trackers.log(val_row, "val")
        if step % config.checkpoint_every == 0 or step == config.steps:
            weights, optimizer_state = gather_full_state(drafter, optimizer, param_names) if fsdp else (drafter, optimizer)
            if dist.is_main:
                state = {"config_steps": config.steps, "world_size": dist.world_size,
                         "parallelism": "fsdp2" if fsdp else "ddp"}
                save_checkpoint(run.checkpoints_dir, step, weights, optimizer_state, state, config.keep_checkpoints)
                run.update_info(steps_done=step)
            dist.barrier()
        display.advance(step)
    display.stop()

    final_drafter = full_drafter() if (fsdp or evaluator is not None) else None
    if evaluator is not None and final_drafter is not None:
        final_drafter.eval()
        report = evaluator.full(final_drafter)
        if dist.is_main:
            atomic_write_json(run.eval_path, {"step": config.steps, **report})
        last = {**last, "eval_tau": report.get("tau")}
    if dist.is_main:
        trackers.close()
        run.update_info(status="completed", steps_done=config.steps, finished=now_iso())
    dist.barrier()
    return TrainResult(run=run, steps_done=config.steps, last_metrics=last)


def _as_user_error(exc: BaseException, config: TrainConfig | None) -> Exception | None:
    """An out-of-memory failure mid-run as one line that says what to change."""
    text = str(exc)
    if isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)
    ):
        sizes = (f" (seq_len {config.seq_len}, batch_size {config.batch_size}, max_anchors {config.max_anchors})"
                 if config is not None else "")
        return RunError(f"out of memory{sizes}: start a new run with a smaller seq_len or batch_size")
    return None


def _saved_config(run: RunDir) -> TrainConfig | None:
    try:
        return run.load_config()
    except RunError:
        return None


def _mark_stopped(run: RunDir, exc: BaseException) -> None:
    """Best effort: the record says the run stopped and why (the disk may be full; then it stays as is)."""
    status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
    reason = " ".join(str(exc).split())[:500] or type(exc).__name__
    try:
        run.update_info(status=status, stopped=now_iso(), error=None if status == "interrupted" else reason)
    except (OSError, RunError):
        pass


def _check_metrics_cover(
    run: RunDir, rows: list[dict[str, Any]], step: int, state: dict[str, Any], log_every: int
) -> None:
    """The metrics must hold the last row logged before the checkpoint: rows are appended before the
    checkpoint is saved, so a missing one means the file lost rows (cut at a line boundary, emptied)."""
    expected = step if step == state.get("config_steps") else step // log_every * log_every
    if expected and not any(row["step"] == expected for row in rows):
        raise RunError(
            f"{run.metrics_path} has no row for step {expected}, which the checkpoint at step {step} follows; "
            "the file lost rows (truncated or emptied)"
        )


def _write_run_header(
    run: RunDir,
    config: TrainConfig,
    preset: str | None,
    target: FrozenTarget,
    data_fingerprint: str,
    resume: bool,
    start_step: int,
    device: torch.device,
    dist: Distributed,
    created: str,
    fidelity: FidelityRecord | None,
    data_record: dict[str, Any] | None = None,
    drafter_rotary: dict[str, Any] | None = None,
) -> None:
    if resume:
        run.truncate_metrics(start_step)  # rows after the checkpoint are recomputed, never duplicated
        # --steps may have extended the run: config.json always says what the run trains to.
        atomic_write_json(run.config_path, config.model_dump(mode="json"))
        # A resumed run that had failed or was interrupted is running again: the old reason no longer holds.
        info = {key: value for key, value in run.read_info().items() if key not in ("error", "stopped")}
        run.write_info({**info, "status": "running", "resumed_at": now_iso(), "steps_done": start_step,
                        "world_size": dist.world_size,
                        "target_fidelity": fidelity.to_json() if fidelity else info.get("target_fidelity"),
                        "drafter": {**(info.get("drafter") or {}), **(drafter_rotary or {})}})
    else:
        run.path.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run.config_path, config.model_dump(mode="json"))
        run.write_info(
            {
                "format_version": RUN_FORMAT_VERSION,
                "name": run.name,
                "preset": preset,
                "created": created,
                "status": "running",
                "steps_done": 0,
                "world_size": dist.world_size,
                "target": {
                    "path": str(target.path),
                    "fingerprint": target.fingerprint,
                    "num_layers": target.num_layers,
                    "hidden_size": target.hidden_size,
                    "vocab_size": target.vocab_size,
                },
                "data": {"source": config.data, "fingerprint": data_fingerprint, **(data_record or {})},
                "target_fidelity": fidelity.to_json() if fidelity else None,
                "drafter": drafter_rotary or {},
            }
        )
    run.write_code_fingerprint(keep_existing=resume)
    run.write_environment(str(device))


def drafter_rotary_record(drafter: DFlashDrafter) -> dict[str, Any]:
    """run.json `drafter`: the drafter's shape and attention as it trains, for sleuth's train-to-serve checks
    (`dflash.rope_served_as_trained`, `dflash.sliding_window_served`; sleuth reads run directories, not this code).

    Read off the modules, so it says what they do whatever their config claims: the rotated width from the
    rotary embedding's frequencies (`rope_layout` "neox": rotate_half pairs dimension i with i + d/2), each
    layer's window from its attention module (`layer_windows`, null = full attention), the block causality of
    the sliding layers from the mask the drafter builds. `draft_config` is the run's resolved Qwen3 config
    fields (what an export writes)."""
    config = drafter.config
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    rotary_dim = 2 * int(drafter.rotary_emb.inv_freq.numel())
    rope = {key: value for key, value in dict(getattr(config, "rope_parameters", None) or {}).items()
            if key != "partial_rotary_factor"}
    attention = [layer.self_attn for layer in drafter.layers]
    windows = [a.sliding_window for a in attention]
    return {
        "rope_parameters": {**rope, "partial_rotary_factor": rotary_dim / head_dim},
        "rope_layout": "neox",
        "head_dim": head_dim,
        "rotary_dim": rotary_dim,
        "num_attention_heads": int(config.num_attention_heads),
        "num_key_value_heads": int(config.num_key_value_heads),
        "hidden_size": int(config.hidden_size),
        "intermediate_size": int(config.intermediate_size),
        "num_hidden_layers": len(attention),
        "layer_types": [a.layer_type for a in attention],
        "layer_windows": windows,
        "sliding_window": next((w for w in windows if w is not None), None),
        "sliding_window_non_causal": drafter.attention.sliding_window_non_causal if any(windows) else None,
        # Where the training mask counts a sliding window from (trainer/model/attention_mask.py): every slot
        # of a block sees the W positions before the ANCHOR, as speculators / vLLM serve it; z-lab 0.1.0 and
        # SGLang count from each query (playbooks/serving/engines.yaml).
        "window_origin": WINDOW_FROM_ANCHOR if any(windows) else None,
        "draft_config": {key: getattr(config, key, None) for key in (
            "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "layer_types",
            "sliding_window", "use_sliding_window", "max_window_layers", "rope_parameters")},
    }


def absolute_inputs(config: TrainConfig) -> dict[str, str]:
    """`target` and `data` paths made absolute (the built-in names, 'embedded' ..., stay as they are)."""
    from trainer.target.embedded import BUILT_IN_TARGETS

    update = {}
    for key in ("target", "data"):
        value = getattr(config, key)
        if value != "embedded" and not (key == "target" and value in BUILT_IN_TARGETS):
            update[key] = str(Path(value).expanduser().resolve())
    return update


def _check_same_inputs(run: RunDir, target_fingerprint: str, data_fingerprint: str) -> None:
    """A resumed run must see the target and data it started with, or it is not the same run."""
    info = run.read_info()
    now = {"target": target_fingerprint, "data": data_fingerprint}
    for what in ("target", "data"):
        started = (info.get(what) or {}).get("fingerprint")
        if started and started != now[what]:
            raise RunError(
                f"run {run.name!r} started on another {what} (fingerprint {started[:12]}, now "
                f"{now[what][:12]}); resuming would not continue the same run: start a new one"
            )


class _Validator:
    """Loss and accuracy on held-out documents, with the training step itself (no grad).

    The batches and their anchors are the same at every validation (drawn from (seed, index) over the
    held-out rows), so successive rows measure the drafter, not the sample. Under torchrun every rank
    takes its slice and the numbers are summed over ranks exactly as training's are.
    """

    def __init__(self, config: TrainConfig, target: FrozenTarget, plan: StepPlan, dist: Distributed,
                 device: torch.device) -> None:
        documents = load_documents(config.data, target.tokenizer, split="heldout")
        self.packed = pack_documents(documents, config.seq_len, target.pad_token_id)
        self.config, self.target, self.plan, self.dist, self.device = config, target, plan, dist, device

    @torch.no_grad()
    def metrics(self, model: torch.nn.Module) -> dict[str, Any]:
        was_training = model.training
        model.eval()
        rows = self.dist.rows(self.config.batch_size)
        totals: dict[str, Any] = {}
        loss_sum = 0.0
        for index in range(1, self.config.val_batches + 1):
            batch = batch_for_step(self.packed, index, self.config.batch_size, self.config.seed)
            anchors, anchor_valid = sample_step_anchors(batch, self.plan, self.config.seed, index)
            local = {key: value[rows].to(self.device) for key, value in batch.items()}
            loss, metrics = training_step(self.target, model, local, anchors[rows], anchor_valid[rows], self.plan)
            loss_sum += float(loss)
            for key, value in metrics["counts"].items():
                if isinstance(value, list):
                    totals[key] = [a + b for a, b in zip(totals.get(key, [0.0] * len(value)), value)]
                else:
                    totals[key] = totals.get(key, 0.0) + value
        model.train(was_training)
        summed = self.dist.sum({"loss": loss_sum, **totals})
        loss = summed.pop("loss") / (self.dist.world_size * self.config.val_batches)
        return {key: _round(value) for key, value in {"loss": loss, **metrics_from_counts(summed)}.items()}


class _Evaluator:
    """Real speculative decoding on held-out prompts: tau every eval_every steps, full report at the end."""

    def __init__(self, config: TrainConfig, target: FrozenTarget, vocab_ids: torch.Tensor | None = None) -> None:
        from trainer.data.datasets import heldout_prompts

        self.config = config
        self.target = target
        self.vocab_ids = vocab_ids
        self.prompts = heldout_prompts(config.data, target.tokenizer, config.eval_prompts)
        self.feature_layer_ids = config.fc_layer_ids(target.num_layers)
        # How the prompts were rendered (eval.json `prompts`), next to run.json's record for the training data.
        self.rendering = chat_rendering(load_documents(config.data, target.tokenizer, "heldout"), target.tokenizer)

    def _run(self, drafter: DFlashDrafter, measure_speedup: bool) -> dict[str, Any]:
        # The periodic tau needs only the speculative loop; the final report also times plain greedy
        # decoding (speedup) and checks losslessness against it.
        from trainer.eval.speculative import evaluate_served_by_engine

        report = self._evaluate(drafter, measure_speedup=measure_speedup, check_lossless=measure_speedup,
                                teacher_forcing=training_semantics(self.config, self.target))
        if measure_speedup:
            # The final report: a sliding-window drafter is also decoded as each engine whose windows differ
            # from ours builds it (z-lab 0.1.0 and SGLang count them from the query, SpecForge's loop ignores
            # them), so eval.json says what each engine's users will see (sleuth: dflash.sliding_window_served).
            report.served_by_engine = evaluate_served_by_engine(
                drafter, report, lambda engine: self._evaluate(drafter, measure_speedup=False, check_lossless=True,
                                                               teacher_forcing=None, served_as=engine))
        return report.model_dump()

    def _evaluate(self, drafter: DFlashDrafter, **options: Any) -> Any:
        from trainer.eval.speculative import evaluate, proposer_for

        # Offline hidden states: generation needs the whole target, loaded when eval first runs.
        target = self.target.full_target() if hasattr(self.target, "full_target") else self.target
        return evaluate(
            proposer_for(drafter, target, self.vocab_ids, confidence_min=draft_confidence_min(self.config)),
            target,
            self.prompts,
            feature_layer_ids=self.feature_layer_ids,
            block_size=self.config.block_size,
            max_new_tokens=self.config.eval_max_new_tokens,
            seed=self.config.seed,
            **options,
        )

    def tau(self, drafter: DFlashDrafter) -> dict[str, Any]:
        """The metrics-row fields of a periodic eval: real tau next to the training objective's acceptance
        on the same sequences (field names in docs/reference/run-directory.md)."""
        return eval_row_fields(self._run(drafter, measure_speedup=False))

    def full(self, drafter: DFlashDrafter) -> dict[str, Any]:
        return {**self._run(drafter, measure_speedup=True), "prompts": self.rendering}


def draft_confidence_min(config: TrainConfig) -> float | None:
    """The run's confidence-scheduled drafting threshold (DSpark's decoding setting; None for other kinds)."""
    return config.dspark.draft_confidence_min if config.dspark is not None else None


def training_semantics(config: TrainConfig, target: FrozenTarget) -> Any:
    """What the run's training step scores a slot against, for teacher-forced acceptance at eval time.
    None for the other kinds: the replay scores the unary argmax of DFlash's slots, while DFlash2 proposes
    through its candidate selector and DSpark adds its Markov head, so it would not describe what they serve."""
    from trainer.eval.teacher_forced import TrainingSemantics

    if config.drafter_kind != "dflash":
        return None

    plan = StepPlan.from_config(config, target)
    return TrainingSemantics(
        feature_layer_ids=plan.feature_layer_ids,
        logits_source=plan.logits_source,
        context_includes_anchor=plan.context_includes_anchor,
        block_size=plan.block_size,
        mask_token_id=plan.mask_token_id,
        loss_chunk_size=plan.loss_chunk_size,
    )


def eval_row_fields(report: dict[str, Any]) -> dict[str, Any]:
    """`tau` plus the teacher-forced acceptance and the per-prompt values sleuth's train-serve check reads."""
    row: dict[str, Any] = {
        "tau": round(report["tau"], 4),
        "tau_per_prompt": [None if t is None else round(t, 4) for t in report.get("tau_per_prompt", [])],
    }
    teacher_forced = report.get("teacher_forced")
    if teacher_forced:
        row["tf_acceptance"] = round(teacher_forced["acceptance"], 4)
        row["tf_acceptance_per_prompt"] = [
            None if a is None else round(a, 4) for a in teacher_forced["acceptance_per_prompt"]
        ]
        if teacher_forced.get("at_verify") is not None:
            # The block-by-block comparison at the anchors serving used (trainer.eval.teacher_forced).
            for key in ("at_verify", "tau_at_verify"):
                row[f"tf_{key}"] = round(teacher_forced[key], 4)
                row[f"tf_{key}_per_prompt"] = [
                    None if a is None else round(a, 4) for a in teacher_forced[f"{key}_per_prompt"]
                ]
            # How many compared steps differ, and in which direction: the noise model of the comparison.
            row["tf_verify_steps_above"] = teacher_forced["verify_steps_above"]
            row["tf_verify_steps_below"] = teacher_forced["verify_steps_below"]
        if teacher_forced.get("label_agreement") is not None:
            row["tf_label_agreement"] = round(teacher_forced["label_agreement"], 4)
            row["tf_label_slots"] = teacher_forced["label_slots"]
    return row


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, (list, tuple)):
        return [_round(v) for v in value]
    return value


@dataclass
class LoadedRun:
    config: TrainConfig
    target: FrozenTarget
    drafter: DFlashDrafter
    step: int
    feature_layer_ids: list[int]
    run: RunDir
    draft_token_ids: torch.Tensor | None = None  # a reduced draft vocabulary's target ids

    def proposer(self) -> Any:
        """What speculative decoding drafts with: the drafter on the target's embeddings and head."""
        from trainer.eval.speculative import proposer_for

        return proposer_for(self.drafter, self.target, self.draft_token_ids,
                            confidence_min=draft_confidence_min(self.config))


def load_run(run_dir: Path, device: str | torch.device = "auto") -> LoadedRun:
    """The run's drafter at its latest checkpoint, on its target, ready for inference."""
    run = RunDir(Path(run_dir))
    config = run.load_config()
    torch_device = resolve_device(device) if isinstance(device, str) else device
    checkpoint = latest_checkpoint(run.checkpoints_dir)
    if checkpoint is None:
        raise RunError(f"run {run.name!r} has no checkpoint yet ({run.checkpoints_dir})")
    check_checkpoint_files(checkpoint, run.path, (DRAFTER_FILE,))  # before the slow target load
    target = FrozenTarget.load(
        config.target, torch_device, compute_dtype(config, torch_device), mask_token_id=config.mask_token_id
    )
    config = resolve_for_target(config, target.num_layers)
    vocab_ids = None
    if config.draft_vocab_size:
        vocab_file = run.path / VOCAB_FILE
        if not vocab_file.is_file():
            raise RunError(f"run {run.name!r} has a draft vocabulary but no {VOCAB_FILE}")
        vocab_ids = load_vocab(vocab_file)
    recorded = run.read_info().get("target_fidelity") or {}
    if recorded.get("packing") in PACKING_MODES:  # pack rows as the run did (probes read features this way)
        target.packing = recorded["packing"]
    plan = StepPlan.from_config(config, target, vocab_ids)
    drafter = build_drafter(config, target, plan)
    load_drafter_weights(drafter, checkpoint)
    drafter.eval()
    return LoadedRun(
        draft_token_ids=vocab_ids,
        config=config,
        target=target,
        drafter=drafter,
        step=checkpoint.step,
        feature_layer_ids=plan.feature_layer_ids,
        run=run,
    )
