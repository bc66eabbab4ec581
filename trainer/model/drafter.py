"""The DFlash drafter: Qwen3-style decoder layers whose attention reads the target's features.

One forward drafts a whole block. Every block token attends (bidirectionally, per the mask) to
    * the context: the k selected target layers at earlier positions, concatenated [.., k*H], fused by
      fc -> hidden_norm into [.., H] (rules `dflash.fc_input_layers`, `dflash.fc_norm`), then projected by
      each layer with its OWN k_proj / v_proj (`dflash.kv_injection`); and
    * the block's own tokens, through the same k_proj / v_proj.
Context K/V come first, then the block's; k_norm and RoPE apply to both, queries come from block tokens
only. References: z-lab/dflash dflash/model.py (Qwen3DFlashAttention, DFlashDraftModel) and
vllm-project/speculators src/speculators/models/dflash/model_definitions.py, core.py.
Token embeddings and lm_head are the frozen target's (`dflash.frozen_embed_head`): the caller embeds the
block and applies the target's lm_head to the output, so neither lives here.

The drafter's own shape (heads, head_dim, MLP width, per-layer attention type and window, RoPE) is the
target's unless the run's `draft_config` says otherwise (`draft_config_from_target`): the published
Qwen3.6-27B drafter is 32 / 8 heads of 128 with four sliding-window layers on a 24 / 4 x 256 target.
Sliding-window layers attend as trainer/model/attention_mask.py describes (speculators' semantics).

Weight names follow the z-lab layout: fc.weight, hidden_norm.weight, layers.{i}.input_layernorm.weight,
layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
layers.{i}.post_attention_layernorm.weight, layers.{i}.mlp.{gate,up,down}_proj.weight, norm.weight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import Qwen3Config
from transformers.cache_utils import Cache
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from trainer.config import ConfigError
from trainer.model.attention_mask import (
    SLIDING_ATTENTION,
    DraftAttention,
    check_layer_masks,
    decode_window_mask,
    layer_mask,
)
from trainer.model.segmented_attention import SegmentedMask, segmented_attention


def draft_config_from_target(target_config: Any, num_layers: int,
                             shape: Mapping[str, Any] | None = None) -> Qwen3Config:
    """A Qwen3Config for the drafter: the target's width, heads, RoPE and norm eps; `num_layers` layers;
    then the run's `draft_config` (`shape`, TrainConfig.draft_config as a dict; None entries keep the target's).

    The drafter keeps the target's hidden size (the fused context and the target's embeddings/lm_head live
    in that space) and by default its heads, head_dim, MLP width and the RoPE of its full-attention layers
    (context keys sit at the target's absolute positions). Its layers are always Qwen3 decoder layers; families
    that name sizes otherwise (GPT-2, Gemma) are read under their own names. `shape` may give the drafter its
    own heads / head_dim / MLP width, per-layer attention (`layer_types`, `sliding_window`,
    `sliding_window_non_causal`) and RoPE (`rope_theta`, or whole `rope_parameters`). A shape that cannot be
    built (heads not divisible, an odd head_dim) raises ConfigError in one line.
    """
    text_config = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    text_config = _full_attention_layer_config(text_config)
    shape = {k: v for k, v in dict(shape or {}).items() if v is not None}
    hidden = text_config.hidden_size
    target_heads = getattr(text_config, "num_attention_heads", None)
    if "num_attention_heads" not in shape and (not isinstance(target_heads, int) or target_heads < 1):
        from trainer.target.frozen import TargetError

        raise TargetError(f"the target's config ({type(text_config).__name__}) has no num_attention_heads (a model "
                          "without attention layers?): give the drafter its own with draft_config.num_attention_heads")
    heads = shape.get("num_attention_heads") or target_heads
    head_dim = shape.get("head_dim") or (
        getattr(text_config, "head_dim", None) if "num_attention_heads" not in shape else None
    ) or hidden // heads
    kv_heads = shape.get("num_key_value_heads") or (
        getattr(text_config, "num_key_value_heads", None) if "num_attention_heads" not in shape else None
    ) or heads
    if heads % kv_heads:
        raise ConfigError(f"draft_config: num_attention_heads {heads} is not divisible by num_key_value_heads "
                          f"{kv_heads} (grouped-query attention shares each kv head among heads // kv_heads)")
    if head_dim % 2:
        raise ConfigError(f"draft_config: head_dim {head_dim} must be even (RoPE rotates pairs of dimensions)")
    rope = full_attention_rope(text_config)
    if shape.get("rope_parameters"):
        rope = {"rope_type": "default", **shape["rope_parameters"]}
    if shape.get("rope_theta") is not None:
        rope = {**rope, "rope_theta": float(shape["rope_theta"])}
    layer_types = list(shape.get("layer_types") or ["full_attention"] * num_layers)
    if len(layer_types) != num_layers:
        raise ConfigError(f"draft_config.layer_types names {len(layer_types)} layers but the drafter has "
                          f"{num_layers} (draft_layers)")
    window = shape.get("sliding_window") if SLIDING_ATTENTION in layer_types else None
    config = Qwen3Config(
        vocab_size=text_config.vocab_size,
        hidden_size=hidden,
        intermediate_size=shape.get("intermediate_size") or _intermediate_size(text_config),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act=_activation(text_config),
        max_position_embeddings=_max_positions(text_config),
        rms_norm_eps=_norm_eps(text_config),
        rope_parameters=rope,
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=getattr(text_config, "initializer_range", 0.02),
        tie_word_embeddings=False,
        # Qwen3Config keeps `sliding_window` only with use_sliding_window true (else it sets it to None and
        # every loader then builds full attention), and derives layer types from max_window_layers only when
        # layer_types is absent: both are written so that each way of reading the config gives these layers.
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=num_layers,
        layer_types=layer_types,
        num_target_layers=text_config.num_hidden_layers,  # z-lab's config carries it for the layer-id rule
    )
    if window is not None:
        config.sliding_window_non_causal = bool(shape.get("sliding_window_non_causal", False))
    return config


# RoPE keys that describe the TARGET's head layout, not a rotation the drafter's Qwen3 layers perform:
# partial rotation (the drafter rotates its whole head) and multimodal RoPE sections (the drafter's positions
# are 1-D text positions; with equal t/h/w positions mRoPE is plain RoPE). Copied into a drafter config, a
# serving stack would build them (speculators #613: partial_rotary_factor 0.25 served, full head trained).
TARGET_ONLY_ROPE_KEYS = frozenset({"partial_rotary_factor", "mrope_section", "mrope_interleaved"})


def _full_attention_layer_config(text_config: Any) -> Any:
    """A heterogeneous config (transformers' per_layer_config: Gemma 4's full-attention layers have their own
    head_dim) refuses to answer per-layer fields globally; the drafter attends over the whole context as the
    target's full-attention layers do, so it reads theirs (the last layer's when no layer is named so)."""
    if not getattr(text_config, "is_heterogeneous", False):
        return text_config
    layer_types = list(getattr(text_config, "layer_types", None) or [])
    index = layer_types.index("full_attention") if "full_attention" in layer_types else -1
    return text_config.per_layer_config[index]


def full_attention_rope(text_config: Any) -> dict[str, Any]:
    """The target's RoPE as the drafter's layers use it: its type, theta and scaling, nothing of its head layout.

    Gemma3-style configs nest RoPE per layer type ({"full_attention": {...}, "sliding_attention": {...}}):
    the drafter attends over the whole context like the target's full-attention layers, so it takes
    theirs. A partial rotary factor (GPT-NeoX, Phi, Qwen3.5) and multimodal sections (Qwen3.5's interleaved
    mRoPE) are the target's own head layout, not the drafter's (TARGET_ONLY_ROPE_KEYS), and a target without
    RoPE (GPT-2's learned positions) leaves the drafter the Qwen3 default.
    """
    rope = getattr(text_config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_type" not in rope and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    if not rope:  # configs from before transformers 5 keep a bare rope_theta
        rope = {"rope_type": "default", "rope_theta": getattr(text_config, "rope_theta", None) or 10000.0}
    return {key: value for key, value in dict(rope).items() if key not in TARGET_ONLY_ROPE_KEYS}


def _intermediate_size(text_config: Any) -> int:
    # GPT-2 names it n_inner, and None there means 4 * hidden.
    for name in ("intermediate_size", "n_inner", "ffn_dim"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4 * text_config.hidden_size


def _activation(text_config: Any) -> str:
    # Gemma names it hidden_activation, GPT-2 activation_function; the drafter's Qwen3 MLP takes any ACT2FN name.
    for name in ("hidden_act", "hidden_activation", "activation_function"):
        value = getattr(text_config, name, None)
        if isinstance(value, str) and value:
            return value
    return "silu"


def _max_positions(text_config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 32768


def _norm_eps(text_config: Any) -> float:
    for name in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"):
        value = getattr(text_config, name, None)
        if isinstance(value, float) and value > 0:
            return value
    return 1e-6


def crop_cache(cache: Cache, length: int) -> None:
    """Cut a drafter cache back to its first `length` positions (the context, after a drafted block).

    z-lab calls `past_key_values_draft.crop(start)`; transformers 5 rejects a positive crop length and
    takes the number of positions to remove as a negative int instead, which older versions accept too.
    """
    remove = cache.get_seq_length() - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if remove > 0:
        cache.crop(-remove)


def apply_rope(
    q: Tensor,  # [N, nh, Q, hd]
    k: Tensor,  # [N, nkv, C+Q, hd]
    cos: Tensor,  # [N, C+Q, hd]
    sin: Tensor,  # [N, C+Q, hd]
) -> tuple[Tensor, Tensor]:
    """RoPE for keys at every position and for queries at the last Q positions (the block's own)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, C+Q, hd]
    q_len = q.shape[-2]
    q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
    k = k * cos + rotate_half(k) * sin
    return q, k


class DFlashAttention(nn.Module):
    """Attention with two key/value sources: the fused target context, then the block's tokens."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # its slot in a transformers Cache
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        attention = DraftAttention.from_config(config)
        self.layer_type = attention.layer_types[layer_idx]  # which of the drafter's masks this layer takes
        self.sliding_window = attention.window_of(self.layer_type)  # W, or None: full attention

    def forward(
        self,
        x: Tensor,  # [N, Q, H] normed block hidden states
        context: Tensor,  # [N, C, H] fused target features (fc -> hidden_norm), shared by all layers
        cos: Tensor,  # [N, C+Q, hd]
        sin: Tensor,  # [N, C+Q, hd]
        attention_mask: Tensor | BlockMask | SegmentedMask | None,
        past_key_values: Cache | None,
    ) -> Tensor:  # [N, Q, H]
        n, q_len, _ = x.shape
        ctx_len = context.shape[1]
        q = self.q_norm(self.q_proj(x).view(n, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        # KV injection: this layer's own k_proj / v_proj project the fused context too, and the context's
        # K/V go before the block's ([Z] model.py Qwen3DFlashAttention, [S] model_definitions.py).
        k_context, k_block = self.k_proj(context), self.k_proj(x)  # [N, C, nkv*hd], [N, Q, nkv*hd]
        v_context, v_block = self.v_proj(context), self.v_proj(x)
        k = torch.cat([k_context, k_block], dim=1).view(n, ctx_len + q_len, self.num_kv_heads, self.head_dim)
        v = torch.cat([v_context, v_block], dim=1).view(n, ctx_len + q_len, self.num_kv_heads, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)  # [N, nkv, C+Q, hd]
        v = v.transpose(1, 2)  # [N, nkv, C+Q, hd]
        q, k = apply_rope(q, k, cos, sin)
        # Under autocast the RMSNorms return float32 while v comes from a (bf16) Linear: attend in v's dtype.
        q, k = q.to(v.dtype), k.to(v.dtype)
        if past_key_values is not None:
            # Like z-lab: this call's context and block K/V are appended after the cached context; the caller
            # crops the cache back to the context length afterwards, so block K/V never persist.
            k, v = past_key_values.update(k, v, self.layer_idx)  # [N, nkv, past+C+Q, hd]
        out = attend(q, k, v, attention_mask, self.scale)  # [N, nh, Q, hd]
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, self.num_heads * self.head_dim))


def attend(
    q: Tensor,  # [N, nh, Q, hd]
    k: Tensor,  # [N, nkv, KV, hd]
    v: Tensor,  # [N, nkv, KV, hd]
    attention_mask: Tensor | BlockMask | SegmentedMask | None,  # bool [N, 1, Q, KV] (True = attend) | ...
    scale: float,
) -> Tensor:  # [N, nh, Q, hd]
    """scaled_dot_product_attention for a dense mask (or none: everything visible), flex for a BlockMask,
    segment by segment for a SegmentedMask (trainer/model/segmented_attention.py)."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(attention_mask, BlockMask):
        return _flex_attention(q.device)(q, k, v, block_mask=attention_mask, scale=scale, enable_gqa=gqa)
    if isinstance(attention_mask, SegmentedMask):  # CPU training: only the key columns each segment sees
        return segmented_attention(q, k, v, attention_mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=scale, enable_gqa=gqa)


_COMPILED_FLEX: dict[str, Callable] = {}


def _flex_attention(device: torch.device) -> Callable:
    # Eager flex_attention materialises the full score matrix; on CUDA the compiled kernel skips masked
    # tiles, which is the point of the block mask. Compiled once, on first use.
    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _COMPILED_FLEX:
        _COMPILED_FLEX["cuda"] = torch.compile(flex_attention)
    return _COMPILED_FLEX["cuda"]


class DFlashDecoderLayer(nn.Module):
    """A Qwen3 pre-norm decoder layer with DFlashAttention."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, x: Tensor, context: Tensor, cos: Tensor, sin: Tensor, attention_mask, past_key_values) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, attention_mask, past_key_values)
        return x + self.mlp(self.post_attention_layernorm(x))  # [N, Q, H]


class DFlashDrafter(nn.Module):
    """fc + hidden_norm over the k target features, `num_hidden_layers` DFlash layers, final norm."""

    def __init__(self, config: Qwen3Config, num_features: int, block_size: int, mask_token_id: int):
        super().__init__()
        self.config = config
        self.num_features = num_features  # k: how many target layers are concatenated into fc
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        hidden = config.hidden_size
        # fc reads ALL k selected layers ([S] core.py, [Z] model.py: Linear(k*H, H, bias=False)).
        self.fc = nn.Linear(num_features * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(self._make_layer(config, i) for i in range(config.num_hidden_layers))
        self.attention = DraftAttention.from_config(config)  # per-layer type and window, as the layers use them
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.apply(self._init_weights)

    def _make_layer(self, config: Qwen3Config, layer_idx: int) -> nn.Module:
        # A family member that wraps the layer (trainer/model/dflash2.py) overrides only this.
        return DFlashDecoderLayer(config, layer_idx)

    def _init_weights(self, module: nn.Module) -> None:
        # The Hugging Face Qwen3 initialisation that z-lab's post_init() applies: N(0, 0.02) linears.
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=self.config.initializer_range)

    @classmethod
    def from_target_config(
        cls,
        target_config: Any,
        num_layers: int,
        num_features: int,
        block_size: int,
        mask_token_id: int,
        shape: Mapping[str, Any] | None = None,
    ) -> DFlashDrafter:
        config = draft_config_from_target(target_config, num_layers, shape)
        config.block_size = block_size  # z-lab keeps these on the draft config, so a saved config explains itself
        config.dflash_config = {"mask_token_id": mask_token_id, "num_features": num_features}
        return cls(config, num_features=num_features, block_size=block_size, mask_token_id=mask_token_id)

    def forward(
        self,
        block_embeds: Tensor,  # [N, Q, H] target embeddings of the block tokens (anchor, mask, ..., mask)*A
        context_features: Tensor,  # [N, C, k*H] concatenated target layer outputs at context positions
        position_ids: Tensor,  # [N, C+Q] positions of [context..., block...]
        attention_mask: Any = None,  # bool [N, 1, Q, past+C+Q] | BlockMask | {layer type: mask} | None
        past_key_values: Cache | None = None,
        use_cache: bool = False,
        served_as: Any = None,  # trainer.model.served.ServedAs: build the sliding layers as that engine does
    ) -> Tensor:  # [N, Q, H] final-normed hidden states; the caller applies the target's lm_head
        """Draft the block tokens' hidden states.

        attention_mask None is z-lab's inference: ONE block (Q = B tokens, anchor first) over its own context,
        everything before the anchor visible to the full-attention layers; the sliding layers get
        `decode_window_mask`, the training mask of that block (the cache holds the context from position 0 on,
        as z-lab's loop keeps it, and this call continues it). A drafter with sliding layers takes a
        {layer type: mask} mapping otherwise (build_attention_mask with its `attention`). With
        `past_key_values` and use_cache the cached keys come first in the key order and this call's context
        and block K/V are appended; the caller then cuts the cache back to the context length with
        `crop_cache(cache, context_length)` (z-lab dflash/model.py: `past_key_values_draft.crop(start)`),
        so the next call sees context only. `served_as` (inference only) builds the sliding layers' mask the way
        that serving engine builds it (trainer/model/served.py; None: ours, speculators' / vLLM's).
        """
        n, q_len, _ = block_embeds.shape
        ctx_len = context_features.shape[1]
        if position_ids.shape[-1] != ctx_len + q_len:
            raise ValueError(f"position_ids cover {position_ids.shape[-1]} positions, expected C+Q = {ctx_len + q_len}")
        if not use_cache:
            past_key_values = None
        check_layer_masks(attention_mask, self.attention.layer_types)
        dtype = block_embeds.dtype  # the compute dtype follows the inputs
        context = self.hidden_norm(self.fc(context_features.to(dtype))).to(dtype)  # [N, C, H]
        position_ids = position_ids.expand(n, -1) if position_ids.shape[0] == 1 else position_ids
        if attention_mask is None and self.attention.slides:
            attention_mask = self._decode_masks(position_ids, q_len, past_key_values, served_as)
        cos, sin = self.rotary_emb(block_embeds, position_ids)  # [N, C+Q, hd] each
        x = block_embeds
        for layer in self.layers:
            mask = layer_mask(attention_mask, layer.self_attn.layer_type)
            x = layer(x, context, cos, sin, mask, past_key_values)
        return self.norm(x).to(dtype)

    def _decode_masks(self, position_ids: Tensor, q_len: int, cache: Cache | None,
                      served_as: Any = None) -> dict[str, Tensor | None]:
        """{layer type: mask} for one block at inference: full layers see every key, sliding layers their window."""
        past = cache.get_seq_length() if cache is not None else 0
        ctx_len = position_ids.shape[-1] - q_len
        expected = torch.arange(past, past + ctx_len + q_len, device=position_ids.device)
        if not torch.equal(position_ids, expected.expand_as(position_ids)):
            # The window is counted in positions; cached keys are known by their index only, which equals
            # their position exactly when the cache holds positions 0..past-1 and this call continues it.
            raise ValueError(f"positions {position_ids[0, 0].item()}..{position_ids[0, -1].item()} do not continue "
                             f"the drafter's cache of {past} positions: a sliding-window drafter needs them "
                             "contiguous from 0")
        if served_as is not None:
            window = served_as.sliding_mask(self.attention, past + ctx_len, q_len, position_ids.device)
        else:
            window = decode_window_mask(past + ctx_len, q_len, self.attention.sliding_window,
                                        self.attention.sliding_window_non_causal, position_ids.device)
        if window is None:  # the engine ignores the window: the sliding layers attend like the full ones
            return {"full_attention": None, SLIDING_ATTENTION: None}
        return {"full_attention": None, SLIDING_ATTENTION: window.expand(position_ids.shape[0], -1, -1, -1)}
