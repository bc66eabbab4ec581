"""Two readings the round-7 blind catalog needed: the acceptance a run reports, against serving's rule on designed
drafts (sleuth.probes.acceptance), and each norm's eps read from how its output scales (experiments/norms.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from sleuth.probes.acceptance import design, verdict_fields
from sleuth.probes.experiments.norms import _measured_eps


def _runs_ending_at_untrained(correct: torch.Tensor, valid: torch.Tensor) -> list[float]:
    """speculators' rule: the run of correct and trained slots from the first drafted slot, + 1, per block with a
    trained slot."""
    out = []
    for c, v in zip(correct.tolist(), valid.tolist()):
        if any(v):
            run = 0
            for ok, trained in zip(c, v):
                if not (ok and trained):
                    break
                run += 1
            out.append(run + 1.0)
    return out


def _runs_skipping_untrained(correct: torch.Tensor, valid: torch.Tensor, per_block: bool = True) -> list[float]:
    """SpecForge's rule (an untrained slot neither ends nor extends the run); `per_block=False` is the planted defect
    that counts every correct trained slot (no cumulative product over the slots)."""
    out = []
    for c, v in zip(correct.tolist(), valid.tolist()):
        if any(v):
            run, going = 0, True
            for ok, trained in zip(c, v):
                if trained and not ok and per_block:
                    going = False
                if trained and ok and going:
                    run += 1
            out.append(run + 1.0)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_both_upstream_rules_give_the_designed_acceptance(seed):
    g = torch.Generator().manual_seed(seed)
    blocks, b, vocab = 12, 8, 50
    targets = torch.randint(0, vocab, (blocks, b), generator=g)
    valid = torch.rand(blocks, b, generator=g) > 0.25
    valid[0] = False  # a block without a trained slot is not counted
    valid[1, :] = True
    plan = design(targets, valid, first_slot=1, vocab=vocab)
    correct = (plan.predictions == targets)[:, 1:]
    drafted_valid = valid[:, 1:]
    for rule in (_runs_ending_at_untrained, _runs_skipping_untrained):
        runs = rule(correct, drafted_valid)
        assert len(runs) == plan.blocks
        assert math.isclose(sum(runs), plan.accepted_sum)
    assert plan.partial_blocks > 0  # the denominator's rule is exercised


def test_defective_metrics_disagree_with_the_designed_acceptance():
    g = torch.Generator().manual_seed(3)
    blocks, b, vocab = 10, 8, 50
    targets = torch.randint(0, vocab, (blocks, b), generator=g)
    valid = torch.ones(blocks, b, dtype=torch.bool)
    valid[2, 5:], valid[6, 3:] = False, False  # two blocks cut short by a document end
    plan = design(targets, valid, first_slot=1, vocab=vocab)
    correct, drafted_valid = (plan.predictions == targets)[:, 1:], valid[:, 1:]
    expected = plan.accepted_sum / plan.blocks
    counted_all = _runs_skipping_untrained(correct, drafted_valid, per_block=False)
    assert sum(counted_all) / len(counted_all) > expected + 0.5  # the slots after a miss are correct again
    full_blocks = [r for r, v in zip(_runs_ending_at_untrained(correct, drafted_valid), drafted_valid) if v.all()]
    # the two blocks cut short leave the denominator; the mean can agree by chance (it does here), the parts cannot
    assert len(full_blocks) == plan.blocks - 2
    fields = verdict_fields(sum(full_blocks), len(full_blocks), plan, "eal")
    assert fields["status"] == "mismatch"
    assert verdict_fields(plan.accepted_sum, plan.blocks, plan, "eal")["status"] == "match"


def test_chunks_designed_with_offsets_plan_what_one_piece_plans():
    # a metric evaluated in chunks (SpecForge's Domino objective) is designed chunk by chunk: with each chunk's
    # offset the blocks get the first wrong slots one design over all of them gives, not a restart per chunk
    g = torch.Generator().manual_seed(5)
    targets = torch.randint(0, 50, (12, 8), generator=g)
    valid = torch.ones(12, 8, dtype=torch.bool)
    whole = design(targets, valid, first_slot=1, vocab=50)
    first = design(targets[:5], valid[:5], first_slot=1, vocab=50)
    rest = design(targets[5:], valid[5:], first_slot=1, vocab=50, offset=5)
    assert torch.equal(torch.cat([first.predictions, rest.predictions]), whole.predictions)
    assert first.accepted_sum + rest.accepted_sum == whole.accepted_sum
    restarted = design(targets[5:], valid[5:], first_slot=1, vocab=50)
    assert not torch.equal(restarted.predictions, rest.predictions)


class _OnePlusWeightNorm(nn.Module):
    """Qwen3.5's convention: x * (1 + w)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


@pytest.mark.parametrize("module, eps", [
    (Qwen3RMSNorm(32, eps=3e-6), 3e-6),
    (Qwen3RMSNorm(16), 1e-6),
    (nn.RMSNorm(32, eps=1e-5), 1e-5),
    (nn.LayerNorm(32, eps=2e-6, bias=False), 2e-6),
    (_OnePlusWeightNorm(32, 3e-6), 3e-6),
])
def test_each_norms_eps_is_read_from_how_its_output_scales(module, eps):
    with torch.no_grad():  # a gain far from 1: the reading must not depend on it
        if isinstance(module, _OnePlusWeightNorm):
            module.weight.uniform_(-0.5, 0.5)
        else:
            module.weight.uniform_(0.5, 2.0)
    measured = _measured_eps(module)
    assert measured is not None and math.isclose(measured, eps, rel_tol=0.01)


def test_a_module_that_is_not_a_norm_has_no_eps():
    assert _measured_eps(_Gain(32)) is None  # a 1-D weight, but its output follows the input's scale


class _Gain(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight
