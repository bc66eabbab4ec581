"""The probe's synthetic target as a Hugging Face model directory, for trainers that load their target from disk.

speculators and SpecForge build their drafters from a verifier / target *path*: its config (depth, sizes),
its weights (embeddings, lm_head, final norm) and its tokenizer (the mask token). Writing the probe's
target there lets their own loaders, layer-id rules and mask-token resolution run, instead of the adapter
handing them the answers. The decoder layers are random (the probe supplies every hidden state itself);
the tokenizer has V-1 tokens, token 0 the pad and token 1 the eos (as Qwen3's: two different tokens, no mask
token), so the one unused embedding row is the mask token a trainer should pick.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch

from sleuth.probes.target import EOS_TOKEN, PAD_TOKEN


def owned_scratch(owner: object, prefix: str) -> Path:
    """A temporary directory that lives as long as `owner`: removed when it is collected or at exit. Inside the
    sandbox TMPDIR is the box's and goes with it; a subject built in-process (the parity tests build them directly) would
    otherwise leave a target checkpoint in the user's /tmp per subject and variant."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    weakref.finalize(owner, shutil.rmtree, str(path), True)
    return path


def write_target_dir(target: Any, path: Path, num_layers: int | None = None,
                     checkpoint_keys: tuple[str, ...] = (), family: str = "qwen3") -> Path:
    """save_pretrained of a Qwen3 causal LM carrying the target's embeddings, lm_head and final norm, plus a
    tokenizer; `num_layers` overrides the depth (a config for another depth, e.g. to call a layer-id rule).

    `checkpoint_keys` are tensor names a run's config reads from its target's checkpoint (SpecForge's
    `embedding_key`, `lm_head_key`): a real target's layout (`model.language_model.embed_tokens.weight` for a
    Qwen3.5/3.6 target) is not the probe target's. A name absent from the saved checkpoint is added, holding
    the tensor its last components name (`embed_tokens.weight` or `lm_head.weight`), so the run's own loading
    path reads it; a name that exists is left alone (a key naming the wrong tensor stays wrong, and shows),
    and a name of neither kind is not invented (the run's loader then fails, and the probe says so).

    `family="qwen3_5"` writes the target as a Qwen3.5 / 3.6 text checkpoint instead (the story's target's
    family): see `_write_qwen3_5`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if family == "qwen3_5":
        return _write_qwen3_5(target, path, num_layers)

    path.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(**target.config_kwargs(num_layers or target.num_layers))
    config.pad_token_id = config.bos_token_id = PAD_TOKEN
    config.eos_token_id = EOS_TOKEN
    if num_layers is not None and num_layers != target.num_layers:
        config.save_pretrained(path)  # a rule only reads the depth
        return path
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(target.embed_weight)
        model.lm_head.weight.copy_(target.lm_head_weight)
        model.model.norm.weight.copy_(target.norm_weight)
    model.save_pretrained(path)
    if checkpoint_keys:
        _add_checkpoint_keys(path, checkpoint_keys)
    write_tokenizer(path, target.vocab_size)
    return path


def _write_qwen3_5(target: Any, path: Path, num_layers: int | None) -> Path:
    """A Qwen3.5 / 3.6 text model's checkpoint (`Qwen3_5ForCausalLM`, config `qwen3_5_text`, transformers'
    defaults for the rest: partial_rotary_factor 0.25, linear-attention layer types) with the final norm in its
    family's convention, x * (1 + w): the checkpoint holds w - 1 for the probe target's gain w, so a trainer that
    reads the convention computes the same teacher as on a Qwen3 target, and one that applies x * w another. The
    text model, not the multimodal wrapper: loading that one's processor needs torchvision. Only the tensors a
    drafter trainer borrows are written; the decoder layers are never run (the probe supplies every hidden state)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = {**target.config_kwargs(num_layers or target.num_layers), "model_type": "qwen3_5_text",
              "architectures": ["Qwen3_5ForCausalLM"], "pad_token_id": PAD_TOKEN, "eos_token_id": EOS_TOKEN,
              "bos_token_id": PAD_TOKEN}
    (path / "config.json").write_text(json.dumps(config))
    if num_layers is not None and num_layers != target.num_layers:
        return path
    save_file({"model.embed_tokens.weight": target.embed_weight.contiguous(),
               "model.norm.weight": (target.norm_weight.float() - 1.0).contiguous(),
               "lm_head.weight": target.lm_head_weight.contiguous()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(path, target.vocab_size)
    return path


def _add_checkpoint_keys(path: Path, names: tuple[str, ...]) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    by_suffix = {"embed_tokens.weight": tensors.get("model.embed_tokens.weight"),
                 "lm_head.weight": tensors.get("lm_head.weight", tensors.get("model.embed_tokens.weight"))}
    added = False
    for name in names:
        source = next((t for suffix, t in by_suffix.items() if name.endswith(suffix) and t is not None), None)
        if name not in tensors and source is not None:
            tensors[name] = source.clone()
            added = True
    if added:
        save_file(tensors, str(file), metadata={"format": "pt"})


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over V-1 tokens, pad "<|endoftext|>" = 0 and eos "<|im_end|>" = 1 (Qwen3's layout):
    no mask token, one free row."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": PAD_TOKEN, "<|im_end|>": EOS_TOKEN,
             **{f"t{i}": i for i in range(max(PAD_TOKEN, EOS_TOKEN) + 1, vocab_size - 1)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                        unk_token="<|endoftext|>")
    tokenizer.save_pretrained(path)
    # Some loaders look for a generation config's eos; keep the ids in one place.
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_TOKEN, "pad_token_id": PAD_TOKEN}))
