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

`dflash_mask_mod` is the one definition. `sdpa_mask` evaluates it on broadcast index grids (a dense bool
mask for scaled_dot_product_attention); `flex_block_mask` hands the same function to flex attention's
create_block_mask (block-sparse, for CUDA); on CPU `build_attention_mask` evaluates it segment by segment
(trainer/model/segmented_attention.py: each run of blocks attends only to the columns it sees). The paths
cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from trainer.model.segmented_attention import SegmentedMask, segment_mask_mod

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def dflash_mask_mod(
    anchors: Tensor,  # [N, A] long, context positions of the block anchors
    anchor_valid: Tensor,  # [N, A] bool, False for padding anchors
    doc_ids: Tensor,  # [N, S] long, document id per context position, -1 = padding
    block_size: int,
    context_includes_anchor: bool,
) -> MaskMod:
    """Return mask_mod(b, h, q_idx, kv_idx) -> bool: may query q_idx of row b attend to key kv_idx?

    Written with tensor ops only (no Python branching on values), so it works both on broadcast index
    grids (sdpa_mask) and under flex attention's vmap / torch.compile (flex_block_mask).
    """
    seq_len = doc_ids.shape[1]  # S: keys below S are context, keys from S on are block tokens

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        block = q_idx // block_size  # which block (anchor) this query belongs to
        anchor = anchors[b, block]
        anchor_doc = doc_ids[b, anchor]
        # Block keys index past S; clamp only so the lookup stays in bounds (is_context masks them out).
        kv_doc = doc_ids[b, kv_idx.clamp(max=seq_len - 1)]
        is_context = kv_idx < seq_len
        in_anchor_doc = (kv_doc == anchor_doc) & (anchor_doc >= 0)
        before_anchor = (kv_idx <= anchor) if context_includes_anchor else (kv_idx < anchor)
        sees_context = is_context & anchor_valid[b, block] & in_anchor_doc & before_anchor
        # For context keys kv_idx - S is negative, so its floor division never equals a block index >= 0.
        sees_own_block = (~is_context) & ((kv_idx - seq_len) // block_size == block)
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
) -> Tensor:  # [N, 1, Q, S+Q] bool, True = may attend
    """Dense boolean mask for F.scaled_dot_product_attention, by evaluating dflash_mask_mod on index grids."""
    _check_shapes(anchors, anchor_valid, doc_ids, block_size)
    num_rows, num_anchors = anchors.shape
    seq_len = doc_ids.shape[1]
    q_len = num_anchors * block_size
    device = anchors.device
    mask_mod = dflash_mask_mod(anchors, anchor_valid, doc_ids, block_size, context_includes_anchor)
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
) -> BlockMask:
    """Block-sparse mask for flex_attention from the same mask_mod.

    On CUDA create_block_mask is compiled, so it evaluates the mask tile by tile and never builds the
    dense [Q, S+Q] grid (speculators compiles it for the same reason, core.py `_compiled_create_block_mask`).
    """
    _check_shapes(anchors, anchor_valid, doc_ids, block_size)
    num_rows, num_anchors = anchors.shape
    q_len = num_anchors * block_size
    mask_mod = dflash_mask_mod(anchors, anchor_valid, doc_ids, block_size, context_includes_anchor)
    build = _compiled_create_block_mask() if anchors.device.type == "cuda" else create_block_mask
    return build(mask_mod, B=num_rows, H=None, Q_LEN=q_len, KV_LEN=doc_ids.shape[1] + q_len, device=anchors.device)


_COMPILED: dict[str, Callable] = {}


def _compiled_create_block_mask() -> Callable:
    # Compiled on first use only: compiling costs seconds and the CPU path never needs it.
    if "create_block_mask" not in _COMPILED:
        _COMPILED["create_block_mask"] = torch.compile(create_block_mask)
    return _COMPILED["create_block_mask"]


def build_attention_mask(
    anchors: Tensor,  # [N, A]
    anchor_valid: Tensor,  # [N, A]
    doc_ids: Tensor,  # [N, S]
    block_size: int,
    context_includes_anchor: bool,
    device: torch.device | str,
) -> Tensor | BlockMask | SegmentedMask:
    """The mask the drafter should get on `device`: a flex BlockMask on CUDA; elsewhere the dense SDPA mask
    cut into segments of whole blocks that attend only to the key columns they see (block-sparse on CPU)."""
    device = torch.device(device)
    anchors, anchor_valid, doc_ids = anchors.to(device), anchor_valid.to(device), doc_ids.to(device)
    if device.type == "cuda":
        return flex_block_mask(anchors, anchor_valid, doc_ids, block_size, context_includes_anchor)
    _check_shapes(anchors, anchor_valid, doc_ids, block_size)
    mask_mod = dflash_mask_mod(anchors, anchor_valid, doc_ids, block_size, context_includes_anchor)
    num_rows, num_queries = anchors.shape[0], anchors.shape[1] * block_size
    return segment_mask_mod(mask_mod, num_rows, num_queries, doc_ids.shape[1] + num_queries, block_size, device=device)
