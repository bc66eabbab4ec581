"""The DFlash attention mask, defined once.

Layout (the same as vllm-project/speculators src/speculators/models/dflash/attention.py):
    queries  Q  = A*B block tokens; query q belongs to block a = q // B, anchored at p = anchors[b, a]
    keys     KV = S context positions of the packed row, followed by the A*B block tokens

A block's queries see
    * context position kv (kv < S) iff its anchor is valid, kv is in the anchor's document, and kv < p.
      Strictly before the anchor: at inference the anchor's hidden state does not exist yet (the bonus
      token was only just sampled), and the deep target layers' state at p already encodes the label of
      slot 1 (rule `dflash.context_excludes_anchor`; [S] attention.py, [Z] dflash/model.py:99,143).
      `context_includes_anchor=True` uses kv <= p instead: the v6 bug, kept so it can be reproduced.
    * block token kv (kv >= S) iff it is in the same block: bidirectional within the block
      (`dflash.block_bidirectional`) and isolated from every other block (`dflash.blocks_isolated`).
A padding anchor (anchor_valid False) sees only its own block, so no softmax row is ever fully masked;
its slots get zero loss weight in loss.slot_weights.

Sliding-window drafter layers (`layer_types` entries "sliding_attention", window W) follow speculators
(src/speculators/models/dflash/attention.py `create_anchor_block_mask_mod`, the reference trainer whose
export vLLM serves):
    * context: kv is also within the window of the ANCHOR, p - W <= kv < p: every slot of a block sees
      the same W context positions, whatever its offset j in the block;
    * block: causal, block key j' visible to block query j iff j' <= j, unless `sliding_window_non_causal`
      (speculators' flag; then bidirectional like the full-attention layers, which always are).
Where the serving engines differ (playbooks/serving/engines.yaml, the table `trainer eval --served-as` and
sleuth read; each row names the code and version it was read from):
    * vLLM / speculators 0.9.0: the rule above.
    * z-lab's dflash 0.1.0 (DFlashDraftModel) and SGLang count the window from each QUERY: slot j at
      position anchor+j sees context k iff anchor + j - k < W (W-1-j positions, not W), and their sliding
      layers are causal within the block: `window_origin="query"` here.
    * SpecForge 0.2.0's inference loop (spec_generate) passes no mask and is_causal=False: SDPA ignores the
      window, so every layer attends like a full one.
The anchor and query windows agree on every position but the j+1 oldest, so they differ only once the
context is longer than W - B.

`dflash_mask_mod` is the one definition. `sdpa_mask` evaluates it on broadcast index grids (a dense bool
mask for scaled_dot_product_attention); `flex_block_mask` hands the same function to flex attention's
create_block_mask (block-sparse, for CUDA); on CPU `build_attention_mask` evaluates it segment by segment
(trainer/model/segmented_attention.py: each run of blocks attends only to the columns it sees). The paths
cannot disagree. `decode_window_mask` is the same rule for one block drafted at inference over a KV cache
(trainer eval's real decoding).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from trainer.model.segmented_attention import SegmentedMask, segment_mask_mod

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


FULL_ATTENTION = "full_attention"
WINDOW_FROM_ANCHOR = "anchor"  # every slot of a block sees the same W context positions (speculators, ours)
WINDOW_FROM_QUERY = "query"  # each query sees the keys within W of its own position (flash-attention's count)
WINDOW_ORIGINS = (WINDOW_FROM_ANCHOR, WINDOW_FROM_QUERY)
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True)
class DraftAttention:
    """How each drafter layer attends: its layer type, the window of the sliding ones, their block causality."""

    layer_types: tuple[str, ...]  # one per drafter layer: "full_attention" | "sliding_attention"
    sliding_window: int | None = None  # W; required when a layer slides
    sliding_window_non_causal: bool = False  # sliding layers attend bidirectionally within the block

    def __post_init__(self) -> None:
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unknown drafter layer types {unknown}; choose from {', '.join(LAYER_TYPES)}")
        if self.slides and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"sliding_attention layers need a sliding_window >= 1, got {self.sliding_window!r}")

    @classmethod
    def from_config(cls, config: Any) -> DraftAttention:
        """From a Qwen3Config-like object as transformers built it. A sliding layer without a window (a config
        whose `use_sliding_window` is false: Qwen3Config then sets sliding_window to None) attends fully,
        exactly as speculators' and z-lab's loaders build that layer."""
        layers = int(config.num_hidden_layers)
        types = list(getattr(config, "layer_types", None) or [FULL_ATTENTION] * layers)
        window = getattr(config, "sliding_window", None)
        if window is None:
            types = [FULL_ATTENTION] * len(types)
        non_causal = bool(getattr(config, "sliding_window_non_causal", False))
        return cls(tuple(types), window if SLIDING_ATTENTION in types else None, non_causal)

    @property
    def slides(self) -> bool:
        return SLIDING_ATTENTION in self.layer_types

    def window_of(self, layer_type: str) -> int | None:
        return self.sliding_window if layer_type == SLIDING_ATTENTION else None


def dflash_mask_mod(
    anchors: Tensor,  # [N, A] long, context positions of the block anchors
    anchor_valid: Tensor,  # [N, A] bool, False for padding anchors
    doc_ids: Tensor,  # [N, S] long, document id per context position, -1 = padding
    block_size: int,
    context_includes_anchor: bool,
    sliding_window: int | None = None,
    sliding_window_non_causal: bool = False,
    window_origin: str = WINDOW_FROM_ANCHOR,
) -> MaskMod:
    """Return mask_mod(b, h, q_idx, kv_idx) -> bool: may query q_idx of row b attend to key kv_idx?

    Written with tensor ops only (no Python branching on values), so it works both on broadcast index
    grids (sdpa_mask) and under flex attention's vmap / torch.compile (flex_block_mask). `sliding_window`
    None is a full-attention layer; W a sliding one (the module docstring: speculators' semantics).
    `window_origin` "query" counts the window from each query's own position instead (z-lab 0.1.0, SGLang,
    SpecForge's training mask: playbooks/serving/engines.yaml): slot j at position anchor+j sees a key at
    position k iff anchor + j - k < W, block keys included.
    """
    if window_origin not in WINDOW_ORIGINS:
        raise ValueError(f"unknown window origin {window_origin!r}; choose from {', '.join(WINDOW_ORIGINS)}")
    seq_len = doc_ids.shape[1]  # S: keys below S are context, keys from S on are block tokens
    causal_block = sliding_window is not None and not sliding_window_non_causal
    from_query = sliding_window is not None and window_origin == WINDOW_FROM_QUERY

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        block = q_idx // block_size  # which block (anchor) this query belongs to
        anchor = anchors[b, block]
        anchor_doc = doc_ids[b, anchor]
        # Block keys index past S; clamp only so the lookup stays in bounds (is_context masks them out).
        kv_doc = doc_ids[b, kv_idx.clamp(max=seq_len - 1)]
        is_context = kv_idx < seq_len
        in_anchor_doc = (kv_doc == anchor_doc) & (anchor_doc >= 0)
        before_anchor = (kv_idx <= anchor) if context_includes_anchor else (kv_idx < anchor)
        if from_query:  # counted from the query at anchor + j: the query is one of its own W positions
            before_anchor = before_anchor & (anchor + q_idx % block_size - kv_idx < sliding_window)
        elif sliding_window is not None:  # the window is the anchor's: the same W positions for every slot
            before_anchor = before_anchor & (kv_idx >= anchor - sliding_window)
        sees_context = is_context & anchor_valid[b, block] & in_anchor_doc & before_anchor
        # For context keys kv_idx - S is negative, so its floor division never equals a block index >= 0.
        sees_own_block = (~is_context) & ((kv_idx - seq_len) // block_size == block)
        if causal_block:  # block key j' visible to block query j iff j' <= j
            sees_own_block = sees_own_block & (kv_idx - seq_len <= q_idx)
        if from_query:  # block keys too are within W of the query, on both sides when the block is bidirectional
            distance = q_idx - (kv_idx - seq_len)
            sees_own_block = sees_own_block & (distance < sliding_window) & (-distance < sliding_window)
        return sees_context | sees_own_block

    return mask_mod


def _check_shapes(anchors: Tensor, anchor_valid: Tensor, doc_ids: Tensor, block_size: int) -> None:
    if anchors.ndim != 2 or anchors.shape != anchor_valid.shape:
        raise ValueError(f"anchors {tuple(anchors.shape)} and anchor_valid {tuple(anchor_valid.shape)} must be [N, A]")
    if doc_ids.ndim != 2 or doc_ids.shape[0] != anchors.shape[0]:
        raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must be [N, S] with N = {anchors.shape[0]}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def sdpa_mask(
    anchors: Tensor,  # [N, A]
    anchor_valid: Tensor,  # [N, A]
    doc_ids: Tensor,  # [N, S]
    block_size: int,
    context_includes_anchor: bool,
    sliding_window: int | None = None,
    sliding_window_non_causal: bool = False,
    window_origin: str = WINDOW_FROM_ANCHOR,
) -> Tensor:  # [N, 1, Q, S+Q] bool, True = may attend
    """Dense boolean mask for F.scaled_dot_product_attention, by evaluating dflash_mask_mod on index grids."""
    _check_shapes(anchors, anchor_valid, doc_ids, block_size)
    num_rows, num_anchors = anchors.shape
    seq_len = doc_ids.shape[1]
    q_len = num_anchors * block_size
    device = anchors.device
    mask_mod = dflash_mask_mod(anchors, anchor_valid, doc_ids, block_size, context_includes_anchor,
                               sliding_window, sliding_window_non_causal, window_origin)
    b = torch.arange(num_rows, device=device).view(-1, 1, 1, 1)  # [N, 1, 1, 1]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)  # the mask is the same for every head
    q_idx = torch.arange(q_len, device=device).view(1, 1, -1, 1)  # [1, 1, Q, 1]
    kv_idx = torch.arange(seq_len + q_len, device=device).view(1, 1, 1, -1)  # [1, 1, 1, S+Q]
    return mask_mod(b, h, q_idx, kv_idx)  # broadcasts to [N, 1, Q, S+Q]


def flex_block_mask(
    anchors: Tensor,  # [N, A]
    anchor_valid: Tensor,  # [N, A]
    doc_ids: Tensor,  # [N, S]
    block_size: int,
    context_includes_anchor: bool,
    sliding_window: int | None = None,
    sliding_window_non_causal: bool = False,
) -> BlockMask:
    """Block-sparse mask for flex_attention from the same mask_mod.

    On CUDA create_block_mask is compiled, so it evaluates the mask tile by tile and never builds the
    dense [Q, S+Q] grid (speculators compiles it for the same reason, core.py `_compiled_create_block_mask`).
    """
    _check_shapes(anchors, anchor_valid, doc_ids, block_size)
    num_rows, num_anchors = anchors.shape
    q_len = num_anchors * block_size
    mask_mod = dflash_mask_mod(anchors, anchor_valid, doc_ids, block_size, context_includes_anchor,
                               sliding_window, sliding_window_non_causal)
    build = _compiled_create_block_mask() if anchors.device.type == "cuda" else create_block_mask
    return build(mask_mod, B=num_rows, H=None, Q_LEN=q_len, KV_LEN=doc_ids.shape[1] + q_len, device=anchors.device)


_COMPILED: dict[str, Callable] = {}


def _compiled_create_block_mask() -> Callable:
    # Compiled on first use only: compiling costs seconds and the CPU path never needs it.
    if "create_block_mask" not in _COMPILED:
        _COMPILED["create_block_mask"] = torch.compile(create_block_mask)
    return _COMPILED["create_block_mask"]


def segmented_mask(
    anchors: Tensor,  # [N, A]
    anchor_valid: Tensor,  # [N, A]
    doc_ids: Tensor,  # [N, S]
    block_size: int,
    context_includes_anchor: bool,
    sliding_window: int | None = None,
    sliding_window_non_causal: bool = False,
) -> SegmentedMask:
    """`sdpa_mask` evaluated segment by segment (whole blocks; each segment keeps only the key columns it sees):
    the dense [N, Q, S+Q] grid never exists."""
    _check_shapes(anchors, anchor_valid, doc_ids, block_size)
    mask_mod = dflash_mask_mod(anchors, anchor_valid, doc_ids, block_size, context_includes_anchor,
                               sliding_window, sliding_window_non_causal)
    num_rows, num_queries = anchors.shape[0], anchors.shape[1] * block_size
    return segment_mask_mod(mask_mod, num_rows, num_queries, doc_ids.shape[1] + num_queries, block_size,
                            device=anchors.device)


AttentionMask = Tensor | BlockMask | SegmentedMask


def build_attention_mask(
    anchors: Tensor,  # [N, A]
    anchor_valid: Tensor,  # [N, A]
    doc_ids: Tensor,  # [N, S]
    block_size: int,
    context_includes_anchor: bool,
    device: torch.device | str,
    attention: DraftAttention | None = None,
) -> AttentionMask | dict[str, AttentionMask]:
    """The mask the drafter should get on `device`: a flex BlockMask on CUDA; elsewhere the dense SDPA mask
    cut into segments of whole blocks that attend only to the key columns they see (block-sparse on CPU).

    A drafter with sliding-window layers (`attention.slides`) gets one mask per layer type it has,
    {"full_attention": ..., "sliding_attention": ...}; an all-full-attention drafter gets the one mask.
    """
    device = torch.device(device)
    anchors, anchor_valid, doc_ids = anchors.to(device), anchor_valid.to(device), doc_ids.to(device)
    build = flex_block_mask if device.type == "cuda" else segmented_mask
    if attention is None or not attention.slides:
        return build(anchors, anchor_valid, doc_ids, block_size, context_includes_anchor)
    return {
        kind: build(anchors, anchor_valid, doc_ids, block_size, context_includes_anchor,
                    attention.window_of(kind), attention.sliding_window_non_causal)
        for kind in sorted(set(attention.layer_types))
    }


def decode_window_mask(
    context_length: int,  # positions 0..context_length-1 are context; the block's anchor sits at context_length
    block_size: int,
    sliding_window: int,
    sliding_window_non_causal: bool = False,
    device: torch.device | str = "cpu",
    window_origin: str = WINDOW_FROM_ANCHOR,
) -> Tensor:  # [1, 1, B, context_length + B] bool, True = may attend
    """A sliding layer's mask for one block drafted at inference over a KV cache: the training mask of that block.

    It is `sdpa_mask` of one document of context_length + 1 positions with one anchor at the last one, less the
    anchor's own column (at inference the anchor has no context entry; the rule never shows it to its block).
    `window_origin` "query" is the mask an engine that counts the window from each query builds
    (trainer/model/served.py).
    """
    anchors = torch.tensor([[context_length]], device=device)
    doc_ids = torch.zeros(1, context_length + 1, dtype=torch.long, device=device)
    full = sdpa_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), doc_ids, block_size, False,
                     sliding_window, sliding_window_non_causal, window_origin)  # [1, 1, B, context_length + 1 + B]
    return torch.cat([full[..., :context_length], full[..., context_length + 1:]], dim=-1)


def layer_mask(mask: Any, layer_type: str) -> Any:
    """The mask of one layer out of what the drafter was given: one mask for every layer, or per type."""
    if isinstance(mask, Mapping):
        if layer_type not in mask:
            raise ValueError(f"no attention mask for drafter layer type {layer_type!r} (given {sorted(mask)})")
        return mask[layer_type]
    return mask


def check_layer_masks(mask: Any, layer_types: Sequence[str]) -> None:
    """A drafter with sliding layers must be given a mask per layer type (or None at inference): one shared
    mask would silently train or serve its sliding layers as full attention (AEON-7 Qwen3.6-27B-DFlash #6)."""
    if mask is not None and not isinstance(mask, Mapping) and SLIDING_ATTENTION in layer_types:
        raise ValueError("this drafter has sliding_attention layers: give build_attention_mask(..., attention=...) "
                         "one mask per layer type, not a single mask for every layer")
