"""Segmented attention (trainer/model/segmented_attention.py) against dense SDPA: outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.model.attention_mask import sdpa_mask
from trainer.model.segmented_attention import segment_mask, segmented_attention


def packed_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    rows, seq_len, anchors, block = 2, 40, 6, 4
    doc_ids = torch.tensor([[0] * 15 + [1] * 20 + [-1] * 5, [2] * 40])
    starts = torch.stack([torch.sort(torch.randperm(seq_len - block - 6, generator=g)[:anchors]).values for _ in range(rows)])
    valid = torch.ones(rows, anchors, dtype=torch.bool)
    valid[0, -1] = False  # a padding anchor sees its own block only
    return starts, valid, doc_ids, block, g


@pytest.mark.parametrize("queries_per_segment", [4, 8, 12, 1000])
@pytest.mark.parametrize("leaky", [False, True])
def test_segmented_attention_equals_dense_attention_and_its_gradients(queries_per_segment, leaky):
    anchors, valid, doc_ids, block, g = packed_case(0)
    mask = sdpa_mask(anchors, valid, doc_ids, block, False)  # [N, 1, Q, S+Q]
    if leaky:  # any mask at all, e.g. a planted leak: the columns are read off the mask, so it is computed
        mask = mask | (torch.rand(mask.shape, generator=g) < 0.1)
    rows, _, queries, keys = mask.shape
    q = torch.randn(rows, 4, queries, 8, generator=g, requires_grad=True)
    k = torch.randn(rows, 2, keys, 8, generator=g, requires_grad=True)
    v = torch.randn(rows, 2, keys, 8, generator=g, requires_grad=True)
    segmented = segment_mask(mask, block, queries_per_segment)
    assert all((s.stop - s.start) % block == 0 for s in segmented.segments)
    out = segmented_attention(q, k, v, segmented, 0.3)
    grads = torch.autograd.grad((out * torch.arange(out.numel()).view_as(out).sin()).sum(), (q, k, v))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    expected_grads = torch.autograd.grad((expected * torch.arange(out.numel()).view_as(out).sin()).sum(), (q, k, v))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_segments_skip_the_keys_no_query_of_theirs_sees():
    anchors, valid, doc_ids, block, _ = packed_case(1)
    mask = sdpa_mask(anchors, valid, doc_ids, block, False)
    segmented = segment_mask(mask, block, 8)
    computed = sum((s.stop - s.start) * s.keys.numel() for s in segmented.segments)
    assert computed < 0.5 * mask[:, 0].numel()
    assert sum(int(s.mask.sum()) for s in segmented.segments) == int(mask.sum())  # every allowed pair is kept
