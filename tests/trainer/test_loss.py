"""Decay weights, target gathering, the loss and its metrics against loop references."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from trainer.model.loss import decay_weights, dflash_loss, gather_block_logits, slot_weights


@pytest.mark.parametrize("gamma", [4.0, 7.0, None])
def test_decay_weights_follow_the_formula(gamma):
    block_size = 6
    expected = [0.0] + [1.0 if gamma is None else math.exp(-(k - 1) / gamma) for k in range(1, block_size)]
    torch.testing.assert_close(decay_weights(block_size, gamma), torch.tensor(expected))


def test_gathered_targets_are_the_real_targets_logits_shifted_by_one(tmp_path):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    target = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    input_ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        logits = target(input_ids).logits  # [2, 16, 97]
    block_size = 4
    anchors = torch.tensor([[0, 3, 11], [5, 6, 0]])
    gathered = gather_block_logits(logits, anchors, block_size)
    assert gathered.shape == (2, 3, block_size, 97)
    for b in range(2):
        for a in range(3):
            p = anchors[b, a].item()
            assert torch.all(gathered[b, a, 0] == 0)
            for j in range(1, block_size):
                # Slot j predicts token p+j: the target's distribution at position p+j-1.
                assert torch.equal(gathered[b, a, j], logits[b, p + j - 1])


def slot_weights_by_loop(anchors, anchor_valid, loss_mask, doc_ids, block_size, gamma):
    seq_len = len(loss_mask[0])
    out = []
    for b in range(len(anchors)):
        row = []
        for a, p in enumerate(anchors[b]):
            block = []
            for j in range(block_size):
                w = 0.0
                if j >= 1 and anchor_valid[b][a] and p + j < seq_len:
                    if loss_mask[b][p + j] == 1 and doc_ids[b][p + j] == doc_ids[b][p]:
                        w = 1.0 if gamma is None else math.exp(-(j - 1) / gamma)
                block.append(w)
            row.append(block)
        out.append(row)
    return torch.tensor(out)


@pytest.mark.parametrize("gamma", [4.0, None])
def test_slot_weights_equal_loop_reference(gamma):
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]])
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, -1, -1, -1]])
    anchors = torch.tensor([[1, 3, 7], [4, 0, 0]])
    valid = torch.tensor([[True, True, True], [True, False, False]])
    block_size = 4
    weights = slot_weights(anchors, valid, loss_mask, doc_ids, block_size, gamma)
    expected = slot_weights_by_loop(
        anchors.tolist(), valid.tolist(), loss_mask.tolist(), doc_ids.tolist(), block_size, gamma
    )
    torch.testing.assert_close(weights, expected)
    assert torch.all(weights[..., 0] == 0)


def loss_by_loop(draft, target, weights, kind):
    """Per row: sum(w * loss) / (number of slots with w > 0 + 1e-5); then the mean over rows."""
    row_losses = []
    for b in range(len(draft)):
        total, count = 0.0, 0
        for a in range(len(draft[b])):
            for j in range(len(draft[b][a])):
                w = weights[b][a][j]
                if w == 0:
                    continue
                d, t = draft[b][a][j], target[b][a][j]
                d_lse = math.log(sum(math.exp(x) for x in d))
                if kind == "ce":
                    label = max(range(len(t)), key=lambda i: t[i])
                    slot_loss = d_lse - d[label]
                else:
                    t_lse = math.log(sum(math.exp(x) for x in t))
                    slot_loss = sum(
                        math.exp(t[i] - t_lse) * ((t[i] - t_lse) - (d[i] - d_lse)) for i in range(len(t))
                    )
                total += w * slot_loss
                count += 1
        row_losses.append(total / (count + 1e-5))
    return sum(row_losses) / len(row_losses)


def random_case(seed=0, rows=2, anchors=3, block_size=4, vocab=11):
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randn(rows, anchors, block_size, vocab, generator=generator)
    target = torch.randn(rows, anchors, block_size, vocab, generator=generator) * 2
    valid = torch.rand(rows, anchors, block_size, generator=generator) > 0.3
    weights = valid.float() * decay_weights(block_size, 4.0)
    return draft, target, weights


@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_loss_equals_loop_reference(kind):
    draft, target, weights = random_case()
    loss, _ = dflash_loss(draft, target, weights, kind)
    expected = loss_by_loop(draft.tolist(), target.tolist(), weights.tolist(), kind)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_gamma_changes_the_loss():
    draft, target, weights = random_case()
    valid = weights > 0
    losses = [dflash_loss(draft, target, valid.float() * decay_weights(4, g), "ce")[0].item() for g in (4.0, 7.0, None)]
    assert len({round(x, 6) for x in losses}) == 3


def test_slot_zero_carries_no_weight_and_no_gradient():
    draft, target, _ = random_case()
    # Every slot valid: slot 0 is silenced by the decay weights alone.
    weights = torch.ones(2, 3, 4) * decay_weights(4, 4.0)
    draft.requires_grad_(True)
    loss, _ = dflash_loss(draft, target, weights, "kl")
    loss.backward()
    assert torch.all(draft.grad[:, :, 0] == 0)
    assert torch.any(draft.grad[:, :, 1] != 0)
    changed = draft.detach().clone()
    changed[:, :, 0] += torch.randn_like(changed[:, :, 0]) * 5
    assert dflash_loss(changed, target, weights, "kl")[0].item() == pytest.approx(loss.item())


def metrics_by_loop(correct, valid):
    """correct, valid: nested [N][A][B] bools; slot 0 ignored."""
    block_size = len(correct[0][0])
    right = [0] * block_size
    total = [0] * block_size
    streaks = []
    for b in range(len(correct)):
        for a in range(len(correct[b])):
            for j in range(1, block_size):
                if valid[b][a][j]:
                    total[j] += 1
                    right[j] += correct[b][a][j]
            if any(valid[b][a][1:]):
                streak = 0
                for j in range(1, block_size):
                    if not (valid[b][a][j] and correct[b][a][j]):
                        break
                    streak += 1
                streaks.append(streak)
    position_acc = [right[j] / total[j] if total[j] else 0.0 for j in range(1, block_size)]
    eal, prod = 0.0, 1.0
    for x in position_acc:
        prod *= x
        eal += prod
    return {
        "acc": sum(right) / sum(total),
        "position_acc": position_acc,
        "streak": sum(streaks) / len(streaks),
        "eal": eal,
    }


def test_metrics_equal_loop_reference():
    vocab, block_size = 5, 5
    generator = torch.Generator().manual_seed(4)
    target = torch.randn(2, 4, block_size, vocab, generator=generator)
    # The draft agrees with the target on a random ~70% of slots.
    agree = torch.rand(2, 4, block_size, generator=generator) < 0.7
    draft = torch.where(agree.unsqueeze(-1), target, -target)
    valid = torch.rand(2, 4, block_size, generator=generator) < 0.8
    valid[1, 3] = False  # a block without any label (e.g. a padding anchor) is left out of streak
    weights = valid.float() * decay_weights(block_size, 7.0)
    _, metrics = dflash_loss(draft, target, weights, "ce")
    correct = (draft.argmax(-1) == target.argmax(-1)).tolist()
    expected = metrics_by_loop(correct, (weights > 0).tolist())
    assert metrics["acc"] == pytest.approx(expected["acc"])
    assert metrics["position_acc"] == pytest.approx(expected["position_acc"])
    assert len(metrics["position_acc"]) == block_size - 1
    assert metrics["streak"] == pytest.approx(expected["streak"])
    assert metrics["eal"] == pytest.approx(expected["eal"])


def test_streak_stops_at_first_wrong_or_unlabelled_slot():
    vocab = 3
    target = torch.zeros(1, 2, 5, vocab)
    target[..., 0] = 1.0  # the target's argmax is token 0 everywhere
    draft = target.clone()
    draft[0, 0, 3] = torch.tensor([0.0, 5.0, 0.0])  # block 0: slot 3 wrong -> streak 2
    weights = torch.ones(1, 2, 5) * decay_weights(5, None)
    weights[0, 1, 2] = 0.0  # block 1: slot 2 has no label -> streak 1 even though slots 3, 4 agree
    _, metrics = dflash_loss(draft, target, weights, "ce")
    assert metrics["streak"] == pytest.approx(1.5)
    assert metrics["position_acc"] == pytest.approx([1.0, 1.0, 0.5, 1.0])
    assert metrics["eal"] == pytest.approx(1 + 1 + 0.5 + 0.5)
