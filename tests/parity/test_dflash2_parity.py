"""Parity with speculators 0.9.0's DFlash2DraftModel: same weights, same inputs, same anchors.

Our real training step (trainer.run.step.dflash_step with drafter_kind dflash2: our DFlash2Drafter, mask,
anchors, unary loss and selector loss) against speculators' DFlash2 forward, in float32 on CPU: the total
loss, its unary and selector parts, and the gradient of every trainable parameter (convolutions and
selector codebooks included) must agree. Inputs, anchors and conventions are lined up as for DFlash
(parity_harness.py); every weight is random, the convolutions far from their identity init.

Runs in speculators' own venv (`make parity`); skips elsewhere unless SPECULATORS_PARITY_REQUIRED=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from speculators_guard import require_speculators

require_speculators()
from speculators.losses import resolve_loss_config  # noqa: E402
from speculators.models.dflash2.core import DFlash2DraftModel  # noqa: E402

from dflash2_harness import Case, build_our_drafter, build_speculators_model, case  # noqa: E402
from parity_harness import (  # noqa: E402
    SMALL_DIMS,
    StandInTarget,
    make_inputs,
    patched,
    speculators_forward_row,
    speculators_loss_config,
)

from trainer.model.attention_mask import DraftAttention  # noqa: E402
from trainer.run.step import StepPlan, dflash_step, sample_step_anchors  # noqa: E402

LOSS_RTOL, LOSS_ATOL = 1e-6, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-5, 5e-6


# Kernel sizes 1-4 (a tap count above 2 reaches two slots back), group sizes giving 1-8 groups, top-K below
# and above the number of plausible tokens (gold injected often / rarely), CE and KL, 1-3 documents, 1-2 rows.
CASES = [
    case("b8-k2-g16-top16-kl-sdpa", 8, 5, (2,), 64, 4.0, "kl", "sdpa", 31,
         conv_kernel_size=2, conv_group_size=16, selector_rank=24, selector_top_k=16),
    case("b4-k3-g8-top4-ce-eager", 4, 6, (1,), 48, 4.0, "ce", "eager", 32,
         conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=4),
    case("b8-k4-g64-top2-kl-eager-rows", 8, 4, (1, 3), 72, 7.0, "kl", "eager", 33,
         conv_kernel_size=4, conv_group_size=64, selector_rank=16, selector_top_k=2, selector_loss_alpha=0.5),
    case("b6-k1-g4-top8-ce-sdpa-small", 6, 5, (2,), 48, 4.0, "ce", "sdpa", 34, dims=SMALL_DIMS,
         conv_kernel_size=1, conv_group_size=4, selector_rank=12, selector_top_k=8, selector_loss_alpha=2.0),
    # the recipe's layout: sliding layers, bidirectional within the block, a window shorter than the context
    case("b4-k2-g16-top8-kl-sdpa-sliding-w12", 4, 8, (2,), 64, 4.0, "kl", "sdpa", 35,
         sliding=(("sliding_attention", "full_attention"), 12),
         conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8),
]


@dataclass
class Result:
    ours: dict
    theirs: dict
    our_grads: dict
    their_grads: dict
    anchor_valid: torch.Tensor


def run_both(c: Case, *, our_alpha: float | None = None, our_non_causal: bool = True) -> Result:
    b = c.base
    inputs = make_inputs(b)
    drafter = build_our_drafter(c)
    model = build_speculators_model(c, drafter, inputs)
    plan = StepPlan(
        feature_layer_ids=list(range(1, b.dims.num_features + 1)), logits_source="final", block_size=b.block_size,
        max_anchors=b.max_anchors, gamma=b.gamma, loss_kind=b.loss_kind, context_includes_anchor=False,
        mask_token_id=b.mask_token_id, drafter_kind="dflash2",
        draft_attention=DraftAttention(c.layer_types, c.window, our_non_causal) if c.layer_types else None,
        selector_loss_alpha=c.settings.selector_loss_alpha if our_alpha is None else our_alpha,
    )
    batch = {"input_ids": inputs.input_ids, "position_ids": inputs.position_ids, "doc_ids": inputs.doc_ids,
             "loss_mask": inputs.loss_mask}
    anchors, anchor_valid = sample_step_anchors(batch, plan, b.seed + 2, step=1)
    loss, metrics = dflash_step(StandInTarget(inputs, b.dims.rms_eps), drafter, batch, anchors, anchor_valid, plan)
    loss.backward()
    our_grads = {name: p.grad.detach().clone() for name, p in drafter.named_parameters()}
    ours = {"loss": loss.item(), "unary": metrics["kind_metrics"]["unary_loss"],
            "selector": metrics["kind_metrics"]["selector_loss"],
            "counts": metrics["counts"]}

    rows = len(b.docs_per_row)
    theirs = {"loss": 0.0, "unary": 0.0, "selector": 0.0, "eal_sum": 0.0, "eal_total": 0.0}
    # speculators_forward_row passes DFlash's keywords; DFlash2's forward also takes the selector's weight and
    # a TV function for its metrics (its default is the Triton kernel; eager here, as for the loss).
    original = DFlash2DraftModel.forward
    extra = {"selector_loss_alpha": c.settings.selector_loss_alpha,
             "tv_loss_fn": resolve_loss_config("tv", "eager")["tv"][0]}
    for row in range(rows):
        with patched(DFlash2DraftModel, "forward", lambda self, *a, **k: original(self, *a, **{**k, **extra})):
            row_loss, row_metrics = speculators_forward_row(model, b, inputs, row, anchors, anchor_valid,
                                                            speculators_loss_config(b.loss_kind))
        (row_loss / rows).backward()
        theirs["loss"] += row_loss.item() / rows
        theirs["unary"] += float(row_metrics["unary_loss_sum"]) / rows
        theirs["selector"] += float(row_metrics["selector_loss_sum"]) / rows
        theirs["eal_sum"] += float(row_metrics["eal_sum"])
        theirs["eal_total"] += float(row_metrics["eal_total"])
    params = dict(model.named_parameters())
    their_grads = {name: params[name].grad.detach().clone() for name in our_grads}
    return Result(ours, theirs, our_grads, their_grads, anchor_valid)


_RESULTS: dict[str, Result] = {}


def result_of(c: Case) -> Result:
    if c.base.name not in _RESULTS:  # each case runs once per session, however many tests read it
        _RESULTS[c.base.name] = run_both(c)
    return _RESULTS[c.base.name]


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.base.name)
def test_loss_parts_and_gradients_match_speculators(c: Case):
    result = result_of(c)
    assert result.anchor_valid.any()
    ours, theirs = result.ours, result.theirs
    assert ours["selector"] > 0.05, "the selector term is trivially small: the comparison shows nothing"
    for part in ("unary", "selector", "loss"):
        assert ours[part] == pytest.approx(theirs[part], rel=LOSS_RTOL, abs=LOSS_ATOL), part
    # speculators' eal: 1 + the leading run of selector hits gated on gold in the unary top-K, per block
    counts = ours["counts"]
    assert counts["prefix"] / counts["blocks"] + 1.0 == pytest.approx(theirs["eal_sum"] / theirs["eal_total"], abs=1e-5)
    for name, grad in result.our_grads.items():
        their = result.their_grads[name]
        assert their.abs().max() > 0, f"{name} got no gradient from speculators"
        torch.testing.assert_close(grad, their, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")


def test_the_comparison_catches_a_wrong_selector_weight():
    # The same comparison with our alpha off by 10 % must disagree: the selector term is really compared.
    c = CASES[0]
    wrong = run_both(c, our_alpha=c.settings.selector_loss_alpha * 1.1)
    assert wrong.ours["loss"] != pytest.approx(result_of(c).theirs["loss"], rel=1e-4)


def test_the_comparison_catches_causal_sliding_layers():
    # DFlash2's sliding layers are bidirectional within the block: run ours causal and the losses must differ.
    c = next(c for c in CASES if c.layer_types)
    causal = run_both(c, our_non_causal=False)
    assert causal.ours["loss"] != pytest.approx(result_of(c).theirs["loss"], rel=1e-4)
