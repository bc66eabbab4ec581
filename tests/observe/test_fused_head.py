"""A head fused with its loss (a custom autograd Function over the hidden rows and the head weight, as chunked or
Liger-style losses are written): its logits never exist as a tensor with a graph, and the observer reads the
per-slot weights from the gradient at its hidden input. A soft-target loss fused the same way is not mistaken for
hard labels. Each script is a small hand-written trainer run observed for one step in the sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest

from sleuth.observe.runner import observe_command

TRAINER = '''
import math, sys, torch
from torch import nn

SOFT = sys.argv[1] == "soft"
GAMMA, BLOCK, VOCAB, HIDDEN = float(sys.argv[2]), 4, 48, 16
torch.manual_seed(0)


class FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, slot_weights, teacher):
        logits = hidden.detach() @ weight.detach().t()
        probs = torch.softmax(logits, -1)
        target = torch.softmax(teacher, -1) if SOFT else nn.functional.one_hot(labels, VOCAB).float()
        per_row = -(target * torch.log_softmax(logits, -1)).sum(-1)
        ctx.save_for_backward(probs - target, weight, slot_weights)
        return (slot_weights * per_row).sum() / slot_weights.numel()

    @staticmethod
    def backward(ctx, grad):
        diff, weight, slot_weights = ctx.saved_tensors
        scale = grad * slot_weights[:, None] / slot_weights.numel()
        return (scale * diff) @ weight, None, None, None, None


embed = nn.Embedding(VOCAB, HIDDEN)
head = nn.Linear(HIDDEN, VOCAB, bias=False)
for frozen in (embed, head):
    frozen.requires_grad_(False)
body = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN))
opt = torch.optim.AdamW(body.parameters(), lr=1e-3)
slot = torch.tensor([0.0] + [math.exp(-(k - 1) / GAMMA) for k in range(1, BLOCK)])
for step in range(3):
    ids = torch.randint(0, VOCAB, (6 * BLOCK,))
    hidden = body(embed(ids))
    loss = FusedHeadLoss.apply(hidden, head.weight, torch.randint(0, VOCAB, (6 * BLOCK,)), slot.repeat(6),
                               torch.randn(6 * BLOCK, VOCAB))
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fused")
    (root / "train.py").write_text(TRAINER)
    return root


def verdicts(code: Path, *args: str) -> dict:
    outcome = observe_command(["python", "train.py", *args], code, timeout_s=120)
    assert outcome.error is None, outcome.error
    return {v.invariant: v for v in outcome.verdicts}


def test_fused_hard_label_loss_gives_its_gamma_and_slot_zero(code: Path) -> None:
    found = verdicts(code, "hard", "7.0")
    assert found["dflash.loss_decay_gamma"].status == "mismatch"
    assert "gamma 7.000 at block size 4" in found["dflash.loss_decay_gamma"].observed
    assert "fused into FusedHeadLoss" in found["dflash.loss_decay_gamma"].measurement
    assert found["dflash.anchor_slot_untrained"].status == "match"


def test_fused_soft_target_loss_claims_nothing(code: Path) -> None:
    found = verdicts(code, "soft", "4.0")
    for invariant in ("dflash.loss_decay_gamma", "dflash.anchor_slot_untrained"):
        assert found[invariant].status == "unknown", found[invariant]
