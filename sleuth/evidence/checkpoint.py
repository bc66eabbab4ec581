"""Checkpoint evidence from the safetensors header alone: tensor names, dtypes and shapes, no torch.

A safetensors file starts with an 8-byte little-endian header length N, then N bytes of JSON mapping
each tensor name to {"dtype", "shape", "data_offsets"}. Reading just that is instant even for a large
checkpoint, and is enough to tell e.g. how many target layers fc reads (fc.weight is [H, k*H]).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.artifacts import ArtifactError, parse_json, regular_file, shown
from sleuth.evidence.config import lookup
from sleuth.evidence.registry import checkpoint_reader

# A header larger than this is not a drafter checkpoint we should trust (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000

# Fallback names when a caller gives none; the playbook's `checkpoint.tensors` list is what the engine uses.
FC_TENSOR_NAMES = ("fc.weight", "proj.weight", "context_proj.weight", "feature_fusion.weight", "fusion.weight")
FC_NORM_TENSOR_NAMES = ("hidden_norm.weight", "fc_norm.weight", "context_norm.weight", "fusion_norm.weight")
EMBED_HEAD_NAMES = ("embed_tokens", "embedding", "embeddings", "wte", "tok_embeddings", "lm_head", "output_head")


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
        if not regular_file(path):  # a FIFO or a device would block the open, or never end
            raise CheckpointError(f"{shown(path)}: missing")
    except ArtifactError as exc:
        raise CheckpointError(f"{shown(path)}: {exc.reason}") from None
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
        header = parse_json(raw, path)  # bounded: depth, number length
    except ArtifactError as exc:
        raise CheckpointError(f"{shown(path)}: header is not valid JSON ({exc.reason})") from None
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


def find_fc(tensors: dict[str, TensorInfo], names: tuple[str, ...] | list[str] = FC_TENSOR_NAMES) -> TensorInfo | None:
    """The fusion projection: a known name, else the one 2-D weight whose input is a multiple (>1) of its output."""
    for name in names:
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


def find_fc_norm(tensors: dict[str, TensorInfo], names: tuple[str, ...] | list[str] = FC_NORM_TENSOR_NAMES) -> TensorInfo | None:
    for name in names:
        if name in tensors:
            return tensors[name]
    return None


def embed_head_tensors(tensors: dict[str, TensorInfo], names: tuple[str, ...] | list[str] = EMBED_HEAD_NAMES) -> list[str]:
    """Tensors of an embedding or vocabulary head: `<...>.<name>.weight` for a module name in `names`."""
    pattern = re.compile(r"(^|\.)(" + "|".join(names) + r")\.weight$")
    return sorted(name for name in tensors if pattern.search(name))


def draft_layer_count(tensors: dict[str, TensorInfo]) -> int | None:
    indices = {int(m.group(1)) for name in tensors if (m := re.match(r"(?:.*\.)?layers\.(\d+)\.", name))}
    return max(indices) + 1 if indices else None


# --- checkpoint readers: (CheckpointInput) -> CheckpointReading, registered by the id the playbook names ----


@dataclass
class CheckpointInput:
    path: Path
    header: dict[str, TensorInfo]
    tensors: list[str]  # the playbook's tensor names for this rule
    config: dict[str, Any] | None
    config_source: str


@dataclass
class CheckpointReading:
    """What the weights say about one rule. `value` None: they do not decide it (`reason` says why)."""

    value: object | None = None
    confidence: float = 0.0
    evidence: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, location, value)
    detail: str = ""
    count: int | None = None
    reason: str | None = None
    outcome: str = ""  # one line for the trace


@checkpoint_reader("fc_layer_count")
def read_fc_layer_count(inp: CheckpointInput) -> CheckpointReading:
    fc = find_fc(inp.header, inp.tensors or FC_TENSOR_NAMES)
    if fc is None:
        return CheckpointReading(reason="the checkpoint holds no fusion projection weight",
                                 outcome="no fusion projection (fc.weight [H, k*H]) in the checkpoint")
    counted = fc_layer_count(fc)
    if counted is None:
        return CheckpointReading(reason=f"{fc.name} has shape {list(fc.shape)}, not [H, k*H]",
                                 outcome=f"{fc.name} {list(fc.shape)} is not of the form [H, k*H]")
    k, hidden = counted
    evidence = [("checkpoint", f"{inp.path}:{fc.name}", f"shape {list(fc.shape)}: k={k}, H={hidden}")]
    ids = lookup(inp.config, ["target_layer_ids", "aux_hidden_state_layer_ids"])
    if ids is None or not isinstance(ids[1], list):
        return CheckpointReading(
            reason=f"fc.weight says fc reads k={k} layers, but the number of selected target layers is unknown (no config)",
            outcome=f"{fc.name} {list(fc.shape)}: k={k}; how many layers were selected is unknown")
    selected = len(ids[1])
    evidence.append(("config", f"{inp.config_source}:{ids[0]}", str(ids[1])))
    value = "all" if k == selected else "subset"
    return CheckpointReading(value, 0.9, evidence, f"fc reads {k} of {selected} selected layers", k,
                             outcome=f"{fc.name} {list(fc.shape)}: fc reads k={k} layers of {selected} selected -> {value}")


@checkpoint_reader("fc_norm_present")
def read_fc_norm_present(inp: CheckpointInput) -> CheckpointReading:
    norm = find_fc_norm(inp.header, inp.tensors or FC_NORM_TENSOR_NAMES)
    if norm is None:
        return CheckpointReading(
            reason="no norm weight beside fc in the checkpoint; a parameter-free norm would not show, so this is not evidence of its absence",
            outcome="no norm tensor beside fc (a parameter-free norm would not show): undecided")
    return CheckpointReading("normed", 0.8, [("checkpoint", f"{inp.path}:{norm.name}", f"shape {list(norm.shape)}")],
                             outcome=f"{norm.name} present")


@checkpoint_reader("embed_head_absent")
def read_embed_head_absent(inp: CheckpointInput) -> CheckpointReading:
    found = embed_head_tensors(inp.header, inp.tensors or EMBED_HEAD_NAMES)
    if found:
        return CheckpointReading(reason=f"the checkpoint holds {', '.join(found)}; a frozen copy looks the same, so this does not decide",
                                 outcome=f"holds {', '.join(found)}: may be frozen copies, undecided")
    if find_fc(inp.header) is None:
        return CheckpointReading(outcome="not a drafter checkpoint (no fc): undecided")
    return CheckpointReading("frozen", 0.6, [("checkpoint", str(inp.path), "no embed_tokens / lm_head tensors among the trained drafter weights")],
                             "embedding and head are not among the trained weights",
                             outcome="no embedding or lm_head among the trained weights")
