"""The chunked loss (trainer/model/loss.py block_loss) against a naive whole-tensor reference.

The reference builds what the step used to build: the drafter's [M, V] logits, the teacher's [M, V] logits
gathered at p+j-1, float32 log-softmax, per-slot CE / KL, the weights (decay or D-PACE), per-row
normalisation. The chunked loss must give the same loss, metrics and gradients (w.r.t. the drafter's hidden
states and, where it trains, the head) at every chunk size, and never hold more than a chunk of logits.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.model.loss import (
    IDENTITY_HEAD,
    LOSS_REDUCTION_EPS,
    BlockTeacher,
    LogitsHead,
    block_loss,
    decay_weights,
    dflash_loss,
    dpace_weights,
    loss_chunk_slots,
    metrics_from_counts,
    teacher_positions,
)

N, A, B, S, H, V = 2, 5, 4, 23, 8, 37


def case(seed=0, vocab=V, softcap=None, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N * A * B, H, generator=g)
    weight = torch.randn(vocab, H, generator=g)
    head_bias = torch.randn(vocab, generator=g) if bias else None
    teacher_hidden = torch.randn(N * S, H, generator=g) * 2
    anchors = torch.sort(torch.randperm(S - B, generator=g)[: A * N].view(N, A), dim=1).values
    rows = (teacher_positions(anchors, B, S) + torch.arange(N)[:, None, None] * S).flatten()
    valid = torch.rand(N, A, B, generator=g) > 0.25
    valid[:, :, 0] = False
    valid[1, 2] = False  # a block without labels
    return hidden, weight, head_bias, teacher_hidden, rows, valid, softcap


def naive(hidden, weight, bias, teacher_hidden, rows, weights, kind, weighting="decay", alpha=0.5, softcap=None,
          vocab_ids=None):
    """The whole-tensor loss of the step before chunking (trainer/model/loss.py at main 22f97b5)."""
    w = weight if vocab_ids is None else weight[vocab_ids]
    b = None if bias is None else (bias if vocab_ids is None else bias[vocab_ids])
    draft_logits = F.linear(hidden, w, b).float().view(N, A, B, -1)
    target = F.linear(teacher_hidden[rows], w.detach(), None if b is None else b.detach())  # the teacher is frozen
    if softcap:
        target = torch.tanh(target / softcap) * softcap
    target = target.float().view(N, A, B, -1)
    draft_logp = F.log_softmax(draft_logits, dim=-1)
    if kind == "ce":
        per_slot = -draft_logp.gather(-1, target.argmax(-1, keepdim=True)).squeeze(-1)
    else:
        target_logp = F.log_softmax(target, dim=-1)
        per_slot = (target_logp.exp() * (target_logp - draft_logp)).sum(-1)
    valid = weights > 0
    if weighting == "dpace":
        weights = dpace_weights(per_slot.detach(), valid, alpha)
    loss = ((weights * per_slot).flatten(1).sum(1) / (valid.flatten(1).sum(1) + LOSS_REDUCTION_EPS)).mean()
    correct = draft_logits.argmax(-1) == target.argmax(-1)
    return loss, correct, valid


def weights_for(valid, weighting):
    return valid.float() * decay_weights(B, 4.0 if weighting == "decay" else None)


@pytest.mark.parametrize("kind, weighting", [("ce", "decay"), ("kl", "decay"), ("ce", "dpace")])
@pytest.mark.parametrize("chunk", [B, 3 * B, 1000])
def test_chunked_loss_and_gradient_equal_the_whole_tensor_loss(kind, weighting, chunk):
    hidden, weight, _, teacher_hidden, rows, valid, _ = case(seed=1)
    weights = weights_for(valid, weighting)
    draft = hidden.clone().requires_grad_(True)
    result = block_loss(draft, LogitsHead(weight), BlockTeacher(teacher_hidden, LogitsHead(weight), rows), weights,
                        kind, weighting, 0.5, chunk_size=chunk)
    result.loss.backward()
    reference = hidden.clone().requires_grad_(True)
    expected, correct, label_valid = naive(reference, weight, None, teacher_hidden, rows, weights, kind, weighting)
    expected.backward()
    torch.testing.assert_close(result.loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(draft.grad, reference.grad, rtol=1e-4, atol=1e-7)
    counts = result.counts
    assert counts["labels"] == label_valid[..., 1:].flatten(0, 1).sum(0).tolist()
    assert counts["correct"] == (correct & label_valid)[..., 1:].flatten(0, 1).sum(0).tolist()


@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_a_trainable_head_with_a_bias_a_draft_vocabulary_and_softcapped_teacher_get_exact_gradients(kind):
    hidden, weight, bias, teacher_hidden, rows, valid, _ = case(seed=2, bias=True)
    vocab_ids = torch.tensor([0, 3, 4, 9, 10, 17, 30, 36])  # a draft vocabulary: the teacher on the same rows
    weights = weights_for(valid, "decay")
    ours = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    draft_head = LogitsHead(ours[1][vocab_ids], ours[2][vocab_ids])
    teacher_head = LogitsHead(weight[vocab_ids], bias[vocab_ids], softcap=3.0)
    result = block_loss(ours[0], draft_head, BlockTeacher(teacher_hidden, teacher_head, rows), weights, kind,
                        chunk_size=2 * B)
    result.loss.backward()
    theirs = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    expected, _, _ = naive(theirs[0], theirs[1], theirs[2], teacher_hidden, rows, weights, kind, softcap=3.0,
                           vocab_ids=vocab_ids)
    expected.backward()
    torch.testing.assert_close(result.loss, expected, rtol=1e-5, atol=1e-6)
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-4, atol=1e-6)


def test_bfloat16_keeps_float32_softmax_and_matches_the_bfloat16_reference():
    hidden, weight, _, teacher_hidden, rows, valid, _ = case(seed=3)
    weights = weights_for(valid, "decay")
    hidden, weight, teacher_hidden = hidden.bfloat16(), weight.bfloat16(), teacher_hidden.bfloat16()
    draft = hidden.clone().requires_grad_(True)
    result = block_loss(draft, LogitsHead(weight), BlockTeacher(teacher_hidden, LogitsHead(weight), rows), weights,
                        "kl", chunk_size=B)
    result.loss.backward()
    reference = hidden.clone().requires_grad_(True)
    expected, _, _ = naive(reference, weight, None, teacher_hidden, rows, weights, "kl")
    expected.backward()
    assert result.loss.dtype == torch.float32 and draft.grad.dtype == torch.bfloat16
    torch.testing.assert_close(result.loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(draft.grad.float(), reference.grad.float(), rtol=2e-2, atol=1e-4)


def test_metrics_and_argmaxes_cover_label_valid_slots_only():
    hidden, weight, _, teacher_hidden, rows, valid, _ = case(seed=4)
    weights = weights_for(valid, "decay")
    result = block_loss(hidden, LogitsHead(weight), BlockTeacher(teacher_hidden, LogitsHead(weight), rows), weights,
                        "ce", chunk_size=B)
    _, correct, label_valid = naive(hidden, weight, None, teacher_hidden, rows, weights, "ce")
    assert torch.equal(result.draft_ids >= 0, label_valid) and torch.equal(result.teacher_ids >= 0, label_valid)
    assert torch.equal((result.draft_ids == result.teacher_ids) & label_valid, correct & label_valid)
    expected_ids = F.linear(teacher_hidden[rows], weight).argmax(-1).view(N, A, B)
    assert torch.equal(result.teacher_ids[label_valid], expected_ids[label_valid])
    metrics = metrics_from_counts(result.counts)
    assert metrics["acc"] == pytest.approx(float((correct & label_valid)[..., 1:].sum() / label_valid[..., 1:].sum()))


def test_no_gradient_is_computed_without_grad_mode():
    hidden, weight, _, teacher_hidden, rows, valid, _ = case(seed=5)
    draft = hidden.clone().requires_grad_(True)
    with torch.no_grad():
        result = block_loss(draft, LogitsHead(weight), BlockTeacher(teacher_hidden, LogitsHead(weight), rows),
                            weights_for(valid, "decay"), "ce")
    assert result.loss.grad_fn is None


def test_logits_given_directly_take_the_same_path():
    """The probe protocol's hook hands the loss logits (identity head): the same loss and d loss / d logits."""
    hidden, weight, _, teacher_hidden, rows, valid, _ = case(seed=6)
    weights = weights_for(valid, "dpace")
    logits = F.linear(hidden, weight).requires_grad_(True)
    teacher = BlockTeacher(teacher_hidden, LogitsHead(weight), rows)
    result = block_loss(logits, IDENTITY_HEAD, teacher, weights, "ce", "dpace", chunk_size=B)
    (grad,) = torch.autograd.grad(result.loss, logits)
    reference = logits.detach().clone().requires_grad_(True)
    # linear with the identity matrix is the logits themselves; the teacher's rows are its logits already
    expected, _, _ = naive(reference, torch.eye(V), None, teacher_hidden @ weight.T, rows, weights, "ce", "dpace")
    (expected_grad,) = torch.autograd.grad(expected, reference)
    torch.testing.assert_close(result.loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-7)


def test_the_whole_tensor_interface_is_the_same_loss():
    g = torch.Generator().manual_seed(7)
    draft = torch.randn(N, A, B, V, generator=g)
    target = torch.randn(N, A, B, V, generator=g)
    weights = weights_for(torch.rand(N, A, B, generator=g) > 0.3, "decay")
    losses = {chunk: dflash_loss(draft, target, weights, "kl", chunk_size=chunk)[0].item() for chunk in (B, 2 * B, None)}
    assert len({round(x, 6) for x in losses.values()}) == 1


class LargestTensor(TorchDispatchMode):
    """The largest number of elements any operation produced while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_no_tensor_grows_with_anchors_times_vocabulary(kind):
    """At a vocabulary much larger than hidden states and rows, the biggest tensor of forward and backward
    is one chunk of logits: doubling the anchors leaves it unchanged; the whole [A*B, V] never exists."""
    vocab, chunk = 2048, B
    largest = {}
    for anchors in (8, 16):
        g = torch.Generator().manual_seed(8)
        draft = torch.randn(anchors * B, H, generator=g, requires_grad=True)
        weight = torch.randn(vocab, H, generator=g)
        teacher = BlockTeacher(torch.randn(64, H, generator=g), LogitsHead(weight),
                               torch.randint(0, 64, (anchors * B,), generator=g))
        weights = torch.ones(1, anchors, B) * decay_weights(B, 4.0)
        with LargestTensor() as seen:
            block_loss(draft, LogitsHead(weight), teacher, weights, kind, chunk_size=chunk).loss.backward()
        largest[anchors] = seen.largest
    # the head's weight itself (a transposed view of it) or one chunk of logits, whichever is larger
    assert largest[8] == largest[16] <= max(chunk * vocab, vocab * H) < 8 * B * vocab


def test_chunk_slots_are_whole_blocks_and_follow_the_vocabulary():
    assert loss_chunk_slots(None, 248320, 16) == 256  # 256 MiB of float32 logits at Qwen3.5's vocabulary
    assert loss_chunk_slots(None, 151936, 16) == 432
    assert loss_chunk_slots(None, 128, 8) == 2**19  # a small vocabulary: every slot of a step in one chunk
    assert loss_chunk_slots(100, 248320, 16) == 96
    assert loss_chunk_slots(3, 248320, 16) == 16  # at least one block
    assert math.isclose(loss_chunk_slots(None, 248320, 16) * 248320 * 4 / 2**20, 242.5, rel_tol=1e-2)
