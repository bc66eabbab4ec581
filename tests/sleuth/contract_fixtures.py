"""Real parts for the contract-check tests: a tiny Qwen3 target saved with save_pretrained, its tokenizer,
run directories written as the run-directory contract describes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL = ["<|endoftext|>", "<|pad|>", "<|bos|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "user", "assistant"]
CHAT_TEMPLATE = ("{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def save_tokenizer(path: Path, *, mask: bool = True) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|pad|>", bos_token="<|bos|>",
        mask_token="<|mask|>" if mask else None, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return tokenizer


def save_target(path: Path, *, layers: int = 4, partial_rotary_factor: float | None = None, seed: int = 0) -> Path:
    """A random tiny Qwen3 causal LM (vocab 32, hidden 16) and its tokenizer, from_pretrained-loadable."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=128, eos_token_id=0, pad_token_id=1,
        bos_token_id=2,
    )
    if partial_rotary_factor is not None:
        config.partial_rotary_factor = partial_rotary_factor
    Qwen3ForCausalLM(config).save_pretrained(path)
    save_tokenizer(path)
    return path


def write_run(path: Path, *, target: Path | None = None, config: dict[str, Any] | None = None,
              data: dict[str, Any] | None = None, eval_report: dict[str, Any] | None = None,
              metrics: list[dict[str, Any]] | None = None, drafter: dict[str, Any] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    run = {"format_version": 1, "name": path.name, "status": "completed", "steps_done": 40,
           "created": "2026-11-30T12:00:00+00:00",
           "target": {"path": str(target) if target else None, "fingerprint": "t", "num_layers": 4},
           "data": {"source": "embedded", "fingerprint": "d", **(data or {})}}
    if drafter is not None:
        run["drafter"] = drafter
    (path / "run.json").write_text(json.dumps(run))
    (path / "config.json").write_text(json.dumps({"block_size": 8, "mask_token_id": None, **(config or {})}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in metrics or []))
    if eval_report is not None:
        (path / "eval.json").write_text(json.dumps(eval_report))
    return path
