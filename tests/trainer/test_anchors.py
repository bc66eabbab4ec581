"""Anchor sampling: eligibility, uniqueness, order, count, padding and determinism."""

import torch

from trainer.model.anchors import sample_anchors

BLOCK = 3


def make_batch():
    # Row 0: two documents, loss on the second half of each (a prompt/answer split).
    # Row 1: a short document, then padding (doc -1, loss 0). Row 2: no supervised token at all.
    loss_mask = torch.tensor(
        [
            [0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
            [0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            [0] * 16,
        ]
    )
    doc_ids = torch.tensor(
        [
            [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1],
            [0] * 16,
        ]
    )
    return loss_mask, doc_ids


def eligible_by_loop(loss_mask, doc_ids, block_size):
    seq_len = len(loss_mask[0])
    return [
        [s for s in range(seq_len) if loss_mask[r][s] == 1 and doc_ids[r][s] >= 0 and s < seq_len - block_size]
        for r in range(len(loss_mask))
    ]


def test_anchors_are_eligible_unique_sorted_and_counted():
    loss_mask, doc_ids = make_batch()
    eligible = eligible_by_loop(loss_mask.tolist(), doc_ids.tolist(), BLOCK)
    for max_anchors in (1, 4, 32):
        anchors, valid = sample_anchors(loss_mask, doc_ids, BLOCK, max_anchors, torch.Generator().manual_seed(1))
        assert anchors.shape == valid.shape == (3, max_anchors)
        assert anchors.dtype == torch.long and valid.dtype == torch.bool
        for row in range(3):
            chosen = anchors[row][valid[row]].tolist()
            assert len(chosen) == min(max_anchors, len(eligible[row]))
            assert set(chosen) <= set(eligible[row])
            assert len(set(chosen)) == len(chosen)
            assert chosen == sorted(chosen)
            # Valid anchors come first, padding after.
            assert valid[row].tolist() == [True] * len(chosen) + [False] * (max_anchors - len(chosen))


def test_all_eligible_positions_are_taken_when_there_are_few():
    loss_mask, doc_ids = make_batch()
    anchors, valid = sample_anchors(loss_mask, doc_ids, BLOCK, 64, torch.Generator().manual_seed(0))
    assert anchors[0][valid[0]].tolist() == [2, 3, 4, 5, 8, 9, 10, 11, 12]  # last B = 3 positions excluded
    assert anchors[1][valid[1]].tolist() == [1, 2, 3, 4, 5]
    assert not valid[2].any()


def test_sampling_is_deterministic_given_the_generator():
    loss_mask, doc_ids = make_batch()
    first = sample_anchors(loss_mask, doc_ids, BLOCK, 4, torch.Generator().manual_seed(7))
    again = sample_anchors(loss_mask, doc_ids, BLOCK, 4, torch.Generator().manual_seed(7))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    draws = {
        tuple(sample_anchors(loss_mask, doc_ids, BLOCK, 4, torch.Generator().manual_seed(s))[0][0].tolist())
        for s in range(20)
    }
    assert len(draws) > 1  # the generator, not a fixed rule, picks the anchors


def test_sampling_is_roughly_uniform_over_eligible_positions():
    loss_mask, doc_ids = make_batch()
    generator = torch.Generator().manual_seed(3)
    counts = torch.zeros(16)
    trials = 600
    for _ in range(trials):
        anchors, valid = sample_anchors(loss_mask[:1], doc_ids[:1], BLOCK, 3, generator)
        counts[anchors[0][valid[0]]] += 1
    eligible = [2, 3, 4, 5, 8, 9, 10, 11, 12]
    expected = trials * 3 / len(eligible)  # 200 per position
    assert counts[eligible].sub(expected).abs().max() < 0.25 * expected
    assert counts.sum() == counts[eligible].sum()
