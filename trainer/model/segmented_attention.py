"""Block-sparse DFlash attention without flex attention: the dense mask cut into segments of whole blocks.

A block's queries see their document's context before the anchor and their own block, nothing else: at
3 documents per row the DFlash mask lets through ~15 % of the [Q, S+Q] grid. On CUDA flex attention skips
the masked tiles (flex_block_mask). The CPU's scaled_dot_product_attention does not; it computes every
score and masks it. So on CPU the queries are cut into segments of consecutive whole blocks (anchors are
sorted, so a segment's blocks sit close together in one or two documents) and each segment attends only
to the key columns its rows of the mask let through, with its rows of the same mask. Keys outside the
segment's columns are masked for every one of its queries, so each output is the dense attention's
(softmax over the same keys; only the summation order differs, ~1e-7), and its gradients too.

The columns are read off the mask itself, not re-derived from the DFlash rule: whatever the mask says
(a leak a probe must see, a window) is exactly what is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Queries per segment, rounded to whole blocks: fewer keys per segment against more SDPA calls. On the bench's
# `medium` step (bench/train_step.py: Q 1024, KV 2048, one thread; CPU seconds per forward + backward) 32, 64
# and 128 were within 2 % of each other, 256 3 % and 512 10 % slower than 64; the dense mask took 0.3 s more.
QUERIES_PER_SEGMENT = 64


@dataclass(frozen=True)
class Segment:
    row: int  # packed row
    start: int  # first query (block token) of the segment
    stop: int
    keys: Tensor  # [K] long, ascending: the key columns any query of the segment may attend
    mask: Tensor  # [1, 1, stop - start, K] bool, True = attend: the dense mask's rows and columns


@dataclass(frozen=True)
class SegmentedMask:
    """A dense [N, 1, Q, KV] attention mask as segments that cover every row's queries in order."""

    segments: tuple[Segment, ...]
    num_rows: int
    num_queries: int
    num_keys: int


def segment_mask(mask: Tensor, block_size: int, queries_per_segment: int = QUERIES_PER_SEGMENT) -> SegmentedMask:
    """Cut a dense bool mask [N, 1, Q, KV] (query q in block q // B) into segments of whole blocks."""
    num_rows, _, num_queries, num_keys = mask.shape
    return segment_mask_mod(lambda b, h, q, kv: mask[b, 0, q, kv], num_rows, num_queries, num_keys, block_size,
                            queries_per_segment, mask.device)


def segment_mask_mod(
    mask_mod: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],  # (b, h, q_idx, kv_idx) -> bool, broadcasting
    num_rows: int,
    num_queries: int,
    num_keys: int,
    block_size: int,
    queries_per_segment: int = QUERIES_PER_SEGMENT,
    device: torch.device | str = "cpu",
) -> SegmentedMask:
    """Evaluate a flex-attention mask_mod segment by segment (query q in block q // B): the dense [N, Q, KV]
    grid never exists, only each segment's [q, KV] rows while its columns are read off."""
    step = max(1, queries_per_segment // block_size) * block_size
    head = torch.zeros(1, 1, dtype=torch.long, device=device)  # the mask is the same for every head
    kv_idx = torch.arange(num_keys, device=device).view(1, -1)  # [1, KV]
    segments = []
    for row in range(num_rows):
        b = torch.full((1, 1), row, dtype=torch.long, device=device)
        for start in range(0, num_queries, step):
            stop = min(num_queries, start + step)
            rows = mask_mod(b, head, torch.arange(start, stop, device=device).view(-1, 1), kv_idx)  # [q, KV]
            keys = rows.any(dim=0).nonzero().squeeze(1)  # [K]; never empty: a query sees at least its own block
            segments.append(Segment(row, start, stop, keys, rows.index_select(1, keys)[None, None]))
    return SegmentedMask(tuple(segments), num_rows, num_queries, num_keys)


def segmented_attention(
    q: Tensor,  # [N, nh, Q, hd]
    k: Tensor,  # [N, nkv, KV, hd]
    v: Tensor,  # [N, nkv, KV, hd]
    mask: SegmentedMask,
    scale: float,
) -> Tensor:  # [N, nh, Q, hd]
    """scaled_dot_product_attention segment by segment, each over its own key columns only."""
    if q.shape[2] != mask.num_queries or k.shape[2] != mask.num_keys or q.shape[0] != mask.num_rows:
        raise ValueError(f"a segmented mask for {mask.num_rows} x {mask.num_queries} queries x {mask.num_keys} keys "
                         f"cannot serve q {tuple(q.shape)} / k {tuple(k.shape)} (a cache is not supported)")
    gqa = q.shape[1] != k.shape[1]
    out = []
    # One split / index_select per row, not a slice per segment: the backward of a slice (or of an
    # index_select) writes into a zero tensor the size of the whole input, once per segment.
    for row, (q_row, k_row, v_row) in enumerate(zip(q.split(1), k.split(1), v.split(1))):
        segments = [s for s in mask.segments if s.row == row]
        columns = torch.cat([s.keys for s in segments])
        widths = [s.keys.numel() for s in segments]
        queries = q_row.split([s.stop - s.start for s in segments], dim=2)
        keys = k_row.index_select(2, columns).split(widths, dim=2)
        values = v_row.index_select(2, columns).split(widths, dim=2)
        # Each segment's [1, nh, q, hd] joined as [1, Q, nh, hd]: the caller's transpose back to [N, Q, nh, hd]
        # is then contiguous and its reshape to [N, Q, nh*hd] a view, not one more copy per layer.
        out.append(torch.cat([
            F.scaled_dot_product_attention(qs, ks, vs, attn_mask=s.mask, scale=scale, enable_gqa=gqa).transpose(1, 2)
            for s, qs, ks, vs in zip(segments, queries, keys, values)
        ], dim=1))
    return (out[0] if len(out) == 1 else torch.cat(out, dim=0)).transpose(1, 2)  # [N, nh, Q, hd]
