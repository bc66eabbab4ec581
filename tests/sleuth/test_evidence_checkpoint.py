"""Checkpoint evidence from the safetensors header only (no torch)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from sleuth.evidence import checkpoint as ckpt


def _write(path: Path, tensors: dict[str, tuple[int, ...]]) -> Path:
    save_file({name: np.zeros(shape, np.float32) for name, shape in tensors.items()}, str(path))
    return path


def test_header_shapes_and_fc_layer_count(tmp_path: Path):
    path = _write(tmp_path / "d.safetensors", {"fc.weight": (16, 80), "hidden_norm.weight": (16,), "layers.0.mlp.up_proj.weight": (32, 16),
                                                "layers.1.mlp.up_proj.weight": (32, 16)})
    header = ckpt.read_header(path)
    assert header["fc.weight"].shape == (16, 80)
    fc = ckpt.find_fc(header)
    assert ckpt.fc_layer_count(fc) == (5, 16)
    assert ckpt.find_fc_norm(header).name == "hidden_norm.weight"
    assert ckpt.draft_layer_count(header) == 2
    assert ckpt.embed_head_tensors(header) == []


def test_fc_found_by_shape_under_another_name(tmp_path: Path):
    header = ckpt.read_header(_write(tmp_path / "d.safetensors", {"context_fuser.weight": (8, 24), "norm.weight": (8,)}))
    assert ckpt.fc_layer_count(ckpt.find_fc(header)) == (3, 8)


def test_hand_written_header_matches_naive_parse(tmp_path: Path):
    # 8-byte little-endian length, then JSON: written by hand, independent of the safetensors library
    header = {"fc.weight": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]}, "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    path = tmp_path / "hand.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 32)
    assert ckpt.read_header(path)["fc.weight"].shape == (2, 4)


@pytest.mark.parametrize("content", [b"", b"\x01\x02", struct.pack("<Q", 10**12), struct.pack("<Q", 20) + b"{not json",
                                     struct.pack("<Q", 4) + b"[1,2"])
def test_corrupt_files_raise_checkpoint_error(tmp_path: Path, content: bytes):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ckpt.CheckpointError):
        ckpt.read_header(path)


def test_truncated_data_is_detected(tmp_path: Path):
    path = _write(tmp_path / "d.safetensors", {"fc.weight": (16, 80)})
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ckpt.CheckpointError, match="truncated"):
        ckpt.read_header(path)


def test_missing_file_is_a_checkpoint_error(tmp_path: Path):
    with pytest.raises(ckpt.CheckpointError):
        ckpt.read_header(tmp_path / "nope.safetensors")


def test_no_torch_import():
    # the static checks too: they share rules with the probes (sleuth/probes/exported.py), which import torch late
    code = "import sys; sys.path.insert(0, %r); import sleuth.invariants, sleuth.evidence.checkpoint, sleuth.checks; print('torch' in sys.modules)" % str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


@pytest.mark.parametrize("shape, offsets", [(["a"], [0, 4]), ([4], ["x", 4]), ([4], [0])])
def test_a_malformed_shape_or_offset_is_a_checkpoint_error(tmp_path: Path, shape, offsets):
    # Must become an `unknown` with a reason upstream, never an internal error.
    header = json.dumps({"fc.weight": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(ckpt.CheckpointError, match="malformed shape or offsets"):
        ckpt.read_header(path)
