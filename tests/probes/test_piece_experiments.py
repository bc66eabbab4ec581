"""The experiments on located pieces, on small functions whose answer is known (each written here from the
rule, with one defect planted where a test says so), called through the same binding the probe child uses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sleuth.probes import piece_experiments as px
from sleuth.probes.binding import BindError, call_piece, plan_slots
from sleuth.probes.verdict import Expectations


def _call(function, scene, accept, params=None, passed=None, gamma=None):
    import inspect

    names = params or list(inspect.signature(function).parameters)
    params = [{"name": n, "kind": "positional", "has_default": False, "annotation": ""} for n in names]
    book = px.book(px.scene_roles(scene, gamma))
    slots = plan_slots(function, params, passed or {}, {}, book, px.config_answer(scene, {}, gamma), set(), None)
    return call_piece(function, slots, accept)


def visibility(anchors, doc, block, *, leak=False, cross=False, causal=False):
    """The rule written plainly, one (query, key) pair at a time: [A*B, S + A*B] bool, True = attend."""
    s, q = doc.shape[0], anchors.shape[0] * block
    out = torch.zeros(q, s + q, dtype=torch.bool)
    for row in range(q):
        anchor = int(anchors[row // block])
        for key in range(s):
            before = key <= anchor if leak else key < anchor
            out[row, key] = before and doc[key] == doc[anchor]
        for col in range(q):
            same = row // block == col // block
            out[row, s + col] = (True if cross else same) and not (causal and col > row and same)
    return out


def judged_mask(builder):
    scene = px.make_scene(4)
    captured = {}

    def accept(result, _args):
        reading = px.read_mask(px.dense_mask(result, scene), scene)
        captured["reading"] = reading
        return None if reading else "no reading"

    call = _call(builder, scene, accept)
    return {v.invariant: v for v in px.judge_mask(captured["reading"], scene, True, None, "here", call.described())}


def test_a_correct_mask_matches_all_three_rules_in_any_polarity_or_form():
    for builder in (lambda anchors, doc, block: visibility(anchors, doc, block),
                    lambda anchors, doc, block: ~visibility(anchors, doc, block),  # True = blocked
                    lambda anchors, doc, block: torch.where(visibility(anchors, doc, block), 0.0, float("-inf"))):
        verdicts = judged_mask(builder)
        assert {k: v.status for k, v in verdicts.items()} == {
            "dflash.context_excludes_anchor": "match", "dflash.blocks_isolated": "match",
            "dflash.block_bidirectional": "match"}


def test_a_mask_returned_with_the_positions_is_read_from_its_tuple():
    # a blind trainer's `allow, q_ix, kv_ix, slot = build_allow(anc, T, B)`: the mask is one element of what
    # the builder returns, beside integer index tables that are not masks
    def with_positions(anchors, doc, block, *, cross=False):
        per_query = anchors.repeat_interleave(block) + torch.arange(block).repeat(anchors.shape[0])
        return visibility(anchors, doc, block, cross=cross)[None, None], per_query[None], torch.arange(block)

    assert {k: v.status for k, v in judged_mask(with_positions).items()} == {
        "dflash.context_excludes_anchor": "match", "dflash.blocks_isolated": "match",
        "dflash.block_bidirectional": "match"}
    tiled = judged_mask(lambda anchors, doc, block: with_positions(anchors, doc, block, cross=True))
    assert tiled["dflash.blocks_isolated"].status == "mismatch"
    assert px.dense_mask({"positions": torch.arange(8)[None]}, px.make_scene(4)) == []  # an index table alone


@pytest.mark.parametrize(("defect", "invariant", "observed"), [
    ("leak", "dflash.context_excludes_anchor", "kv <= anchor"),
    ("cross", "dflash.blocks_isolated", "another block's tokens"),
    ("causal", "dflash.block_bidirectional", "causal within the block"),
])
def test_each_mask_defect_is_a_mismatch_of_its_rule_only(defect, invariant, observed):
    verdicts = judged_mask(lambda anchors, doc, block: visibility(anchors, doc, block, **{defect: True}))
    assert verdicts[invariant].status == "mismatch" and observed in verdicts[invariant].observed
    assert all(v.status == "match" for k, v in verdicts.items() if k != invariant)


def test_a_block_seeing_another_document_breaks_the_same_document_rule():
    def doc_le(anchors, doc, block):  # doc[kv] <= doc[q] instead of ==
        s, q = doc.shape[0], anchors.shape[0] * block
        owner = torch.arange(q) // block
        anchor = anchors[owner]
        context = (torch.arange(s)[None] < anchor[:, None]) & (doc[None] <= doc[anchor][:, None])
        return torch.cat([context, owner[:, None] == owner[None]], 1)

    verdicts = judged_mask(doc_le)
    assert verdicts["dflash.context_excludes_anchor"].status == "mismatch"
    assert "another document's context" in verdicts["dflash.context_excludes_anchor"].observed
    assert verdicts["dflash.blocks_isolated"].status == "match"


def test_a_mask_mod_factory_is_evaluated_on_every_pair():
    def factory(anchors, doc_ids, block, seq_len):
        def mask_mod(b, h, q_idx, kv_idx):
            anchor = anchors[q_idx // block]
            context = (kv_idx < seq_len) & (kv_idx <= anchor) & (doc_ids[kv_idx.clamp(max=seq_len - 1)] == doc_ids[anchor])
            return context | ((kv_idx >= seq_len) & ((kv_idx - seq_len) // block == q_idx // block))
        return mask_mod

    verdicts = judged_mask(factory)
    assert verdicts["dflash.context_excludes_anchor"].status == "mismatch"  # the `<=` planted above


def test_a_mask_without_document_ids_is_judged_on_one_document_rows():
    scene = px.make_scene(4)

    def no_docs(anchors, block, seq_len):
        q = anchors.shape[0] * block
        owner = torch.arange(q) // block
        return torch.cat([torch.arange(seq_len)[None] < anchors[owner][:, None], owner[:, None] == owner[None]], 1)

    reading = px.read_mask(px.dense_mask(_call(no_docs, scene, lambda r, a: None).result, scene), scene, documents=False)
    alone = {v.invariant: v for v in px.judge_mask(reading, scene, False, None, "here", "")}
    assert alone["dflash.context_excludes_anchor"].status == "match"  # rows hold one document: nothing to leak across
    packed = {v.invariant: v for v in px.judge_mask(reading, scene, False, "`doc_ids` at train.py:9", "here", "")}
    assert packed["dflash.context_excludes_anchor"].status == "unknown"  # same document only: not exercised
    assert "takes no document ids" in packed["dflash.context_excludes_anchor"].reason
    assert packed["dflash.blocks_isolated"].status == "match"  # other blocks and later context were exercised


def _weights_verdicts(weights, block, gamma_given=None, block_known=True):
    return {v.invariant: v for v in px.judge_weights(torch.as_tensor(weights, dtype=torch.float64), block, gamma_given,
                                                     Expectations(), "weights", "here", "", "", block_known)}


def test_slot_weights_slot_zero_and_gamma():
    k = torch.arange(8, dtype=torch.float64)
    right = torch.cat([torch.zeros(1), torch.exp(-(k[1:] - 1) / 4.0)])
    verdicts = _weights_verdicts(right, 8, 4.0)
    assert verdicts["dflash.anchor_slot_untrained"].status == "match"
    assert verdicts["dflash.loss_decay_gamma"].status == "match"
    assert verdicts["dflash.loss_decay_gamma"].measured["gamma"] == pytest.approx(4.0)
    slot0 = _weights_verdicts(torch.exp(-k / 4.0), 8)
    assert slot0["dflash.anchor_slot_untrained"].status == "mismatch"
    multiplied = torch.where(k > 0, torch.exp(-(k - 1) * 4.0), torch.zeros(()))  # exp(-(k-1) * gamma)
    wrong = _weights_verdicts(multiplied, 8, 4.0)
    assert wrong["dflash.loss_decay_gamma"].status == "mismatch"
    assert "given gamma 4 and decays with 0.25" in wrong["dflash.loss_decay_gamma"].observed


def test_gamma_seven_is_unknown_when_the_block_size_is_not_the_runs():
    k = torch.arange(8, dtype=torch.float64)
    seven = torch.where(k > 0, torch.exp(-(k - 1) / 7.0), torch.zeros(()))
    assert _weights_verdicts(seven, 8)["dflash.loss_decay_gamma"].status == "mismatch"
    unknown = _weights_verdicts(seven, 8, block_known=False)["dflash.loss_decay_gamma"]
    assert unknown.status == "unknown" and "another block size" in unknown.reason


def test_layer_rules():
    def zlab(num_layers, k):
        return [num_layers // 2] if k == 1 else [round(1 + i * (num_layers - 4) / (k - 1)) for i in range(k)]

    assert px.measure_layer_rule(zlab, 5).convention == "zlab"
    assert px.measure_layer_rule(lambda n, k: [i + 1 for i in zlab(n, k)], 5).convention == "vllm"
    off = px.measure_layer_rule(lambda n, k: [round(i * (n - 4) / max(k - 1, 1)) for i in range(k)], 5)
    assert off.convention is None and off.observed["L=36,k=5"] == [0, 8, 16, 24, 32]


def test_positions_by_document_and_off_by_one():
    scene = px.make_scene(4)

    def positions(position_ids, anchors, block, shift=0):
        return (position_ids[anchors][:, None] + torch.arange(block) + shift).flatten()

    right = _call(positions, scene, lambda r, a: None, ["position_ids", "anchors", "block"])
    assert px.judge_positions(right.result, scene, True, "here", "").status == "match"
    plus = _call(lambda position_ids, anchors, block: positions(position_ids, anchors, block, 1), scene,
                 lambda r, a: None)
    verdict = px.judge_positions(plus.result, scene, True, "here", "")
    assert verdict.status == "mismatch" and verdict.observed == "anchor + j +1"
    index = _call(lambda position_ids, anchors, block: (anchors[:, None] + torch.arange(block)).flatten(), scene,
                  lambda r, a: None)
    assert "row index" in px.judge_positions(index.result, scene, True, "here", "").observed


def test_teacher_shift():
    scene = px.make_scene(4)

    def targets(target_logits, anchors, block, shift=-1):
        return target_logits[(anchors[:, None] + torch.arange(block) + shift).clamp(min=0)].argmax(-1)

    def accept(result, _args):
        found = px.slot_sources(result, scene)
        return None if isinstance(found, tuple) else found

    right = _call(targets, scene, accept, ["target_logits", "anchors", "block"])
    assert px.judge_teacher(px.slot_sources(right.result, scene), scene, "here", "").status == "match"
    none = _call(lambda target_logits, anchors, block: targets(target_logits, anchors, block, 0), scene, accept)
    verdict = px.judge_teacher(px.slot_sources(none.result, scene), scene, "here", "")
    assert verdict.status == "mismatch" and "no shift" in verdict.observed
    data = _call(lambda tokens, anchors, block: tokens[anchors[:, None] + torch.arange(block)], scene, accept)
    assert px.judge_teacher(px.slot_sources(data.result, scene), scene, "here", "").status == "match"  # data at p+j


def _loss_verdicts(loss_fn):
    scene = px.make_scene(6)
    a, b, v = len(scene.anchors), scene.block, scene.vocab
    inputs = px.LossInputs(torch.zeros(a, b, v, requires_grad=True), torch.randn(a, b, v, generator=torch.Generator().manual_seed(2)))
    grad = px.gradient(type("R", (), {"result": loss_fn(inputs.logits, inputs.teacher)})(), inputs.logits)
    return {x.invariant: x for x in px.judge_loss(grad, inputs, scene, False, Expectations(), "here", "")}


def test_the_loss_kind_and_its_own_weights_from_the_gradient():
    k = torch.arange(6, dtype=torch.float32)
    w = torch.where(k > 0, torch.exp(-(k - 1) / 4.0), torch.zeros(()))

    def ce(logits, teacher):
        per_slot = F.cross_entropy(logits.flatten(0, 1), teacher.argmax(-1).flatten(), reduction="none").view(logits.shape[:2])
        return (per_slot * w).sum()

    def kl(logits, teacher):
        q = teacher.softmax(-1)
        return ((q * (q.log() - logits.log_softmax(-1))).sum(-1) * w).sum()

    for loss, kind in ((ce, "ce"), (kl, "kl")):
        verdicts = _loss_verdicts(loss)
        assert verdicts["dflash.loss_kind"].observed.startswith(kind)
        assert verdicts["dflash.anchor_slot_untrained"].status == "match"
        assert verdicts["dflash.loss_decay_gamma"].measured["gamma"] == pytest.approx(4.0, rel=1e-3)


def test_a_parameter_no_role_fits_is_not_bound_and_says_why():
    scene = px.make_scene(4)

    def needs_a_tokenizer(tokenizer, anchors):
        return anchors

    with pytest.raises(BindError, match="cannot bind `tokenizer`"):
        _call(needs_a_tokenizer, scene, lambda r, a: None)


def test_trial_calls_find_the_shape_a_function_accepts():
    scene = px.make_scene(4)

    def rows_only(anchors, block):
        assert anchors.dim() == 1  # this code only takes one row of anchors
        return (anchors[:, None] + torch.arange(block)).flatten()

    call = _call(rows_only, scene, lambda r, a: None)
    assert call.how["anchors"] == "anchors [A]"
    assert call.trials[0].outcome.startswith("AssertionError") and call.trials[-1].outcome == "ok"
    assert math.isclose(len(call.trials), 2)
