"""Tiny causal LMs for tests, saved with save_pretrained and used as targets: one builder module for every test.

- `save_family_target`: many Hugging Face families with the same small dimensions (hidden 32, 4 layers,
  2 heads) and, where the family has one, a sliding window of SLIDING_WINDOW tokens: far shorter than the
  documents the tests pack, so a packed forward that drops the window shows up against the model's own.
- `char_tokenizer` + `save_tiny_qwen3`: a character-level tokenizer without a mask token and a tiny Qwen3
  (hidden 32, 8 layers by default) on it, the target of the export and foreign-eval tests.
- `save_tiny_qwen3_5`: a tiny `qwen3_5` hybrid (linear + full attention, partial rotary, interleaved mRoPE),
  the target of the sliding-window drafter's export and parity tests.
- `save_small_corpus`: the first documents of the embedded corpus as a `.txt` data file: a run that needs
  a few packed rows then tokenizes and packs a hundred documents instead of 3200 (most of a tiny run's cost).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import math
import string

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
    """A config of `cls_name` with the shared sizes; `extra` adds family fields or overrides the defaults (None:
    leave the field to the family's own default)."""
    def build(vocab_size: int, tokenizer: Any) -> Any:
        import transformers

        config_cls = getattr(transformers, cls_name)
        sizes = {"intermediate_size": 64, "num_key_value_heads": 1, "head_dim": HEAD_DIM, **extra}
        return config_cls(**_common(vocab_size, tokenizer), **{k: v for k, v in sizes.items() if v is not None})

    return build


# Multi-head latent attention (DeepSeek-V3, Kimi Linear): low-rank K/V, a decoupled rotary part; no head_dim.
_MLA = dict(
    num_key_value_heads=HEADS, head_dim=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
)
# Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5/3.6): one key head, two value heads of 8.
_GATED_DELTANET = dict(
    linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8, linear_value_head_dim=8,
)
_SMALL_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


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
    # Qwen3.5 / 3.6 text (the story's target family): Gated DeltaNet alternating with gated full attention,
    # partial rotary; the dense and the mixture-of-experts variant
    "qwen3_5": _llama_like("Qwen3_5TextConfig", layer_types=_alternating("linear_attention"), **_GATED_DELTANET),
    "qwen3_5_moe": _llama_like(
        "Qwen3_5MoeTextConfig", layer_types=_alternating("linear_attention"), shared_expert_intermediate_size=32,
        **_GATED_DELTANET, **_SMALL_MOE,
    ),
    # MLA with a first dense layer, then routed experts
    "deepseek_v3": _llama_like(
        "DeepseekV3Config", q_lora_rank=24, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_group=1, topk_group=1, first_k_dense_replace=1, **_MLA,
    ),
    "glm4_moe": _llama_like(
        "Glm4MoeConfig", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
    ),
    # Kimi Delta Attention (a recurrent state, per-channel gates) alternating with MLA
    "kimi_linear": _llama_like(
        "KimiLinearConfig", layer_types=_alternating("linear_attention"), q_lora_rank=None, num_local_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, linear_head_dim=8, linear_num_heads=2, **_MLA,
    ),
    "olmo3": _llama_like("Olmo3Config", sliding_window=SLIDING_WINDOW, layer_types=_alternating()),
    # Mamba-2 layers (a recurrent SSM state) alternating with attention
    "granitemoehybrid": _llama_like(
        "GraniteMoeHybridConfig", head_dim=None, layer_types=_alternating("mamba"), num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=32, mamba_n_heads=4, mamba_d_state=8, mamba_d_head=16,
        mamba_chunk_size=16,
    ),
    # lightning attention (a decayed K^T V state, in MiniMax's own cache class) alternating with full attention
    "minimax": _llama_like(
        "MiniMaxConfig", layer_types=_alternating("linear_attention"), num_local_experts=4, num_experts_per_tok=2,
        block_size=16,
    ),
    "seed_oss": _llama_like("SeedOssConfig"),
    "ernie4_5": _llama_like("Ernie4_5Config"),
    "hunyuan_v1_dense": _llama_like("HunYuanDenseV1Config"),
    # Gemma 4 text: per-layer head_dim (full-attention layers wider), proportional partial rotary on them,
    # per-layer input embeddings
    "gemma4_text": lambda vocab_size, tokenizer: _llama_like(
        "Gemma4TextConfig", sliding_window=SLIDING_WINDOW, layer_types=_alternating(), global_head_dim=2 * HEAD_DIM,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab_size,
    )(vocab_size, tokenizer),
}
SLIDING_FAMILIES = frozenset(
    {"mistral", "phi3", "gemma2", "gemma3_text", "gpt_oss", "cohere2", "llama4_text", "olmo3", "gemma4_text"}
)
# Families with a recurrent state (linear attention, SSM): no packed mask can reproduce them (the state would
# flow across documents), so they train per document; and a rejected verify block must roll the state back.
RECURRENT_FAMILIES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "granitemoehybrid", "minimax"})
PER_DOCUMENT_FAMILIES = RECURRENT_FAMILIES
# Decay of the recurrent state per token, exp(-A * softplus(...)) with A = exp(A_log): the random init draws A
# up to 16, so the tiny models forget their state within a token or two and a wrongly rolled-back state hardly
# shows. Trained models keep slow heads; the tiny ones get A = 0.02 (about 3 % forgotten per token).
SLOW_DECAY_A = 0.02


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
            if name.endswith("A_log"):  # a recurrent state that remembers (see SLOW_DECAY_A)
                param.fill_(math.log(SLOW_DECAY_A))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def char_tokenizer() -> Any:
    """Every printable character is a token (3 + 100 ids), with unk/eos/pad and no mask token: a run's mask
    token is then the first unused embedding row."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "<pad>": 2, **{c: i + 3 for i, c in enumerate(string.printable)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")


def save_tiny_qwen3(directory: Path, tokenizer: Any, *, layers: int = 8, rope_theta: float | None = None,
                    seed: int = 0) -> Path:
    """A random tiny Qwen3 (hidden 32, 4 heads of 8, 3 rows past the tokenizer) and `tokenizer` in `directory`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    rope = {} if rope_theta is None else {"rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}}
    config = Qwen3Config(
        vocab_size=len(tokenizer) + 3, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **rope,
    )
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_tiny_qwen3_5(directory: Path, tokenizer: Any, *, layers: int = 4, seed: int = 0) -> Path:
    """A random tiny transformers `qwen3_5` text model (the Qwen3.5 / Qwen3.6 family) and `tokenizer`: Gated
    DeltaNet linear attention with full attention every 4th layer, 4 / 1 heads of 16, and the published RoPE
    layout (partial rotary 0.25, interleaved mRoPE sections, theta 1e7), which a drafter must not copy."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer) + 3, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    Qwen3_5ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_small_corpus(path: Path, documents: int = 100) -> Path:
    """The first `documents` training documents of the embedded corpus, one per blank-line-separated block
    (every 20th is then held out: 5 held-out documents for eval prompts and the fidelity check)."""
    from trainer.data.corpus import embedded_documents

    # a blank line inside a document would split it: keep each one a single block
    texts = [doc.replace("\n\n", "\n") for doc in embedded_documents("train")[:documents]]
    path.write_text("\n\n".join(texts) + "\n")
    return path
