"""Checkpoint evidence from the safetensors header alone: tensor names, dtypes and shapes, no torch.

A safetensors file starts with an 8-byte little-endian header length N, then N bytes of JSON mapping
each tensor name to {"dtype", "shape", "data_offsets"}. Reading just that is instant even for a large
checkpoint, and is enough to tell e.g. how many target layers fc reads (fc.weight is [H, k*H]).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

# A header larger than this is not a drafter checkpoint we should trust (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000

# Names a fusion projection goes by in the implementations we know (z-lab/speculators: fc).
FC_TENSOR_NAMES = ("fc.weight", "proj.weight", "context_proj.weight", "feature_fusion.weight", "fusion.weight")
FC_NORM_TENSOR_NAMES = ("hidden_norm.weight", "fc_norm.weight", "context_norm.weight", "fusion_norm.weight")
EMBED_HEAD_PATTERN = re.compile(r"(^|\.)(embed_tokens|embeddings?|wte|tok_embeddings|lm_head|output_head)\.weight$")


class CheckpointError(Exception):
    """The file is missing, truncated or not a safetensors file; the message says which."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo, from the header only. Raises CheckpointError with a one-line reason."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            size_bytes = handle.read(8)
            if len(size_bytes) < 8:
                raise CheckpointError(f"{path}: truncated (shorter than the 8-byte safetensors header length)")
            (header_len,) = struct.unpack("<Q", size_bytes)
            if header_len == 0 or header_len > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: not a safetensors file (header length {header_len})")
            raw = handle.read(header_len)
            file_size = path.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(raw) < header_len:
        raise CheckpointError(f"{path}: truncated header ({len(raw)} of {header_len} bytes)")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    tensors: dict[str, TensorInfo] = {}
    data_len = file_size - 8 - header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or "shape" not in entry or "data_offsets" not in entry:
            raise CheckpointError(f"{path}: malformed header entry for {name!r}")
        try:
            begin, end = (int(offset) for offset in entry["data_offsets"])
            shape = tuple(int(d) for d in entry["shape"])
        except (TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed shape or offsets for {name!r}") from None
        if end > data_len:
            raise CheckpointError(f"{path}: truncated data ({name} ends at byte {end}, file holds {data_len})")
        tensors[name] = TensorInfo(name, str(entry.get("dtype")), shape)
    return tensors


def find_fc(tensors: dict[str, TensorInfo]) -> TensorInfo | None:
    """The fusion projection: a known name, else the one 2-D weight whose input is a multiple (>1) of its output."""
    for name in FC_TENSOR_NAMES:
        if name in tensors and len(tensors[name].shape) == 2:
            return tensors[name]
    candidates = [
        t
        for t in tensors.values()
        if len(t.shape) == 2
        and t.name.count(".") == 1  # top-level module, not inside a decoder layer
        and t.shape[0] > 0
        and t.shape[1] % t.shape[0] == 0
        and t.shape[1] // t.shape[0] > 1
    ]
    return candidates[0] if len(candidates) == 1 else None


def fc_layer_count(fc: TensorInfo) -> tuple[int, int] | None:
    """(k, H) from fc.weight [H, k*H]; None when the shape is not of that form."""
    if len(fc.shape) != 2 or fc.shape[0] == 0 or fc.shape[1] % fc.shape[0]:
        return None
    return fc.shape[1] // fc.shape[0], fc.shape[0]


def find_fc_norm(tensors: dict[str, TensorInfo]) -> TensorInfo | None:
    for name in FC_NORM_TENSOR_NAMES:
        if name in tensors:
            return tensors[name]
    return None


def embed_head_tensors(tensors: dict[str, TensorInfo]) -> list[str]:
    return sorted(name for name in tensors if EMBED_HEAD_PATTERN.search(name))


def draft_layer_count(tensors: dict[str, TensorInfo]) -> int | None:
    indices = {int(m.group(1)) for name in tensors if (m := re.match(r"(?:.*\.)?layers\.(\d+)\.", name))}
    return max(indices) + 1 if indices else None
