"""The DFlash mask against a plain Python loop that spells out the rules of DFLASH.md."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask, flex_attention

from trainer.model.attention_mask import (
    DraftAttention,
    build_attention_mask,
    decode_window_mask,
    dflash_mask_mod,
    flex_block_mask,
    sdpa_mask,
)


def reference_mask(anchors, anchor_valid, doc_ids, block_size, context_includes_anchor, window=None,
                   non_causal=False):
    """mask[b][q][kv] by loops: context before the anchor in its document, plus the query's own block.

    A sliding layer (window W, speculators' models/dflash/attention.py) also needs kv >= anchor - W for context
    keys, and sees its own block causally (block slot j' <= j) unless non_causal."""
    num_rows, num_anchors = len(anchors), len(anchors[0])
    seq_len = len(doc_ids[0])
    q_len = num_anchors * block_size
    out = []
    for b in range(num_rows):
        rows = []
        for q in range(q_len):
            a = q // block_size
            p = anchors[b][a]
            row = []
            for kv in range(seq_len + q_len):
                if kv < seq_len:
                    last_visible = p if context_includes_anchor else p - 1
                    visible = (
                        anchor_valid[b][a]
                        and doc_ids[b][p] >= 0
                        and doc_ids[b][kv] == doc_ids[b][p]
                        and kv <= last_visible
                        and (window is None or kv >= p - window)
                    )
                else:
                    visible = (kv - seq_len) // block_size == a
                    if window is not None and not non_causal:
                        visible = visible and (kv - seq_len) % block_size <= q % block_size
                row.append(bool(visible))
            rows.append(row)
        out.append([rows])
    return torch.tensor(out)  # [N, 1, Q, S+Q]


# (anchors, anchor_valid, doc_ids, block_size) per case; two rows each where it matters.
CASES = {
    "adjacent_anchors": ([[2, 3, 4]], [[True, True, True]], [[0] * 10], 3),
    "overlapping_anchors": ([[1, 3]], [[True, True]], [[0] * 9], 4),
    "anchor_zero": ([[0, 2]], [[True, True]], [[0] * 8], 3),
    "packed_documents": (
        [[1, 4, 6], [2, 5, 0]],
        [[True, True, True], [True, True, False]],
        [[0, 0, 0, 1, 1, 1, 2, 2, 2, 2], [3, 3, 3, 3, 4, 4, 4, 4, 4, 4]],
        3,
    ),
    "padding": (
        [[1, 3, 0, 0]],
        [[True, True, False, False]],
        [[0, 0, 0, 0, 0, 0, -1, -1]],
        2,
    ),
    "block_size_one": ([[0, 3, 5]], [[True, True, True]], [[0, 0, 0, 1, 1, 1, 1]], 1),
}


@pytest.mark.parametrize("context_includes_anchor", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_mask_equals_loop_reference(case, context_includes_anchor):
    anchors, valid, docs, block_size = CASES[case]
    expected = reference_mask(anchors, valid, docs, block_size, context_includes_anchor)
    anchors, valid, docs = torch.tensor(anchors), torch.tensor(valid), torch.tensor(docs)
    mask = sdpa_mask(anchors, valid, docs, block_size, context_includes_anchor)
    assert mask.dtype == torch.bool
    assert mask.shape == expected.shape
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("case", list(CASES))
def test_every_query_sees_at_least_its_own_block(case):
    anchors, valid, docs, block_size = CASES[case]
    mask = sdpa_mask(torch.tensor(anchors), torch.tensor(valid), torch.tensor(docs), block_size, False)
    assert mask.any(dim=-1).all()


def test_anchor_position_visible_only_with_the_v6_bug():
    anchors, valid, block_size = torch.tensor([[4]]), torch.tensor([[True]]), 2
    docs = torch.zeros(1, 8, dtype=torch.long)
    fixed = sdpa_mask(anchors, valid, docs, block_size, context_includes_anchor=False)
    v6 = sdpa_mask(anchors, valid, docs, block_size, context_includes_anchor=True)
    assert not fixed[0, 0, :, 4].any() and fixed[0, 0, :, 3].all()
    assert v6[0, 0, :, 4].all()


@pytest.mark.parametrize("context_includes_anchor", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_flex_mask_mod_materialised_equals_sdpa_mask(case, context_includes_anchor):
    anchors, valid, docs, block_size = CASES[case]
    anchors, valid, docs = torch.tensor(anchors), torch.tensor(valid), torch.tensor(docs)
    num_rows, q_len = anchors.shape[0], anchors.shape[1] * block_size
    mask_mod = dflash_mask_mod(anchors, valid, docs, block_size, context_includes_anchor)
    dense = create_mask(mask_mod, num_rows, 1, q_len, docs.shape[1] + q_len, device="cpu")
    assert torch.equal(dense, sdpa_mask(anchors, valid, docs, block_size, context_includes_anchor))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_output_equals_sdpa_on_cpu():
    # flex_attention runs eagerly on CPU in torch 2.13 (an unfused reference path), so the BlockMask can
    # be checked end to end against SDPA with the dense mask.
    anchors, valid, docs, block_size = CASES["packed_documents"]
    anchors, valid, docs = torch.tensor(anchors), torch.tensor(valid), torch.tensor(docs)
    num_rows, seq_len, q_len = docs.shape[0], docs.shape[1], anchors.shape[1] * block_size
    torch.manual_seed(0)
    q = torch.randn(num_rows, 2, q_len, 8)
    k = torch.randn(num_rows, 2, seq_len + q_len, 8)
    v = torch.randn(num_rows, 2, seq_len + q_len, 8)
    block_mask = flex_block_mask(anchors, valid, docs, block_size, False)
    dense = sdpa_mask(anchors, valid, docs, block_size, False)
    out_flex = flex_attention(q, k, v, block_mask=block_mask)
    out_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(out_flex, out_sdpa, atol=1e-5, rtol=1e-5)


def test_build_attention_mask_is_dense_on_cpu():
    anchors, valid, docs, block_size = CASES["padding"]
    anchors, valid, docs = torch.tensor(anchors), torch.tensor(valid), torch.tensor(docs)
    mask = build_attention_mask(anchors, valid, docs, block_size, False, "cpu")
    assert isinstance(mask, torch.Tensor) and mask.shape == (1, 1, 8, 16)


# Windows shorter than, equal to and longer than the context before the anchors, over the same layouts.
WINDOWS = [1, 2, 3, 5, 64]


@pytest.mark.parametrize("non_causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", list(CASES))
def test_sliding_window_mask_equals_loop_reference(case, window, non_causal):
    anchors, valid, docs, block_size = CASES[case]
    expected = reference_mask(anchors, valid, docs, block_size, False, window, non_causal)
    anchors, valid, docs = torch.tensor(anchors), torch.tensor(valid), torch.tensor(docs)
    mask = sdpa_mask(anchors, valid, docs, block_size, False, window, non_causal)
    assert torch.equal(mask, expected)
    num_rows, q_len = anchors.shape[0], anchors.shape[1] * block_size
    mask_mod = dflash_mask_mod(anchors, valid, docs, block_size, False, window, non_causal)
    dense = create_mask(mask_mod, num_rows, 1, q_len, docs.shape[1] + q_len, device="cpu")
    assert torch.equal(dense, expected)  # the flex mask_mod materialised: the same rule
    assert mask.any(dim=-1).all()  # every query still sees at least its own anchor slot


def test_window_cuts_old_context_of_each_anchor_alike():
    # adjacent anchors 5, 6 in one document of 10, window 2: block of 5 sees 3..4, block of 6 sees 4..5,
    # every slot of a block the same positions (the anchor's window, not the slot's).
    anchors, valid, docs = torch.tensor([[5, 6]]), torch.tensor([[True, True]]), torch.zeros(1, 10, dtype=torch.long)
    mask = sdpa_mask(anchors, valid, docs, 3, False, 2)[0, 0, :, :10]
    seen = [row.nonzero().flatten().tolist() for row in mask]
    assert seen == [[3, 4]] * 3 + [[4, 5]] * 3
    full = sdpa_mask(anchors, valid, docs, 3, False)[0, 0, :, :10]
    assert full[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]


def test_sliding_block_is_causal_unless_non_causal():
    anchors, valid, docs = torch.tensor([[4]]), torch.tensor([[True]]), torch.zeros(1, 8, dtype=torch.long)
    causal = sdpa_mask(anchors, valid, docs, 4, False, 8)[0, 0, :, 8:]
    bidirectional = sdpa_mask(anchors, valid, docs, 4, False, 8, sliding_window_non_causal=True)[0, 0, :, 8:]
    assert torch.equal(causal, torch.ones(4, 4, dtype=torch.bool).tril())
    assert bidirectional.all()
    assert sdpa_mask(anchors, valid, docs, 4, False)[0, 0, :, 8:].all()  # full attention: always bidirectional


def test_build_attention_mask_gives_one_mask_per_layer_type():
    anchors, valid, docs, block_size = CASES["packed_documents"]
    anchors, valid, docs = torch.tensor(anchors), torch.tensor(valid), torch.tensor(docs)
    attention = DraftAttention(("sliding_attention", "full_attention"), 2)
    masks = build_attention_mask(anchors, valid, docs, block_size, False, "cpu", attention=attention)
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert torch.equal(masks["full_attention"], sdpa_mask(anchors, valid, docs, block_size, False))
    assert torch.equal(masks["sliding_attention"], sdpa_mask(anchors, valid, docs, block_size, False, 2))
    only_full = DraftAttention(("full_attention",) * 2)
    assert isinstance(build_attention_mask(anchors, valid, docs, block_size, False, "cpu", attention=only_full),
                      torch.Tensor)


def reference_decode_mask(context, block_size, window, non_causal):
    """[Q][KV] by loops for one block at inference: context keys p in [anchor - W, anchor), the block causal."""
    anchor = context  # the cache holds positions 0..anchor-1
    rows = []
    for j in range(block_size):
        row = [anchor - window <= p < anchor for p in range(context)]
        row += [non_causal or jj <= j for jj in range(block_size)]
        rows.append(row)
    return torch.tensor(rows)


@pytest.mark.parametrize("non_causal", [False, True])
@pytest.mark.parametrize(("context", "window"), [(3, 8), (8, 8), (20, 8), (20, 4)])
def test_decode_window_mask_equals_loop_reference(context, window, non_causal):
    mask = decode_window_mask(context, 4, window, non_causal)
    assert torch.equal(mask[0, 0], reference_decode_mask(context, 4, window, non_causal))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("non_causal", [False, True])
def test_sliding_flex_attention_output_equals_sdpa_on_cpu(non_causal):
    anchors, valid, docs, block_size = CASES["packed_documents"]
    anchors, valid, docs = torch.tensor(anchors), torch.tensor(valid), torch.tensor(docs)
    num_rows, seq_len, q_len = docs.shape[0], docs.shape[1], anchors.shape[1] * block_size
    torch.manual_seed(1)
    q, k, v = (torch.randn(num_rows, 2, n, 8) for n in (q_len, seq_len + q_len, seq_len + q_len))
    block_mask = flex_block_mask(anchors, valid, docs, block_size, False, 2, non_causal)
    dense = sdpa_mask(anchors, valid, docs, block_size, False, 2, non_causal)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block_mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=dense), atol=1e-5, rtol=1e-5)
