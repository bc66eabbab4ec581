"""`trainer hidden-states generate`: run the target once over a run's packed training data.

The data, target and layers come from the same config as `trainer run` (preset, --config, --set), so a
run with that config and `hidden_states: DIR` reads exactly the rows it would have computed online.
Shards are written atomically and skipped when present, so a killed generation resumes; under torchrun
each rank writes the shards whose index is its rank modulo the world size (no collectives: the last rank
to finish finds every shard present and marks the manifest complete).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer.config import TrainConfig, resolve_for_target
from trainer.data.datasets import load_documents, pack_documents
from trainer.hidden_states.cache import FORMAT_VERSION, HiddenStateError, read_manifest, shard_name, write_manifest
from trainer.run.fidelity_gate import check_target_fidelity
from trainer.run.checkpoint import write_safetensors
from trainer.target.frozen import FrozenTarget

# The recomputed teacher logits must equal the model's own; float32 on one machine gives 0 exactly.
LOGITS_TOLERANCE = 1e-5


def stored_layers(config: TrainConfig, num_layers: int) -> list[int]:
    """Every layer a run with this config reads: the selected ones, an intermediate logits source, and
    the final layer (the teacher logits are computed from it)."""
    layers = set(config.target_layer_ids or []) | {num_layers - 1}
    if isinstance(config.target_logits_source, int):
        layers.add(config.target_logits_source)
    return sorted(layers)


def head_logits(target: Any, final_hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits from its final-normed last hidden state: its own head (FrozenTarget.teacher_head:
    lm_head, then the family's logit scale or final soft-capping where it has one)."""
    return target.teacher_logits(final_hidden)


def generate(config: TrainConfig, out: Path, *, device: torch.device, dtype: torch.dtype,
             rows_per_shard: int = 16, note: Callable[[str, bool], None] = lambda line, last: None) -> dict[str, Any]:
    """`note(line, last)` reports each shard written; `last` marks this process's final one (a throttled
    writer shows it whatever the time since the line before)."""
    out = Path(out).expanduser().resolve()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    target = FrozenTarget.load(config.target, device, dtype, mask_token_id=config.mask_token_id)
    config = resolve_for_target(config, target.num_layers)
    # The same check a run makes (and the packing it picks), before any state is stored.
    fidelity = check_target_fidelity(config, target, announce=rank == 0)
    layers = stored_layers(config, target.num_layers)
    packed = pack_documents(load_documents(config.data, target.tokenizer, split="train"), config.seq_len,
                            target.pad_token_id)
    shards = (packed.num_rows + rows_per_shard - 1) // rows_per_shard
    manifest = {
        "format_version": FORMAT_VERSION,
        "target": {"path": str(target.path), "fingerprint": target.fingerprint, "num_layers": target.num_layers,
                   "hidden_size": target.hidden_size},
        "data": {"source": config.data, "fingerprint": packed.fingerprint},
        "seq_len": config.seq_len,
        "layers": layers,
        "rows": packed.num_rows,
        "rows_per_shard": rows_per_shard,
        "shards": shards,
        "dtype": str(dtype).removeprefix("torch."),
        "logits_check": {"max_abs_logit_diff": 0.0, "tolerance": LOGITS_TOLERANCE},
        "target_fidelity": fidelity.to_json(),
        "complete": False,
    }
    out.mkdir(parents=True, exist_ok=True)
    if (out / "manifest.json").exists():
        existing = read_manifest(out)
        same = {k: existing.get(k) for k in ("target", "data", "seq_len", "layers", "rows_per_shard", "dtype")}
        if same != {k: manifest[k] for k in same}:
            raise HiddenStateError(f"{out} holds hidden states of other inputs or layers; choose an empty --out")
        manifest["logits_check"] = existing.get("logits_check", manifest["logits_check"])
    elif any(out.iterdir()):
        raise HiddenStateError(f"{out} is not empty and holds no hidden-state cache; choose an empty --out")
    if rank == 0:
        try:
            write_manifest(out, manifest)
        except OSError as exc:
            raise _resumable(exc, out) from None

    final = target.num_layers - 1
    worst = float(manifest["logits_check"]["max_abs_logit_diff"])
    mine = range(rank, shards, world)
    for shard in mine:
        path = out / shard_name(shard)
        if path.exists():
            continue  # written atomically: present means complete
        rows = slice(shard * rows_per_shard, min((shard + 1) * rows_per_shard, packed.num_rows))
        ids, positions, docs = packed.input_ids[rows], packed.position_ids[rows], packed.doc_ids[rows]
        features, logits = target.forward_packed(ids, positions, docs, layers, "final")  # [n, S, len*H], [n, S, V]
        per_layer = features.split(target.hidden_size, dim=-1)
        tensors = {f"layer.{layer}": part.contiguous().cpu() for layer, part in zip(layers, per_layer)}
        # The stored final layer must reproduce the teacher exactly, or a run from the cache would not be
        # the run it replaces: checked on every shard, recorded in the manifest.
        recomputed = head_logits(target, per_layer[layers.index(final)])
        diff = float((recomputed - logits).abs().max()) if logits.numel() else 0.0
        if diff > LOGITS_TOLERANCE:
            raise HiddenStateError(
                f"{type(target.model).__name__}'s logits are not lm_head of its final hidden state (max abs "
                f"difference {diff:.3g}): offline hidden states cannot reproduce this target's teacher"
            )
        worst = max(worst, diff)
        tensors["input_ids"], tensors["position_ids"] = ids.contiguous(), positions.contiguous()
        try:
            # staged and renamed by write_safetensors (trainer.safe_io), which raises a full disk as the
            # OSError it is; the shards before are intact and the same command resumes after them
            write_safetensors(tensors, path, metadata={"layers": ",".join(map(str, layers))})
        except OSError as exc:
            raise _resumable(exc, out) from None
        note(f"shard {shard + 1}/{shards} ({rows.stop - rows.start} rows)", shard == mine[-1])
    if all((out / shard_name(i)).exists() for i in range(shards)):
        manifest["logits_check"]["max_abs_logit_diff"] = max(worst, float(read_manifest(out)["logits_check"]["max_abs_logit_diff"]))
        manifest["complete"] = True
        try:
            write_manifest(out, manifest)
        except OSError as exc:
            raise _resumable(exc, out) from None
    return manifest


def _resumable(exc: OSError, out: Path) -> Exception:
    """A write that failed (a full disk, a read-only folder): one line saying what is intact and how to go on."""
    where = f" {exc.filename}" if exc.filename else f" in {out}"
    if exc.errno == errno.ENOSPC:
        return HiddenStateError(f"disk full writing{where}: the shards written so far are intact; free space, then "
                                "rerun the same `trainer hidden-states generate` command to continue")
    return HiddenStateError(f"cannot write{where}: {exc.strerror or exc}; the shards written so far are intact and "
                            "the same command continues after them")
