"""The frozen target: any Hugging Face causal LM, run over packed rows to give features and teachers.

The drafter is conditioned on the outputs of selected target layers and trained toward the target's
own predictions, so this module is where two DFlash invariants live:
- `dflash.target_layer_ids`: layer id i (z-lab convention) is the output of decoder layer i, which is
  HF `hidden_states[i + 1]` because `hidden_states[0]` is the embedding output.
- `dflash.target_logits_source`: "final" logits are the model's own output, lm_head(norm(h_L)).

The teacher is handed over as hidden states (`forward_hidden`) plus the target's head (`teacher_head`:
lm_head and the family's output transform): at a 248k vocabulary the [N, S, V] logits of a packed batch
are the largest tensor of a step, and the loss needs them only at the slots it trains, chunk by chunk
(trainer/model/loss.py). The model's forward is asked for one position's logits only (logits_to_keep).

Rows are packed (several documents per row); the target must compute on each document exactly what it
would compute on that document alone (`dflash.target_forward_fidelity`): positions restart at 0 for every
document and attention is block-diagonal causal, with each layer's own variant on top (sliding windows
per layer type, chunked attention, sinks, soft-capping all live inside the model). transformers builds
those per-layer masks itself; we only tell it where documents start. Three ways, tried in this order by
the fidelity check (trainer/target/fidelity.py), which keeps the first that reproduces the model's own
forward on a held-out document longer than any window:
- "positions": no mask, positions that restart per document; transformers' masking_utils detects the
  packing from the positions and builds every layer type's mask (most models);
- "layer_masks": the same per-layer-type masks built here with masking_utils and handed over as a
  {layer_type: mask} mapping (models whose forward builds masks without the positions, e.g. gpt-oss);
- "varlen": only on CUDA with flash-linear-attention (`fla`) importable: every document of the batch laid
  end to end in one row, with their boundaries handed to the kernels (`cu_seq_lens_q/k`, `max_length_q/k`,
  `seq_idx`): fla's chunked linear-attention kernels take `cu_seqlens` and restart their recurrent state
  at each document, causal-conv1d takes `seq_idx`, and attention layers see positions that restart. Whether
  a family's layers all honour them is what the fidelity check measures: a layer that ignores them lets
  state flow across a boundary and fails it, and transformers' PyTorch fallbacks refuse them outright, so
  on CPU this way is never taken;
- "per_document": each document through the model alone (slower; exact for anything, e.g. recurrent
  linear-attention layers whose state would flow across a packed boundary).
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from trainer.model.loss import LogitsHead
from trainer.target.errors import TargetError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
# Weight files larger than this are fingerprinted by size, header and sampled chunks instead of every
# byte: hashing a 16 GB checkpoint on every run start would cost more than the run's first steps.
FULL_HASH_LIMIT = 512 * 1024 * 1024
SAMPLE_CHUNK = 4 * 1024 * 1024


PackingMode = Literal["positions", "layer_masks", "varlen", "per_document"]
PACKING_MODES: tuple[PackingMode, ...] = ("positions", "layer_masks", "varlen", "per_document")


def varlen_available(device: torch.device) -> bool:
    """Whether the "varlen" way can run here: flash-linear-attention's kernels are Triton, CUDA only."""
    import importlib.util

    return device.type == "cuda" and importlib.util.find_spec("fla") is not None


def fingerprint_model_dir(path: Path) -> str:
    """sha256 over config.json and the weight files (names, sizes and bytes): a stable target id."""
    digest = hashlib.sha256()
    files = [path / "config.json"] + sorted(
        p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
    )
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as handle:
            if size <= FULL_HASH_LIMIT:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
            else:
                for offset in (0, size // 2, max(0, size - SAMPLE_CHUNK)):
                    handle.seek(offset)
                    digest.update(handle.read(SAMPLE_CHUNK))
    return digest.hexdigest()


def _refuse_special_files(path: Path) -> None:
    """A FIFO or device among a model directory's files would block transformers' reads of it forever (or
    never end): refused by name before anything is loaded."""
    import stat

    for entry in path.iterdir():
        try:
            mode = entry.stat().st_mode
        except OSError:  # a dangling link: transformers reports the file it needed, if it needs it
            continue
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            raise TargetError(f"{entry} is not a regular file (a FIFO, socket or device); refusing to load {path}")


def _find_final_norm(model: nn.Module) -> nn.Module | None:
    base = getattr(model, "model", None) or getattr(model, "base_model", None)
    for owner in (base, getattr(base, "language_model", None), model):
        for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
            module = getattr(owner, name, None) if owner is not None else None
            if isinstance(module, nn.Module):
                return module
    return None


class FrozenTarget:
    """A frozen causal LM and its tokenizer; see the module docstring for the conventions."""

    def __init__(self, model: nn.Module, tokenizer: Any, path: Path, fingerprint: str,
                 mask_token_id: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.path = path
        self.fingerprint = fingerprint
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        self.num_layers: int = int(config.num_hidden_layers)
        self.hidden_size: int = int(config.hidden_size)
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.vocab_size: int = int(self.lm_head.weight.shape[0])
        _check_widths(model, self.lm_head, self.hidden_size)
        self.final_norm = _find_final_norm(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.eos_token_id: int | None = tokenizer.eos_token_id
        if self.eos_token_id is None and isinstance(getattr(config, "eos_token_id", None), int):
            self.eos_token_id = config.eos_token_id
        pad = tokenizer.pad_token_id
        fallback_pad = self.eos_token_id if self.eos_token_id is not None else 0
        self.pad_token_id: int = pad if pad is not None else fallback_pad
        self.mask_token_id: int = self._resolve_mask_token_id(mask_token_id)
        # How packed rows are run; the fidelity check at a run's start picks it by measurement.
        self.packing: PackingMode = "positions"
        self._keeps_logits: bool | None = None  # does the model's forward take logits_to_keep (see keep_logits)

    def _resolve_mask_token_id(self, override: int | None) -> int:
        if override is not None:
            if not 0 <= override < self.vocab_size:
                raise TargetError(
                    f"mask_token_id {override} is outside the target's vocabulary (0..{self.vocab_size - 1})"
                )
            return override
        if self.tokenizer.mask_token_id is not None:
            return int(self.tokenizer.mask_token_id)
        # An embedding row no token maps to is free to serve as the mask: the drafter never sees it
        # as a real token. Qwen-style checkpoints pad their vocabulary, so they have such rows.
        if len(self.tokenizer) < self.vocab_size:
            return len(self.tokenizer)
        raise TargetError(
            f"target {self.path} has no mask token and no unused embedding row; set mask_token_id in the config"
        )

    @classmethod
    def load(cls, target: str, device: torch.device, dtype: torch.dtype = torch.float32,
             mask_token_id: int | None = None) -> FrozenTarget:
        """A built-in target ("embedded", "embedded-qwen3_5": built once into the cache) or a Hugging Face
        causal-LM directory; never downloads."""
        from trainer.target.embedded import BUILT_IN_TARGETS, ensure_built_in_target

        if target in BUILT_IN_TARGETS:
            path = ensure_built_in_target(target)
        else:
            path = Path(target).expanduser()
        if not path.exists():
            raise TargetError(f"target directory {path} does not exist")
        if not path.is_dir():
            raise TargetError(f"target {path} is not a directory (expected a Hugging Face model directory)")
        if not (path / "config.json").is_file():
            raise TargetError(f"{path} is not a Hugging Face model directory (no config.json)")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise TargetError(f"{path} has no tokenizer (no tokenizer.json or tokenizer_config.json)")
        _refuse_special_files(path)

        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # Load reports and per-file progress bars are not the user's business; errors still raise.
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises many types here; all mean "unusable tokenizer"
            raise TargetError(f"cannot load the tokenizer in {path}: {_first_line(exc)}") from None
        model = None
        last_error: Exception | None = None
        # SDPA takes our dense packed mask directly; eager is the fallback for models without SDPA.
        for implementation in ("sdpa", "eager"):
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    path, dtype=dtype, attn_implementation=implementation, local_files_only=True
                )
                break
            except ValueError as exc:
                last_error = exc
                if "attn_implementation" not in str(exc) and "sdpa" not in str(exc).lower():
                    break
            except Exception as exc:
                last_error = exc
                break
        if model is None:
            raise TargetError(f"cannot load {path} as a causal LM: {_first_line(last_error)}")
        model.to(device)
        model.eval()
        model.requires_grad_(False)
        return cls(model, tokenizer, path, fingerprint_model_dir(path), mask_token_id)

    @torch.no_grad()
    def forward_hidden(self, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor,
                       feature_layer_ids: list[int], logits_source: str | int) -> tuple[Tensor, Tensor]:
        """Features [N, S, k*H] and the teacher's hidden states [N, S, H] of packed rows: what the target's
        head (`teacher_head`) turns into the teacher logits. The training step applies that head only
        where a slot needs it, so [N, S, V] logits are never built; see the module docstring."""
        self._check_feature_layers(feature_layer_ids)
        hidden_states, _ = self.forward_rows(input_ids, position_ids, doc_ids, with_logits=False)
        features = torch.cat([hidden_states[i + 1] for i in feature_layer_ids], dim=-1)  # [N, S, k*H]
        return features, self.teacher_hidden(hidden_states, logits_source)

    @torch.no_grad()
    def forward_packed(self, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor,
                       feature_layer_ids: list[int], logits_source: str | int) -> tuple[Tensor, Tensor]:
        """Features [N, S, k*H] and teacher logits [N, S, V] of packed rows, whole (for small inputs and
        tests; training uses forward_hidden): "final" is the model's own output, an intermediate layer id
        the target's head on that layer through the final norm."""
        self._check_feature_layers(feature_layer_ids)
        hidden_states, final_logits = self.forward_rows(input_ids, position_ids, doc_ids)
        features = torch.cat([hidden_states[i + 1] for i in feature_layer_ids], dim=-1)  # [N, S, k*H]
        if logits_source == "final":
            return features, final_logits
        return features, self.teacher_logits(self.teacher_hidden(hidden_states, logits_source))

    def _check_feature_layers(self, feature_layer_ids: list[int]) -> None:
        for layer in feature_layer_ids:
            if not 0 <= layer < self.num_layers:
                raise TargetError(f"feature layer {layer} is outside the target's layers 0..{self.num_layers - 1}")

    def teacher_hidden(self, hidden_states: tuple[Tensor, ...], logits_source: str | int) -> Tensor:
        """The head input of the teacher (`dflash.target_logits_source`): [N, S, H]."""
        if logits_source == "final":
            # transformers replaces the last hidden_states entry by the final-normed output: norm(h_L).
            return hidden_states[-1]
        if not isinstance(logits_source, int) or isinstance(logits_source, bool):
            raise TargetError(f"logits_source must be 'final' or a layer id, got {logits_source!r}")
        if not 0 <= logits_source < self.num_layers:
            raise TargetError(f"logits layer {logits_source} is outside the target's layers 0..{self.num_layers - 1}")
        if logits_source == self.num_layers - 1:
            return hidden_states[-1]  # already final-normed; normalising again would change it: this is "final"
        if self.final_norm is None:
            raise TargetError(f"cannot find the final norm of {type(self.model).__name__} for intermediate logits")
        return self.final_norm(hidden_states[logits_source + 1])  # [N, S, H]

    @torch.no_grad()
    def forward_rows(self, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor,
                     packing: PackingMode | None = None,
                     with_logits: bool = True) -> tuple[tuple[Tensor, ...], Tensor | None]:
        """All hidden states (L+1 entries of [N, S, H]; [0] is the embedding output) and the model's own
        logits [N, S, V] of packed rows (None without `with_logits`: the model then computes one position's
        only), computed the `packing` way (default: the target's chosen one)."""
        packing = packing or self.packing
        input_ids, position_ids = input_ids.to(self.device), position_ids.to(self.device)
        if packing == "per_document":
            return self._per_document(input_ids, position_ids, doc_ids.to(self.device), with_logits)
        if packing == "varlen":
            if not varlen_available(self.device):
                raise TargetError("target_packing 'varlen' runs flash-linear-attention's variable-length kernels, "
                                  "which need a CUDA device and the fla package; use target_packing: auto")
            return self._varlen(input_ids, position_ids, doc_ids.to(self.device), with_logits)
        if packing == "layer_masks":
            mask: Any = self._layer_masks(input_ids, position_ids)
        elif packing == "positions":
            mask = None  # transformers reads the document starts off the positions
        else:
            raise TargetError(f"unknown packing {packing!r}; choose one of {', '.join(PACKING_MODES)}")
        output = self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask, output_hidden_states=True,
            use_cache=False, **({} if with_logits else self.keep_logits(1)),
        )
        return tuple(output.hidden_states), output.logits if with_logits else None

    def keep_logits(self, count: int) -> dict[str, Any]:
        """Keyword asking the model's forward for its last `count` positions' logits only (transformers'
        logits_to_keep; nothing for a model without it): its own [N, S, V] would be the largest tensor of
        the target forward, and training takes the teacher from the hidden states instead."""
        if self._keeps_logits is None:
            try:
                self._keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
            except (TypeError, ValueError):
                self._keeps_logits = False
        return {"logits_to_keep": count} if self._keeps_logits else {}

    def _layer_masks(self, input_ids: Tensor, position_ids: Tensor) -> Any:
        """{layer type: mask} for packed rows (one mask when the config has no layer types), built by
        transformers' own masking_utils from the positions."""
        from transformers import masking_utils

        builders = {
            "full_attention": masking_utils.create_causal_mask,
            "sliding_attention": masking_utils.create_sliding_window_causal_mask,
            "chunked_attention": masking_utils.create_chunked_causal_mask,
        }
        n, s = input_ids.shape
        shape_only = torch.empty((n, s, 1), dtype=self.dtype, device=self.device)  # the builders read shape/dtype
        layer_types = getattr(self.config, "layer_types", None)
        if not layer_types:
            # One kind for every layer: the forward takes the single prepared 4D mask as it is.
            sliding = getattr(self.config, "sliding_window", None) and getattr(self.config, "use_sliding_window", True)
            kind = "sliding_attention" if sliding else "full_attention"
            return builders[kind](self.config, shape_only, None, None, position_ids=position_ids)
        unknown = set(layer_types) - set(builders)
        if unknown:
            raise TargetError(f"no packed mask for layer types {sorted(unknown)}; use per-document packing")
        return {kind: builders[kind](self.config, shape_only, None, None, position_ids=position_ids)
                for kind in set(layer_types)}

    def _varlen(self, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor,
                with_logits: bool = True) -> tuple[tuple[Tensor, ...], Tensor | None]:
        """Every document of the batch end to end in one row [1, T] with its boundaries for the kernels; the
        outputs go back to their [N, S] places (padding stays zero, as per document)."""
        n, s = input_ids.shape
        spans = self._document_spans(doc_ids)  # (row, start, end) in row order
        if not spans:
            raise TargetError("packed rows hold no document (every position is padding)")
        flat_ids = torch.cat([input_ids[row, start:end] for row, start, end in spans])[None]  # [1, T]
        flat_positions = torch.cat([position_ids[row, start:end] for row, start, end in spans])[None]  # [1, T]
        lengths = torch.tensor([end - start for _, start, end in spans], device=self.device)  # [D]
        cu_seqlens = torch.zeros(len(spans) + 1, dtype=torch.int32, device=self.device)
        cu_seqlens[1:] = lengths.cumsum(0)  # [D+1] document boundaries in the flat row
        seq_idx = torch.repeat_interleave(torch.arange(len(spans), dtype=torch.int32, device=self.device), lengths)
        longest = int(lengths.max())
        output = self.model(
            input_ids=flat_ids, position_ids=flat_positions, output_hidden_states=True, use_cache=False,
            cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=longest, max_length_k=longest,
            seq_idx=seq_idx[None],  # [1, T] for causal-conv1d / Mamba kernels
            **({} if with_logits else self.keep_logits(1)),
        )
        hidden = [h.new_zeros((n, s, h.shape[-1])) for h in output.hidden_states]
        logits = output.logits.new_zeros((n, s, output.logits.shape[-1])) if with_logits else None
        offset = 0
        for row, start, end in spans:
            flat = slice(offset, offset + end - start)
            for buffer, h in zip(hidden, output.hidden_states):
                buffer[row, start:end] = h[0, flat]
            if logits is not None:
                logits[row, start:end] = output.logits[0, flat]
            offset += end - start
        return tuple(hidden), logits

    @staticmethod
    def _document_spans(doc_ids: Tensor) -> list[tuple[int, int, int]]:
        """(row, start, end) of every document (doc id >= 0) of packed rows, in order."""
        spans = []
        for row in range(doc_ids.shape[0]):
            for doc in torch.unique(doc_ids[row]).tolist():
                if doc >= 0:
                    span = (doc_ids[row] == doc).nonzero().flatten()
                    spans.append((row, int(span[0]), int(span[-1]) + 1))
        return sorted(spans)

    def _per_document(self, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor,
                      with_logits: bool = True) -> tuple[tuple[Tensor, ...], Tensor | None]:
        n, s = input_ids.shape
        hidden: list[Tensor] | None = None
        logits: Tensor | None = None
        for row, start, end in self._document_spans(doc_ids):  # padding stays zero: no loss, no anchor
            output = self.model(
                input_ids=input_ids[row:row + 1, start:end], position_ids=position_ids[row:row + 1, start:end],
                output_hidden_states=True, use_cache=False, **({} if with_logits else self.keep_logits(1)),
            )
            if hidden is None:
                hidden = [h.new_zeros((n, s, h.shape[-1])) for h in output.hidden_states]
                logits = output.logits.new_zeros((n, s, output.logits.shape[-1])) if with_logits else None
            for buffer, h in zip(hidden, output.hidden_states):
                buffer[row, start:end] = h[0]
            if logits is not None:
                logits[row, start:end] = output.logits[0]
        if hidden is None:
            raise TargetError("packed rows hold no document (every position is padding)")
        return tuple(hidden), logits

    def embed(self, ids: Tensor) -> Tensor:
        """Frozen target token embeddings: [..] ids -> [.., H]."""
        return self.model.get_input_embeddings()(ids)

    def draft_head(self, vocab_ids: Tensor | None = None) -> LogitsHead:
        """The frozen lm_head the drafter shares (`dflash.frozen_embed_head`), no final norm (the drafter
        applies its own) and no output transform; with a draft vocabulary, only the rows of `vocab_ids`."""
        weight, bias = self._head_rows(vocab_ids)
        return LogitsHead(weight, bias)

    def teacher_head(self, vocab_ids: Tensor | None = None) -> LogitsHead:
        """The target's own head: lm_head, then the family's output transform (Cohere's logit_scale,
        Granite's logits_scaling, Gemma's final soft-capping), as its forward computes logits; with a draft
        vocabulary the teacher is restricted to the same tokens (speculators' verifier_lm_head[t2d])."""
        weight, bias = self._head_rows(vocab_ids)
        scale = getattr(self.config, "logit_scale", None)
        divisor = getattr(self.config, "logits_scaling", None)
        if isinstance(divisor, (int, float)) and not isinstance(divisor, bool) and divisor not in (0, 1):
            scale = (scale or 1.0) / divisor
        cap = getattr(self.config, "final_logit_softcapping", None)
        return LogitsHead(weight, bias, scale=float(scale) if isinstance(scale, (int, float)) else None,
                          softcap=float(cap) if isinstance(cap, (int, float)) and cap else None)

    def _head_rows(self, vocab_ids: Tensor | None) -> tuple[Tensor, Tensor | None]:
        bias = getattr(self.lm_head, "bias", None)
        if vocab_ids is None:
            return self.lm_head.weight, bias
        vocab_ids = vocab_ids.to(self.lm_head.weight.device)
        return self.lm_head.weight[vocab_ids], bias[vocab_ids] if bias is not None else None

    def logits(self, hidden: Tensor, vocab_ids: Tensor | None = None) -> Tensor:
        """The drafter's logits: `draft_head` on [.., H] -> [.., V] (or [.., Vd] with a draft vocabulary)."""
        return self.draft_head(vocab_ids)(hidden)

    def teacher_logits(self, hidden: Tensor, vocab_ids: Tensor | None = None) -> Tensor:
        """The teacher's logits: `teacher_head` on its hidden states [.., H] -> [.., V] (or [.., Vd])."""
        return self.teacher_head(vocab_ids)(hidden)


def _check_widths(model: nn.Module, lm_head: nn.Module, hidden_size: int) -> None:
    """The drafter adds the target's token embeddings to its hidden states and reads the target's lm_head off
    them: both must be hidden_size wide. OPT-350m's are not (word_embed_proj_dim 512, projected in and out)."""
    embedding = model.get_input_embeddings()
    widths = {"token embeddings": getattr(embedding, "weight", None), "lm_head": getattr(lm_head, "weight", None)}
    for name, weight in widths.items():
        if isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.shape[1] != hidden_size:
            raise TargetError(f"{type(model).__name__}: {name} {weight.shape[1]} wide, hidden states {hidden_size}; "
                              "DFlash's drafter works in the target's hidden space through its embeddings and "
                              "lm_head, so they must be as wide as the hidden states")


def _first_line(exc: BaseException | None) -> str:
    text = str(exc).strip() if exc is not None else "unknown error"
    return (text.splitlines() or [type(exc).__name__])[0]

