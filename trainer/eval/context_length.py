"""Acceptance against context length: where a sliding-window drafter stops seeing the whole context.

A verify step's context length is the anchor's position: the drafter's context is every position before it.
A drafter whose sliding-window layers see only the last W of those positions is on its own ground only while
the context is at most W long; past that, the sliding layers read a window and only the full-attention layers
see everything. A window served as full attention (or the reverse) shows exactly there (AEON-7
Qwen3.6-27B-DFlash #6, vLLM PR #40898: acceptance falling past ~2k tokens on a 2048 window), so the report
splits the verify steps at W and doubles from there: [0, W], (W, 2W], (2W, 4W], ... (32 instead of W for a
drafter without a window).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field

DEFAULT_FIRST_EDGE = 32  # without a window: the same doubling buckets from 32 tokens on


class ContextLengthBucket(BaseModel):
    min_context: int = Field(description="Shortest context (anchor position) in the bucket.")
    max_context: int = Field(description="Longest context in the bucket (inclusive).")
    beyond_window: bool = Field(description="Every step here has more context than the sliding window covers.")
    verify_steps: int
    tau: float | None = Field(description="Mean acceptance length over the bucket's verify steps; null without any.")
    per_position_acceptance: list[float] = Field(
        description="Slots 1..B-1: fraction of the bucket's verify steps that accepted that slot (sums to tau - 1)."
    )


class ContextLengthReport(BaseModel):
    sliding_window: int | None = Field(description="The drafter's window W (null: every layer full attention).")
    buckets: list[ContextLengthBucket] = Field(
        description="Verify steps by context length: [0, W], (W, 2W], (2W, 4W], ... (W = 32 without a window); "
        "only buckets with steps."
    )
    tau_within_window: float | None = Field(description="tau over the steps with context <= W (null: no window).")
    tau_beyond_window: float | None = Field(description="tau over the steps with context > W (null: none).")
    verify_steps_beyond_window: int = 0


def bucket_edges(first: int, longest: int) -> list[int]:
    """Inclusive upper edges first, 2 first, 4 first, ... until `longest` is covered."""
    edges = [first]
    while edges[-1] < longest:
        edges.append(edges[-1] * 2)
    return edges


def acceptance_by_context_length(
    context_lengths: Sequence[int],  # per verify step: the anchor's position
    acceptance_lengths: Sequence[int],  # per verify step: accepted drafts + 1
    block_size: int,
    sliding_window: int | None,
) -> ContextLengthReport:
    if len(context_lengths) != len(acceptance_lengths):
        raise ValueError(f"{len(context_lengths)} context lengths for {len(acceptance_lengths)} verify steps")
    edges = bucket_edges(sliding_window or DEFAULT_FIRST_EDGE, max(context_lengths, default=0))
    buckets: list[ContextLengthBucket] = []
    low = 0
    for high in edges:
        lengths = [a for c, a in zip(context_lengths, acceptance_lengths) if low <= c <= high]
        if lengths:
            buckets.append(ContextLengthBucket(
                min_context=low, max_context=high, verify_steps=len(lengths),
                beyond_window=sliding_window is not None and low > sliding_window,
                tau=sum(lengths) / len(lengths),
                per_position_acceptance=[sum(1 for a in lengths if a >= k + 1) / len(lengths)
                                         for k in range(1, block_size)],
            ))
        low = high + 1
    within = [a for c, a in zip(context_lengths, acceptance_lengths) if sliding_window is not None and c <= sliding_window]
    beyond = [a for c, a in zip(context_lengths, acceptance_lengths) if sliding_window is not None and c > sliding_window]
    return ContextLengthReport(
        sliding_window=sliding_window,
        buckets=buckets,
        tau_within_window=sum(within) / len(within) if within else None,
        tau_beyond_window=sum(beyond) / len(beyond) if beyond else None,
        verify_steps_beyond_window=len(beyond),
    )


def draft_sliding_window(drafter: Any) -> int | None:
    """The window of a drafter's sliding layers (a DFlashDrafter, or a proposer wrapping one); None otherwise."""
    module = getattr(drafter, "drafter", drafter)
    attention = getattr(module, "attention", None)
    return getattr(attention, "sliding_window", None) if getattr(attention, "slides", False) else None
