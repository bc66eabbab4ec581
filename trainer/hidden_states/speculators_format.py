"""speculators' offline hidden states (0.9.0) as a run's `hidden_states: DIR`.

What speculators writes (read from its source: `cli/generate_offline_data.py`, `data_generation/offline.py`,
`train/data.py` ArrowDataset, hs_connectors `transfer.py`): one file per dataset sample,
`<data>/hidden_states/hs_<i>.safetensors` (i = the row of the prepared dataset), written by vLLM's
hidden-states connector, holding
    token_ids       int64 [S]               the sample's tokens (one sample, never packed)
    hidden_states   [S, k + 1, H]           bf16 (or fp8 with `hidden_states_scales` [S, 1, 1] fp32)
The k + 1 entries are the layers the vLLM server extracted: the k ids of speculators' `--target-layer-ids`
(vLLM's convention: id i is HF `hidden_states[i]`, the input of decoder layer i; default [2, L//2, L-3])
and last the final layer that `launch_vllm.py` appends (id L: the last decoder layer's output, before the
final norm; speculators' trainer applies `verifier_norm` itself before the lm_head).

The files record neither the layer ids nor the target, so the run says which ids the server used
(`hidden_states_layers`, required) and the reader checks what the files do carry:
the layer count, the hidden size, finite values on read (speculators' own check), and every training
document's tokens, by content. Our rows pack several documents; a document's states are its file's states
(the fidelity check holds the packed forward to the per-document one), and the first `seq_len` tokens of a
longer sample are its file's first `seq_len` states (causal). A later chunk of a document cut by packing
has no stored states (the server saw it with its context): refused with one line.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from trainer.hidden_states.cache import HiddenStateError

FILE_PATTERN = re.compile(r"hs_(\d+)\.safetensors")
SCALES_KEY = "hidden_states_scales"  # hs_connectors' fp8 files: per-token scales


def speculators_dir(directory: Path) -> Path | None:
    """The directory holding `hs_<i>.safetensors` files: DIR itself or speculators' `DIR/hidden_states`."""
    for candidate in (directory, directory / "hidden_states"):
        if candidate.is_dir() and any(FILE_PATTERN.fullmatch(p.name) for p in candidate.iterdir()):
            return candidate
    return None


def _token_key(tokens: Tensor) -> str:
    return hashlib.sha256(tokens.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


@dataclass
class SpeculatorsHiddenStates:
    """The same interface as HiddenStateCache (layers, check_serves, gather, manifest) over speculators' files."""

    directory: Path
    vllm_layer_ids: list[int]  # the k extracted ids, vLLM convention; entry k of a file is the final layer
    num_layers: int
    files: dict[int, Path]
    tokens: dict[int, Tensor]  # file index -> token ids
    final_normed: bool = False  # the stored final layer is before the final norm (vLLM's residual stream)
    _by_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (file, length)
    _handles: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, directory: Path, *, vllm_layer_ids: list[int] | None, num_layers: int,
             hidden_size: int) -> SpeculatorsHiddenStates:
        found = speculators_dir(Path(directory).expanduser().resolve())
        if found is None:
            raise HiddenStateError(f"{directory} holds no speculators hidden states (hs_<i>.safetensors)")
        if vllm_layer_ids is None:
            raise HiddenStateError(f"speculators' files in {found} do not record which layers they hold: set "
                                   "hidden_states_layers to the --target-layer-ids the vLLM server used (vLLM ids)")
        ids = list(vllm_layer_ids)
        if any(not 0 <= i < num_layers for i in ids):
            raise HiddenStateError(f"hidden_states_layers {ids} must be vLLM layer ids in 0..{num_layers - 1} "
                                   f"(the final layer {num_layers} is the entry launch_vllm.py appends)")
        files = {int(m.group(1)): p for p in found.iterdir() if (m := FILE_PATTERN.fullmatch(p.name))}
        tokens: dict[int, Tensor] = {}
        for index, path in sorted(files.items()):
            try:
                with safe_open(str(path), framework="pt") as handle:
                    keys = set(handle.keys())
                    if not {"token_ids", "hidden_states"} <= keys:
                        raise HiddenStateError(f"{path} lacks token_ids or hidden_states: not a speculators "
                                               "hidden-state file")
                    shape = handle.get_slice("hidden_states").get_shape()
                    tokens[index] = handle.get_tensor("token_ids")
            except HiddenStateError:
                raise
            except Exception as exc:  # safetensors raises several types for a damaged or truncated file
                raise HiddenStateError(f"{path} cannot be read ({type(exc).__name__}): regenerate it with "
                                       "speculators generate-offline-data") from None
            if len(shape) != 3 or shape[0] != tokens[index].numel():
                raise HiddenStateError(f"{path}: hidden_states {shape} is not [tokens {tokens[index].numel()}, "
                                       "layers, hidden]")
            if shape[1] != len(ids) + 1:
                raise HiddenStateError(
                    f"{path} stores {shape[1]} layers, but hidden_states_layers {ids} plus the final layer make "
                    f"{len(ids) + 1}: set hidden_states_layers to the --target-layer-ids the vLLM server used")
            if shape[2] != hidden_size:
                raise HiddenStateError(f"{path} has hidden size {shape[2]}, the target {hidden_size}: these "
                                       "hidden states come from another target")
        reader = cls(found, ids, num_layers, files, tokens)
        for index, ids_of_file in tokens.items():
            reader._by_tokens.setdefault(_token_key(ids_of_file), (index, ids_of_file.numel()))
        return reader

    @property
    def layers(self) -> list[int]:
        """Stored layers in z-lab ids (HF hidden_states[i + 1]); the final layer is L - 1."""
        return sorted({i - 1 for i in self.vllm_layer_ids if i >= 1} | {self.num_layers - 1})

    @property
    def manifest(self) -> dict[str, Any]:
        return {"format": "speculators", "directory": str(self.directory), "files": len(self.files),
                "vllm_layer_ids": self.vllm_layer_ids, "final_normed": False}

    def check_serves(self, *, target_fingerprint: str, data_fingerprint: str, seq_len: int,
                     layers: list[int]) -> None:
        """The layers the run reads must be stored (the target and data are checked by what the files
        carry: hidden size at open, every document's tokens when read)."""
        del target_fingerprint, data_fingerprint  # speculators' files record neither
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            stored = sorted(self.layers)
            raise HiddenStateError(
                f"speculators hidden states in {self.directory} lack layer(s) {missing} (z-lab ids) that this run "
                f"reads; stored: {stored} (vLLM ids {self.vllm_layer_ids} + the final layer): set target_layer_ids "
                "to stored ones or regenerate with those --target-layer-ids")
        for index, ids in self.tokens.items():  # a sample longer than a row: its first chunk is its prefix
            if ids.numel() > seq_len:
                self._by_tokens.setdefault(_token_key(ids[:seq_len]), (index, seq_len))

    def gather(self, input_ids: Tensor, position_ids: Tensor, layers: list[int],
               doc_ids: Tensor | None = None) -> dict[int, Tensor]:
        """{layer: [N, S, H]} for packed rows: each document's states from its file; padding stays zero."""
        if doc_ids is None:
            raise HiddenStateError("speculators hidden states are found per document: doc_ids are needed")
        slot = {layer: self.vllm_layer_ids.index(layer + 1) for layer in layers if layer != self.num_layers - 1}
        if self.num_layers - 1 in layers:
            slot[self.num_layers - 1] = len(self.vllm_layer_ids)
        n, s = input_ids.shape
        out: dict[int, Tensor] | None = None
        for row in range(n):
            for doc in torch.unique(doc_ids[row]).tolist():
                if doc < 0:
                    continue
                span = (doc_ids[row] == doc).nonzero().flatten()
                start, end = int(span[0]), int(span[-1]) + 1
                located = self._by_tokens.get(_token_key(input_ids[row, start:end].cpu()))
                if located is None or int(position_ids[row, start]) != 0:
                    raise HiddenStateError(
                        f"a training document ({end - start} tokens) has no speculators hidden states in "
                        f"{self.directory}: the files were made from other data, or the document is a later "
                        "chunk of one longer than seq_len (raise seq_len)")
                states = self._read(located[0], end - start)  # [len, k + 1, H]
                if out is None:
                    out = {layer: states.new_zeros((n, s, states.shape[-1])) for layer in layers}
                for layer in layers:
                    out[layer][row, start:end] = states[:, slot[layer]]
        if out is None:
            raise HiddenStateError("packed rows hold no document (every position is padding)")
        return out

    def _read(self, index: int, length: int) -> Tensor:
        if index not in self._handles:
            self._handles[index] = safe_open(str(self.files[index]), framework="pt")
        handle = self._handles[index]
        states = handle.get_slice("hidden_states")[:length]
        if SCALES_KEY in handle.keys():  # hs_connectors' fp8 files: dequantised as its FP8Transfer does (bf16)
            states = states.to(torch.bfloat16) * handle.get_slice(SCALES_KEY)[:length].to(torch.bfloat16)
        if not bool(torch.isfinite(states.float()).all()):  # speculators' check_hidden_states
            raise HiddenStateError(f"{self.files[index]} holds non-finite hidden states: regenerate it")
        return states
