"""Tiny causal LMs of many Hugging Face families, saved with save_pretrained for use as targets.

Every family gets the same small dimensions (hidden 32, 4 layers, 2 heads) and, where it has one, a
sliding window of SLIDING_WINDOW tokens: far shorter than the documents the tests pack, so a packed
forward that drops the window shows up as a difference against the model's own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HIDDEN = 32
LAYERS = 4
HEADS = 2
HEAD_DIM = 16
SLIDING_WINDOW = 8
MAX_POSITIONS = 512


def _common(vocab_size: int, tokenizer: Any) -> dict[str, Any]:
    return dict(
        vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False,
    )


def _llama_like(cls_name: str, **extra: Any) -> Callable[[int, Any], Any]:
    def build(vocab_size: int, tokenizer: Any) -> Any:
        import transformers

        config_cls = getattr(transformers, cls_name)
        return config_cls(
            **_common(vocab_size, tokenizer), intermediate_size=64, num_key_value_heads=1, head_dim=HEAD_DIM,
            **extra,
        )

    return build


def _alternating(kind: str = "sliding_attention") -> list[str]:
    return [kind if i % 2 == 0 else "full_attention" for i in range(LAYERS)]


def _gpt2(vocab_size: int, tokenizer: Any) -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POSITIONS,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False,
    )


def _gpt_neox(vocab_size: int, tokenizer: Any) -> Any:
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(**_common(vocab_size, tokenizer), intermediate_size=64)


# name -> config builder. Sliding-window families use a window far below the document lengths.
FAMILIES: dict[str, Callable[[int, Any], Any]] = {
    "llama": _llama_like("LlamaConfig"),
    "qwen2": _llama_like("Qwen2Config", use_sliding_window=False),
    "qwen3": _llama_like("Qwen3Config"),
    "qwen3_moe": _llama_like("Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mistral": _llama_like("MistralConfig", sliding_window=SLIDING_WINDOW),
    "phi3": _llama_like("Phi3Config", sliding_window=SLIDING_WINDOW),
    "olmo2": _llama_like("Olmo2Config"),
    "gemma2": _llama_like(
        "Gemma2Config", sliding_window=SLIDING_WINDOW, layer_types=_alternating(), query_pre_attn_scalar=HEAD_DIM,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    ),
    "gemma3_text": _llama_like(
        "Gemma3TextConfig", sliding_window=SLIDING_WINDOW, layer_types=_alternating(), query_pre_attn_scalar=HEAD_DIM,
        final_logit_softcapping=30.0,
    ),
    "gpt_oss": _llama_like(
        "GptOssConfig", sliding_window=SLIDING_WINDOW, layer_types=_alternating(), num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "cohere2": _llama_like("Cohere2Config", sliding_window=SLIDING_WINDOW, layer_types=_alternating()),
    # chunked (local) attention on 3 of 4 layers
    "llama4_text": _llama_like(
        "Llama4TextConfig", attention_chunk_size=SLIDING_WINDOW, intermediate_size_mlp=64, num_local_experts=2,
    ),
    # hybrid: gated delta-net linear attention (a recurrent state) alternating with full attention
    "qwen3_next": _llama_like(
        "Qwen3NextConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=_alternating("linear_attention"),
    ),
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
}
SLIDING_FAMILIES = frozenset({"mistral", "phi3", "gemma2", "gemma3_text", "gpt_oss", "cohere2", "llama4_text"})
# Families no packed mask can reproduce (a recurrent state would flow across documents): per-document forwards.
PER_DOCUMENT_FAMILIES = frozenset({"qwen3_next"})


def save_family_target(family: str, directory: Path, tokenizer: Any, seed: int = 0) -> Path:
    """A randomly initialised tiny `family` model and `tokenizer`, saved to `directory`."""
    from transformers import AutoModelForCausalLM

    config = FAMILIES[family](len(tokenizer), tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        # Random init leaves norms at 1 (or 0 for Gemma's 1+w) and sinks at one value: perturb everything a
        # little so a skipped norm, sink or scale changes the output.
        for name, param in model.named_parameters():
            if "norm" in name or "sinks" in name:
                param.add_(0.3 * torch.rand_like(param))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
