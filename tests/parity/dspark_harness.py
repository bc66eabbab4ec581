"""Run our DSpark training step and speculators' `DSparkDraftModel` on identical weights and inputs.

The DFlash harness (parity_harness.py) lines up the backbone, the frozen tensors and the anchors; this adds the
DSpark heads (their weights copied by name, speculators' names are ours) and DSpark's loss settings.

One convention differs on purpose (`dspark.mask_target_alignment`): with sample_from_anchor speculators reads
slot k's loss mask at a+k, we read it at the label a+k+1 (as SpecForge and DeepSpec do). The two agree wherever
the loss mask does not fall from 1 to 0 inside a block's reach, so the parity inputs hold one document per row,
an unsupervised prompt, then supervised tokens up to the end of the row (no padding).
`falling_edge=True` ends each row with padding instead, where the two rules differ (the test pins that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from parity_harness import Inputs, ModelDims, StandInTarget, patched

from trainer.model.dspark import DSparkDrafter
from trainer.run.step import StepPlan, sample_step_anchors
from trainer.run.steps import training_step


@dataclass(frozen=True)
class DSparkCase:
    name: str
    block_size: int
    max_anchors: int
    rows: int
    seq_len: int
    gamma: float
    loss_kind: str  # "ce" | "kl"
    attn: str  # speculators' attention implementation: "eager" | "sdpa"
    seed: int
    sample_from_anchor: bool = True
    markov_rank: int = 8
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    confidence_head_alpha: float = 1.0
    dims: ModelDims = field(default_factory=ModelDims)

    @property
    def mask_token_id(self) -> int:
        return self.dims.vocab - 1

    def dspark(self) -> dict[str, Any]:
        return {"sample_from_anchor": self.sample_from_anchor, "markov_rank": self.markov_rank,
                "markov_head_type": self.markov_head_type, "enable_confidence_head": self.enable_confidence_head,
                "confidence_head_with_markov": self.confidence_head_with_markov,
                "confidence_head_alpha": self.confidence_head_alpha}


def make_inputs(case: DSparkCase, *, falling_edge: bool = False) -> Inputs:
    g = torch.Generator().manual_seed(case.seed)
    d, n, s = case.dims, case.rows, case.seq_len
    input_ids = torch.randint(0, d.vocab - 1, (n, s), generator=g)  # never the mask token
    position_ids = torch.arange(s).repeat(n, 1)
    doc_ids = torch.zeros(n, s, dtype=torch.long)
    loss_mask = torch.zeros(n, s, dtype=torch.long)
    for row in range(n):
        prompt = int(torch.randint(1, 5, (1,), generator=g))
        loss_mask[row, prompt:] = 1
        if falling_edge:
            padding = 3 + row
            loss_mask[row, s - padding:] = 0
            doc_ids[row, s - padding:] = -1
            input_ids[row, s - padding:] = 0
    features = torch.randn(n, s, d.num_features * d.hidden, generator=g)
    last_hidden = torch.randn(n, s, d.hidden, generator=g)
    embed_weight = torch.randn(d.vocab, d.hidden, generator=g)
    lm_head_weight = torch.randn(d.vocab, d.hidden, generator=g) * 0.1
    lm_head_weight[0, 0] += 3.0  # two dominant tokens: argmax agreement neither all 0 nor all 1
    lm_head_weight[1, 0] -= 3.0
    verifier_norm_weight = 1.0 + 0.1 * torch.randn(d.hidden, generator=g)
    return Inputs(input_ids, position_ids, doc_ids, loss_mask, features, last_hidden, embed_weight,
                  lm_head_weight, verifier_norm_weight)


def build_our_drafter(case: DSparkCase) -> DSparkDrafter:
    """Every weight random, norm gains and the heads included."""
    d = case.dims
    torch.manual_seed(case.seed + 1)
    drafter = DSparkDrafter.from_target_config(
        d.target_config(), num_layers=d.draft_layers, num_features=d.num_features, block_size=case.block_size,
        mask_token_id=case.mask_token_id, dspark=case.dspark(),
    )
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * 0.1)
    return drafter.float().train()


def speculators_config(case: DSparkCase, attn: str | None = None):
    from speculators.models.dspark import DSparkSpeculatorConfig

    d = case.dims
    return DSparkSpeculatorConfig(
        transformer_layer_config=d.target_config(num_hidden_layers=d.draft_layers, attn=attn or case.attn),
        draft_vocab_size=d.vocab,
        block_size=case.block_size,
        aux_hidden_state_layer_ids=list(range(1, d.num_features + 1)),
        mask_token_id=case.mask_token_id,
        sample_from_anchor=case.sample_from_anchor,
        markov_rank=case.markov_rank,
        markov_head_type=case.markov_head_type,
        enable_confidence_head=case.enable_confidence_head,
        confidence_head_with_markov=case.confidence_head_with_markov,
    )


def build_speculators_model(case: DSparkCase, drafter: DSparkDrafter, inputs: Inputs):
    from speculators.models.dspark.core import DSparkDraftModel

    model = DSparkDraftModel(speculators_config(case))
    state = {name: tensor.clone() for name, tensor in drafter.state_dict().items()}
    state["embed_tokens.weight"] = inputs.embed_weight.clone()
    state["lm_head.weight"] = inputs.lm_head_weight.clone()
    state["verifier_lm_head.weight"] = inputs.lm_head_weight.clone()
    state["verifier_norm.weight"] = inputs.verifier_norm_weight.clone()
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise AssertionError(f"weights speculators does not have: {result.unexpected_keys}")
    missing = [k for k in result.missing_keys if k not in ("t2d", "d2t")]
    if missing:
        raise AssertionError(f"speculators weights left unloaded: {missing}")
    return model.float().train()


def run_ours(case: DSparkCase, drafter: DSparkDrafter, inputs: Inputs, anchor_seed: int):
    plan = StepPlan(
        feature_layer_ids=list(range(1, case.dims.num_features + 1)), logits_source="final",
        block_size=case.block_size, max_anchors=case.max_anchors, gamma=case.gamma, loss_kind=case.loss_kind,
        context_includes_anchor=False, mask_token_id=case.mask_token_id, drafter_kind="dspark",
        dspark=case.dspark(),
    )
    batch = {"input_ids": inputs.input_ids, "position_ids": inputs.position_ids, "doc_ids": inputs.doc_ids,
             "loss_mask": inputs.loss_mask}
    anchors, anchor_valid = sample_step_anchors(batch, plan, anchor_seed, step=1)
    loss, metrics = training_step(StandInTarget(inputs, case.dims.rms_eps), drafter, batch, anchors, anchor_valid, plan)
    return loss, metrics, anchors, anchor_valid


def speculators_forward_row(model, case: DSparkCase, inputs: Inputs, row: int, anchors: Tensor, anchor_valid: Tensor):
    from speculators.losses import resolve_loss_config
    from speculators.losses.eager import tv_loss
    from speculators.models.dflash import core as dflash_core

    def forced_anchors(loss_mask: Tensor, num_anchors: int, size: int) -> tuple[Tensor, Tensor]:
        assert num_anchors == anchors.shape[1] and size == case.block_size
        return anchors[row].clone(), anchor_valid[row].clone()

    with patched(dflash_core, "select_anchors", forced_anchors):
        _, loss, metrics = model(
            hidden_states=inputs.features[row : row + 1],
            input_ids=inputs.input_ids[row : row + 1],
            loss_mask=inputs.loss_mask[row : row + 1],
            verifier_last_hidden_states=inputs.last_hidden[row : row + 1],
            document_ids=inputs.doc_ids[row : row + 1],
            position_ids=inputs.position_ids[row : row + 1],
            loss_config=resolve_loss_config({"ce": "ce", "kl": "kl_div"}[case.loss_kind], "eager"),
            tv_loss_fn=tv_loss,
            gamma=case.gamma if case.gamma is not None else math.inf,
            max_anchors=case.max_anchors,
            confidence_head_alpha=case.confidence_head_alpha,
            per_position_loss_weight="fixed-exp-decay",
        )
    return loss, metrics


@dataclass
class DSparkParityResult:
    case: DSparkCase
    our_loss: float
    their_loss: float
    our_metrics: dict[str, Any]
    their_counts: dict[str, float]  # summed over rows
    their_confidence_loss: float | None  # mean over rows
    our_grads: dict[str, Tensor]
    their_grads: dict[str, Tensor]
    anchors: Tensor
    anchor_valid: Tensor

    def their_position_acc(self) -> list[float]:
        start = 0 if self.case.sample_from_anchor else 1
        return [self.their_counts[f"position_{k}_acc_sum"] / max(self.their_counts[f"position_{k}_acc_total"], 1.0)
                for k in range(start, self.case.block_size)]


def run_parity(case: DSparkCase, *, falling_edge: bool = False) -> DSparkParityResult:
    inputs = make_inputs(case, falling_edge=falling_edge)
    drafter = build_our_drafter(case)
    model = build_speculators_model(case, drafter, inputs)
    loss, metrics, anchors, anchor_valid = run_ours(case, drafter, inputs, anchor_seed=case.seed + 2)
    loss.backward()
    our_grads = {name: p.grad.detach().clone() for name, p in drafter.named_parameters()}
    their_loss, counts, confidence = 0.0, {}, 0.0
    for row in range(case.rows):
        row_loss, row_metrics = speculators_forward_row(model, case, inputs, row, anchors, anchor_valid)
        (row_loss / case.rows).backward()
        their_loss += row_loss.item() / case.rows
        if "confidence_loss_sum" in row_metrics:
            confidence += float(row_metrics["confidence_loss_sum"]) / case.rows
        for key, value in row_metrics.items():
            if key.endswith(("_sum", "_total")) and not key.startswith(("loss", "confidence")):
                counts[key] = counts.get(key, 0.0) + float(value)
    params = dict(model.named_parameters())
    their_grads = {name: params[name].grad.detach().clone() for name in our_grads}
    return DSparkParityResult(case, loss.item(), their_loss, metrics, counts,
                              confidence if case.enable_confidence_head else None, our_grads, their_grads,
                              anchors, anchor_valid)


SMALL_DIMS = ModelDims(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64, draft_layers=1, vocab=96,
                       num_features=3)
DSPARK_CASES: list[DSparkCase] = [
    DSparkCase("b7-vanilla-kl-eager", 7, 5, 1, 48, 4.0, "kl", "eager", seed=31),
    DSparkCase("b4-gated-ce-sdpa-rows2", 4, 6, 2, 40, 4.0, "ce", "sdpa", seed=32, markov_head_type="gated"),
    DSparkCase("b8-rnn-kl-sdpa", 8, 4, 1, 64, 7.0, "kl", "sdpa", seed=33, markov_head_type="rnn",
               dims=SMALL_DIMS),
    DSparkCase("b4-nomarkov-conf-kl-eager-rolled", 4, 12, 1, 40, 4.0, "kl", "eager", seed=34, markov_rank=0,
               confidence_head_with_markov=False),
    DSparkCase("b7-vanilla-noconf-ce-eager-rows2", 7, 4, 2, 48, 4.0, "ce", "eager", seed=35,
               enable_confidence_head=False),
    DSparkCase("b6-conf-without-markov-input-alpha0.3-kl-sdpa", 6, 5, 1, 48, 4.0, "kl", "sdpa", seed=36,
               confidence_head_with_markov=False, confidence_head_alpha=0.3),
    # sample_from_anchor False: DFlash's slots with the Markov head (prev_k = x[a+k-1], prev_0 the anchor)
    DSparkCase("b6-no-anchor-sampling-vanilla-kl-eager", 6, 5, 1, 48, 4.0, "kl", "eager", seed=37,
               sample_from_anchor=False),
]
