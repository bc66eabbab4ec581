"""The offline hidden-state cache: what is stored, and the checks that keep a run from misreading it.

Layout of a cache directory:
    manifest.json                 format_version, target (path, fingerprint, num_layers, hidden_size),
                                  data (source, fingerprint of the packed rows), seq_len, layers (z-lab ids
                                  stored: layer i is HF hidden_states[i + 1]), rows, rows_per_shard, dtype,
                                  logits_check (the head recomputation checked against the model's own
                                  logits), complete
    shard-00000.safetensors       rows [k*rows_per_shard, (k+1)*rows_per_shard) of the packed data:
                                  `input_ids`, `position_ids` [n, S] (the key a training batch is found by)
                                  and `layer.<i>` [n, S, H] for every stored layer i

The final layer's entry (`layer.<L-1>`, HF hidden_states[L]) is always stored: transformers hands it out
already through the final norm, so the teacher's logits are the target's lm_head over it (plus the
family's final soft-capping), which generation verified against the model's own logits.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from trainer.target.frozen import TargetError
from trainer import safe_io

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class HiddenStateError(TargetError):
    """The cache cannot serve this run; one line saying why and what to do (a target problem to the CLI)."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def row_key(input_ids: Tensor, position_ids: Tensor) -> str:
    """A packed row's identity: the target's hidden states are a function of its tokens and positions
    (positions restart at every document, so they also fix the document boundaries)."""
    digest = hashlib.sha256(input_ids.to(torch.int64).contiguous().numpy().tobytes())
    digest.update(position_ids.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


# Every field a reader of the manifest relies on, with its type: a manifest that lacks one or holds another
# type is damaged (one line naming the field), never a KeyError or TypeError deep in generation or training.
_INT, _STR, _NUM, _BOOL, _DICT, _INTS = "an integer", "a string", "a number", "true or false", "an object", "a list of integers"
_MANIFEST_FIELDS = {
    "target": _DICT, "target.path": _STR, "target.fingerprint": _STR, "target.num_layers": _INT,
    "target.hidden_size": _INT, "data": _DICT, "data.fingerprint": _STR, "seq_len": _INT, "layers": _INTS,
    "rows": _INT, "rows_per_shard": _INT, "shards": _INT, "dtype": _STR, "logits_check": _DICT,
    "logits_check.max_abs_logit_diff": _NUM, "complete": _BOOL,
}
# A shard holds at least one row: more shards than this would be an index of a billion rows.
_MAX_SHARDS = 10**6


def _is(kind: str, value: Any) -> bool:
    integer = isinstance(value, int) and not isinstance(value, bool)
    return {
        _INT: integer and value >= 0,
        _STR: isinstance(value, str),
        _NUM: isinstance(value, (int, float)) and not isinstance(value, bool) and value == value,
        _BOOL: isinstance(value, bool),
        _DICT: isinstance(value, dict),
        _INTS: isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
    }[kind]


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise HiddenStateError(f"{path} is not a regular file; the cache is damaged: generate into an empty --out")
        if path.stat().st_size > 1 << 20:
            raise HiddenStateError(f"{path} is {path.stat().st_size} bytes, more than a manifest can be; the cache is damaged")
        manifest = safe_io.loads_json(path.read_text(encoding="utf-8"))  # nesting bounded: ValueError
    except FileNotFoundError:
        raise HiddenStateError(f"{directory} is not a hidden-state cache (no {MANIFEST}): make one with "
                               "`trainer hidden-states generate --out DIR`") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        first = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise HiddenStateError(f"{path} cannot be read ({first}); the cache is damaged: generate into an empty "
                               "--out") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise HiddenStateError(f"{path} is not a hidden-state manifest of format {FORMAT_VERSION}")
    for dotted, kind in _MANIFEST_FIELDS.items():
        value: Any = manifest
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if not _is(kind, value):
            raise HiddenStateError(f"{path}: `{dotted}` is {'missing' if value is None else repr(value)[:40]}, not "
                                   f"{kind}; the manifest is damaged: generate into an empty --out")
    if manifest["shards"] > _MAX_SHARDS or manifest["rows_per_shard"] == 0:
        raise HiddenStateError(f"{path}: {manifest['shards']} shards of {manifest['rows_per_shard']} rows is not a "
                               "cache generate writes; the manifest is damaged")
    return manifest


def _check_shard_shapes(path: Path, shapes: dict[str, list[int]], manifest: dict[str, Any], rows: int) -> None:
    """Every stored layer of a shard is [rows, seq_len, the target's hidden size], from its header: a shard of
    another target (another width) copied into the directory is named with its width, before any training
    step meets it as a bare shape error."""
    width, seq_len = manifest["target"]["hidden_size"], manifest["seq_len"]
    for layer in manifest["layers"]:
        shape = shapes.get(f"layer.{layer}")
        if shape is None:
            raise HiddenStateError(f"{path} holds no layer {layer} (the manifest lists {manifest['layers']}): it is "
                                   "not a shard of this cache; regenerate it")
        if len(shape) != 3 or shape[2] != width:
            raise HiddenStateError(f"{path}: layer {layer} has width {shape[-1] if shape else '?'}, but this cache's "
                                   f"target has hidden size {width} (manifest.json): the shard comes from another "
                                   "target; regenerate it into this directory or use a cache of one target")
        if shape[:2] != [rows, seq_len]:
            raise HiddenStateError(f"{path}: layer {layer} has shape {shape}, not [{rows}, {seq_len}, {width}]; the "
                                   "shard is damaged or from another cache: regenerate it")


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    # trainer.safe_io: a temporary file of our own (never a planted `.manifest.json.<pid>.tmp`), renamed
    safe_io.write_json(directory / MANIFEST, manifest, indent=1)


@dataclass
class HiddenStateCache:
    directory: Path
    manifest: dict[str, Any]
    index: dict[str, tuple[int, int]]  # row key -> (shard, row within the shard)

    @classmethod
    def open(cls, directory: Path) -> HiddenStateCache:
        directory = Path(directory).expanduser().resolve()
        manifest = read_manifest(directory)
        if not manifest.get("complete"):
            raise HiddenStateError(f"hidden-state cache {directory} is incomplete: run the same "
                                   "`trainer hidden-states generate` again to finish it")
        index: dict[str, tuple[int, int]] = {}
        for shard in range(manifest["shards"]):
            path = directory / shard_name(shard)
            try:
                with safe_open(str(path), framework="pt") as handle:
                    ids, positions = handle.get_tensor("input_ids"), handle.get_tensor("position_ids")
                    shapes = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}
            except Exception as exc:  # safetensors raises several types for a missing or damaged file
                raise HiddenStateError(f"{path} cannot be read ({type(exc).__name__}): regenerate the cache") from None
            _check_shard_shapes(path, shapes, manifest, rows=ids.shape[0])
            for row in range(ids.shape[0]):
                index[row_key(ids[row], positions[row])] = (shard, row)
        return cls(directory, manifest, index)

    @property
    def layers(self) -> list[int]:
        return list(self.manifest["layers"])

    def check_serves(self, *, target_fingerprint: str, data_fingerprint: str, seq_len: int,
                     layers: list[int]) -> None:
        """Refuse a cache made for another target, other data or without a layer the run reads."""
        made = self.manifest
        if made["target"]["fingerprint"] != target_fingerprint:
            raise HiddenStateError(f"hidden states in {self.directory} come from another target "
                                   f"(fingerprint {made['target']['fingerprint'][:12]}, this run's {target_fingerprint[:12]})")
        if made["seq_len"] != seq_len or made["data"]["fingerprint"] != data_fingerprint:
            raise HiddenStateError(f"hidden states in {self.directory} were made for other packed data "
                                   f"(seq_len {made['seq_len']}, data {made['data']['fingerprint'][:12]}; this run: "
                                   f"seq_len {seq_len}, data {data_fingerprint[:12]})")
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            raise HiddenStateError(f"hidden states in {self.directory} lack layer(s) {missing} that this run reads "
                                   f"(stored: {self.layers}); regenerate with those target_layer_ids")

    def gather(self, input_ids: Tensor, position_ids: Tensor, layers: list[int],
               doc_ids: Tensor | None = None) -> dict[int, Tensor]:
        """{layer: [N, S, H]} for the rows of a batch, found by content (whole rows: doc_ids unused)."""
        locations = []
        for row in range(input_ids.shape[0]):
            key = row_key(input_ids[row].cpu(), position_ids[row].cpu())
            if key not in self.index:
                raise HiddenStateError(f"a training row is not in the hidden-state cache {self.directory}: "
                                       "it was made for other data")
            locations.append(self.index[key])
        out: dict[int, list[Tensor]] = {layer: [] for layer in layers}
        for shard, row in locations:
            handle = self._handle(shard)
            for layer in layers:
                out[layer].append(handle.get_slice(f"layer.{layer}")[row : row + 1])
        return {layer: torch.cat(parts) for layer, parts in out.items()}

    def _handle(self, shard: int) -> Any:
        # Shards are memory-mapped once and read row by row: a batch touches a few rows of a few shards.
        handles = self.__dict__.setdefault("_handles", {})
        if shard not in handles:
            handles[shard] = safe_open(str(self.directory / shard_name(shard)), framework="pt")
        return handles[shard]
