"""What the loss trains each slot toward, with which weight: read from its gradient w.r.t. the draft logits."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from sleuth.probes.experiments.lab import (
    AGREEMENT,
    DATA_DEPENDENT,
    EXP_FIT,
    GAMMA_RTOL,
    GRADIENT_FORM,
    Lab,
    ONE_HOT,
    REDUCTION_RTOL,
    SOFT_TV,
    WEIGHT_FIT,
    from_run_config,
)
from sleuth.probes.protocol import ProbeHooks
from sleuth.probes.target import rms_norm
from sleuth.probes.verdict import Verdict


def _gradient_at(lab: Lab, logits: Tensor) -> Tensor | None:
    """d loss / d draft logits when the drafter's logits are replaced by `logits` [N, A, B, V]."""
    holder: dict[str, Tensor] = {}

    def hook(x: Tensor) -> Tensor:
        if "z" not in holder:
            holder["z"] = logits.to(x.dtype).reshape(x.shape).detach().requires_grad_(True)
        return holder["z"]

    loss = lab.subject.loss(lab.batch, ProbeHooks(draft_logits=hook))
    lab.facts["logits_hooked"] = "z" in holder
    if "z" not in holder or not isinstance(loss, Tensor) or not loss.requires_grad:
        return None
    (grad,) = torch.autograd.grad(loss, holder["z"], allow_unused=True)
    if grad is None:
        return None
    n, a = lab.batch.anchors.shape
    return grad.detach().double().reshape(n, a, lab.block_size, grad.shape[-1])


def _candidates(lab: Lab) -> dict[str, Tensor]:
    """Teachers a loss could use, as logits over each row [N, S, V]: final, each intermediate layer, data tokens."""
    batch, target = lab.batch, lab.target
    found = {"final": batch.logits.double()}
    for i in range(1, target.num_layers):
        normed = rms_norm(batch.hidden_states[i], target.norm_weight, target.rms_norm_eps)
        found[f"layer:{i}"] = (normed @ target.lm_head_weight.T).double()
    data = torch.full((*batch.input_ids.shape, target.vocab_size), -30.0, dtype=torch.float64)
    data.scatter_(-1, batch.input_ids[..., None], 30.0)
    found["data"] = data
    return found


def _describe_source(name: str) -> str:
    if name == "final":
        return "the target's final logits lm_head(norm(h_L))"
    if name == "data":
        return "the data tokens"
    layer = int(name.split(":")[1])
    return f"lm_head(norm(hidden_states[{layer}])), the output of layer {layer - 1}"


def _label_positions(lab: Lab) -> tuple[Tensor, Tensor, Tensor]:
    """pos [N, A, B] = anchor + j; the slots the reference trains (valid block, slot >= 1, the token at p+j
    inside the row's valid part, in the anchor's document and supervised); and the slots an implementation
    may train or not (a supervised token at p+j in the next document: speculators trains it, others mask it)."""
    batch, b = lab.batch, lab.block_size
    pos = batch.anchors[..., None] + torch.arange(b)  # [N, A, B]
    lengths = torch.tensor([r.length for r in lab.layout.rows])[:, None, None]
    inside = pos < lengths
    flat = pos.clamp(max=lab.layout.seq_len - 1).flatten(1)
    supervised = batch.loss_mask.gather(1, flat).view_as(pos).bool()
    same_doc = batch.doc_ids.gather(1, flat).view_as(pos) == batch.doc_ids.gather(1, batch.anchors)[..., None]
    base = batch.anchor_valid[..., None] & (torch.arange(b) > 0) & inside & supervised
    return pos, base & same_doc, base & ~same_doc


def probe_loss(lab: Lab) -> list[Verdict]:
    """The loss on the probe's batch, and again with two blocks per row: implementations take other paths
    when the blocks' tokens outnumber the row's positions than when they do not (speculators gathers the
    teacher logits per block in one case and rolls the whole row's in the other), so both regimes run."""
    many = _loss_pass(lab)
    few_lab = lab.with_anchors(2)
    if few_lab.layout.num_anchors * lab.block_size >= lab.layout.seq_len:
        return many
    few = _loss_pass(few_lab)
    lab.facts["padded_anchor_trained"] = lab.facts.get("padded_anchor_trained") or few_lab.facts.get("padded_anchor_trained")
    regimes = {"many": f"{lab.layout.num_anchors} anchor slots per row (A*B > S)",
               "few": f"{few_lab.layout.num_anchors} anchor slots per row (A*B < S)"}
    combined = []
    for main, other in zip(many, few):
        main.coverage["anchor_regimes"] = regimes
        if other.status == "mismatch" and main.status != "mismatch":
            other.observed = f"with few blocks per row (A*B < S): {other.observed}"
            other.coverage = main.coverage
            combined.append(other)
        else:
            combined.append(main)
    return combined


def _loss_pass(lab: Lab) -> list[Verdict]:
    b, v = lab.block_size, lab.target.vocab_size
    n, a = lab.batch.anchors.shape
    ids = ("dflash.target_logits_source", "dflash.target_shift", "dflash.loss_kind",
           "dflash.anchor_slot_untrained", "dflash.loss_decay_gamma")
    coverage = lab.coverage(tensors_observed=["d loss / d draft logits"])
    common = dict(
        experiment="loss-gradient",
        perturbed="the drafter's logits, replaced by zeros (a uniform draft); then by random logits",
        threshold=f"a teacher explains the slot targets when >= {AGREEMENT:.0%} of trained slots agree; one-hot at "
        f">= {ONE_HOT} mass; soft when total variation < {SOFT_TV}; CE / KL when grad = w (softmax(z) - q) within "
        f"{GRADIENT_FORM:g}",
        coverage=coverage,
    )
    grad = _gradient_at(lab, torch.zeros(n, a, b, v, dtype=torch.float64))
    if grad is None or grad.abs().max().item() == 0.0:
        reason = "the loss does not depend on the drafter's logits (no gradient reached them)"
        found = [Verdict(invariant=i, status="unknown", hypothesis="", measurement="", reason=reason, **common) for i in ids]
        if lab.facts.get("logits_hooked"):  # the hook replaced the logits the loss reads: the loss ignores them
            found[2].status, found[2].observed, found[2].reason = "mismatch", reason, ""
            found[2].fix = "Compute the loss from the drafter's logits (cross-entropy against the teacher)."
        return found

    # With a uniform draft p = 1/V, CE and KL both give grad = w * (p - q): q is the target, w the slot weight.
    p = 1.0 / v
    w_hat = grad.max(dim=-1).values * v  # exact for one-hot q, within V*min(q) for soft q
    trained = w_hat > 1e-9 * w_hat.max()
    q_hat = torch.where(trained[..., None], p - grad / w_hat.clamp_min(1e-30)[..., None], torch.zeros_like(grad))
    q_hat = q_hat.clamp_min(0)
    q_hat = q_hat / q_hat.sum(-1, keepdim=True).clamp_min(1e-30)
    pos, should, optional = _label_positions(lab)
    lab.facts["padded_anchor_trained"] = bool((trained & ~lab.batch.anchor_valid[..., None]).any())

    candidates = _candidates(lab)
    s = lab.layout.seq_len
    scores: dict[tuple[str, int], float] = {}
    judged = trained & lab.batch.anchor_valid[..., None]
    for name, cand in candidates.items():
        argmax = cand.argmax(-1)  # [N, S]
        for offset in (-2, -1, 0, 1):
            where = pos + offset
            ok = judged & (where >= 0) & (where < s)
            if ok.sum() == 0:
                continue
            cand_argmax = argmax.gather(1, where.clamp(0, s - 1).flatten(1)).view_as(where)
            agree = (cand_argmax == q_hat.argmax(-1)) & ok
            # over the slots this offset has a position for: a trained slot 0 of a block at position 0 has no
            # prediction at p - 1, and counting it against every candidate would blame the teacher
            scores[(name, offset)] = agree.sum().item() / max(ok.sum().item(), 1)
    ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0][0] != "final", kv[0][1] != -1))
    (best_name, best_offset), best = ranked[0]
    runner_up = next((sc for key, sc in ranked[1:] if key[0] != best_name or key[1] != best_offset), 0.0)
    # the slots the chosen teacher has a position for (a trained slot 0 at position 0 has no p - 1): the teacher's
    # form is judged there, not against a clamped neighbour's logits
    located = judged & (pos + best_offset >= 0) & (pos + best_offset < s)
    if not located.any():  # nothing to judge by at this offset: every trained slot, as before
        located = judged
    where = (pos + best_offset).clamp(0, s - 1)
    teacher_logits = candidates[best_name].gather(
        1, where.flatten(1)[..., None].expand(-1, -1, v)).view(n, a, b, v)  # [N, A, B, V]
    one_hot = bool((q_hat.max(-1).values[judged] >= ONE_HOT).all())
    soft_tv = 0.5 * (q_hat - torch.softmax(teacher_logits, -1)).abs().sum(-1)[located].mean().item()
    kind = "ce" if one_hot else ("kl" if soft_tv < SOFT_TV else None)

    # The gradient's form at random logits z: CE and forward KL give w * (softmax(z) - q) with q fixed: the
    # teacher's one-hot argmax or softmax where one explains the targets, else the targets recovered above.
    agreed = best >= AGREEMENT and runner_up < 0.5 and kind is not None
    q_model = q_hat
    if agreed:
        q_model = (torch.nn.functional.one_hot(teacher_logits.argmax(-1), v).double() if kind == "ce"
                   else torch.softmax(teacher_logits, -1))
    z2 = 2.0 * torch.randn(n, a, b, v, generator=torch.Generator().manual_seed(lab.seed + 11), dtype=torch.float64)
    grad2 = _gradient_at(lab, z2)
    p2 = torch.softmax(z2, -1)
    form = _form_residual(grad2, p2, q_model, located) if grad2 is not None else math.inf
    self_labels = grad2 is not None and _form_residual(
        grad2, p2, torch.nn.functional.one_hot(z2.argmax(-1), v).double(), located) < GRADIENT_FORM
    measurement = (f"best teacher: {_describe_source(best_name)} at p+j{best_offset:+d} explains {best:.0%} of trained "
                   f"slots (next best {runner_up:.0%}); recovered targets "
                   + ("one-hot" if one_hot else f"soft (total variation to its softmax {soft_tv:.3f})")
                   + f"; gradient form residual at random logits {form:.2g}")
    measured = {"best": [best_name, best_offset, best], "runner_up": runner_up, "one_hot": one_hot,
                "soft_tv": soft_tv, "form_residual": form}
    decided = best >= AGREEMENT and runner_up < 0.5 and not self_labels

    source = Verdict(invariant=ids[0], status="unknown", hypothesis="each slot is trained toward the target's final "
                     "logits", measurement=measurement, measured=measured, expected=_describe_source("final"), **common)
    shift = Verdict(invariant=ids[1], status="unknown", hypothesis="slot j of the block at p is trained toward the "
                    "target's prediction at p+j-1 (the token at p+j); slot 0 holds the token at p; the slots whose "
                    "token at p+j is unsupervised get no weight", measurement=measurement, measured=measured,
                    expected="p+j-1", **common)
    if self_labels:
        source.status = "mismatch"
        source.observed = "the targets are the drafter's own argmax (they move with its logits)"
        source.fix = "Take the teacher logits from the target's real output: lm_head(final_norm(h_L))."
        shift.reason = "no teacher to align: the targets are the drafter's own predictions"
    elif not decided:
        clean = kind is not None and form < GRADIENT_FORM
        described = f"{_describe_source(best_name)} at p+j{best_offset:+d} agrees on {best:.0%}"
        if clean and best < AGREEMENT:
            source.status = "mismatch"
            source.observed = f"the targets match no legitimate teacher (best: {described})"
            source.fix = "Take the teacher logits from the target's real output: lm_head(final_norm(h_L))."
            shift.reason = "no teacher to align: the targets match none"
        else:
            source.reason = shift.reason = (f"no teacher explains the recovered targets unambiguously (best {described}, "
                                            f"next {runner_up:.0%})")
    elif best_name == "data":
        source.reason = ("the loss trains toward the data tokens: that is the target's output only if the data "
                         "was regenerated by the target")
        shift.status = "match" if best_offset == 0 else "mismatch"
        shift.observed = f"slot j learns the data token at p+j{best_offset:+d}"
    else:
        source.status = "match" if best_name == "final" else "mismatch"
        source.observed = _describe_source(best_name)
        if source.status == "mismatch":
            source.fix = "Take the teacher logits from the target's real output: lm_head(final_norm(h_L))."
        shift.status = "match" if best_offset == -1 else "mismatch"
        shift.observed = f"slot j learns the target's prediction at p+j{best_offset:+d}"
        if best_offset == 0:
            shift.observed += " (no shift: it learns the token after its own)"
        if shift.status == "mismatch":
            shift.fix = "Gather the teacher logits at p+j-1 for slot j (roll the target logits by one)."
    _check_alignment(lab, shift, trained, should, optional)

    kind_verdict = _kind_verdict(lab, kind, form, self_labels, decided, source, measurement, measured, common)
    # The weights: where they are zero, and how they fall along the block.
    slot0 = _slot0_verdict(lab, trained, w_hat, measurement, common)
    gamma = _gamma_verdict(lab, grad, grad2, p2, q_model, (should | optional) & trained, common)
    _check_reduction(lab, gamma, gamma.measured or {}, w_hat, judged, one_hot)
    if self_labels or form >= GRADIENT_FORM:
        gamma.status, gamma.observed, gamma.fix = "unknown", "", ""
        gamma.reason = "the slot weights cannot be read: the loss is not CE or KL against a fixed target (see loss_kind)"
    elif gamma.status == "mismatch" and lab.configured_value("weighting")[0] == "dpace" and kind_verdict.status != "mismatch":
        # D-PACE is a kind of loss (speculators' --per-position-loss-weight, SpecForge's loss_type): a weighting
        # that is not the configured D-PACE is a different loss, not only a different gamma
        kind_verdict.status, kind_verdict.reason = "mismatch", ""
        kind_verdict.observed = f"the configured D-PACE loss is not what is trained: {gamma.observed}"
        kind_verdict.fix = gamma.fix
    return [vv.gated() for vv in (source, shift, kind_verdict, slot0, gamma)]


# How a loss can divide its weighted sum: name -> (what it is, normaliser per row from (rows N, trained slots per row
# c_n, their total C, the applied weights' sum per row M_n, their total M)). Per-row reductions average the rows.
REDUCTIONS: dict[str, tuple[str, Any]] = {
    "weighted_mean": ("sum w_i l_i / sum w_i over the batch", lambda n, c, ct, m, mt: mt),
    "row_weighted_mean": ("each row's sum w_i l_i / sum w_i, averaged over rows", lambda n, c, ct, m, mt: m * n),
    "token_mean": ("sum w_i l_i / the number of trained slots in the batch", lambda n, c, ct, m, mt: ct),
    "row_token_mean": ("each row's sum w_i l_i / its number of trained slots, averaged over rows",
                       lambda n, c, ct, m, mt: c * n),
    "batch_mean": ("sum w_i l_i / the number of rows", lambda n, c, ct, m, mt: n),
    "sum": ("sum w_i l_i, not normalised", lambda n, c, ct, m, mt: 1.0),
}


def _absolute_weights(lab: Lab, measured: dict[str, Any], judged: Tensor) -> Tensor | None:
    """The weights the measured weighting applies, at their own scale (slot 1 of a fixed decay is 1; D-PACE's
    suffix sums as speculators' dpace_loss_decay computes them, at the uniform draft's confidence 1/V)."""
    b, mode = lab.block_size, measured.get("mode")
    slots = torch.arange(b, dtype=torch.float64).expand(judged.shape)
    if mode == "fixed-exp":
        return torch.exp(-(slots - 1).clamp(min=0) / float(measured["gamma"])) * judged
    if mode == "none":
        return judged.double()
    if mode == "dpace":
        confidence = torch.full(judged.shape, 1.0 / lab.target.vocab_size, dtype=torch.float64)
        return dpace_weights(confidence, judged.double(), float(measured["alpha"]))
    return None


def _identify_reduction(lab: Lab, measured: dict[str, Any], w_hat: Tensor, judged: Tensor) -> tuple[list[str], str]:
    """Which normaliser divides the weighted sum: the applied weight over the read one (w_i / w_hat_i) is the
    normaliser, one constant per row; the reductions it equals (several can coincide, e.g. on one row), and what
    was read."""
    model = _absolute_weights(lab, measured, judged)
    if model is None:
        return [], "the weighting has no known absolute scale"
    rows = [n for n in range(judged.shape[0]) if judged[n].any()]
    if not rows:
        return [], "no trained slot"
    n_rows = judged.shape[0]
    counts = {n: float(judged[n].sum()) for n in range(n_rows)}
    sums = {n: float(model[n].sum()) for n in range(n_rows)}
    read = {}
    for n in rows:
        ratio = (model[n][judged[n]] / w_hat[n][judged[n]].clamp_min(1e-300))
        if (ratio.max() - ratio.min()).item() > REDUCTION_RTOL * ratio.mean().item() * 10:
            return [], f"the applied weights over the read ones differ within row {n} (not one normaliser)"
        read[n] = ratio.mean().item()
    found = [name for name, (_what, norm) in REDUCTIONS.items()
             if all(abs(read[n] - norm(n_rows, counts[n], sum(counts.values()), sums[n], sum(sums.values())))
                    <= 1e-3 * max(abs(read[n]), 1e-30) for n in rows)]
    text = "normaliser " + ", ".join(f"row {n}: {read[n]:.6g}" for n in rows) + (
        f" ({' = '.join(found)})" if found else " (none of " + ", ".join(REDUCTIONS) + ")")
    return found, text


def _check_reduction(lab: Lab, gamma: Verdict, measured: dict[str, Any], w_hat: Tensor, judged: Tensor,
                     one_hot: bool) -> None:
    """The absolute size of the slot weights against the reduction the subject promises (describe()
    ["loss_reduction"], one of REDUCTIONS): a weighting with the right shape but another normaliser (a token count
    where the weights' sum is promised, the weights' sum where the count is, no division by the rows) moves every
    gradient by a batch-dependent factor, which the fitted weight ratios cannot see."""
    promised = lab.info.get("loss_reduction")
    if not one_hot or not judged.any():
        return  # soft targets make the read weights approximate (within V*min(q)): not judged
    total = w_hat[judged].sum().item()
    found, text = _identify_reduction(lab, measured, w_hat, judged)
    gamma.coverage["loss_reduction"] = (f"promised {promised or 'nothing'}; read: {text}; the slot weights sum to "
                                        f"{total:.6g} over {int(judged.sum())} trained slots")
    if promised not in REDUCTIONS or gamma.status == "mismatch":
        return
    if promised == "weighted_mean" and not found:
        found = ["weighted_mean"] if abs(total - 1.0) <= REDUCTION_RTOL else []  # needs no weighting model
        if found or not math.isfinite(total):
            return
        text = f"the slot weights sum to {total:.4g} over the {int(judged.sum())} trained slots, not 1"
    elif not found or promised in found:
        return  # a normaliser that matches no reduction (no weighting model fits it) is not judged
    gamma.status, gamma.reason, gamma.config_bound = "mismatch", "", []
    gamma.observed = (f"the loss is not normalised as the code promises ({promised}: {REDUCTIONS[promised][0]}): "
                      f"{text}" + (f"; {gamma.observed}" if gamma.observed else ""))
    gamma.fix = f"Divide the weighted sum of the slot losses as promised: {REDUCTIONS[promised][0]}."


def _form_residual(grad: Tensor, p: Tensor, q: Tensor, mask: Tensor) -> float:
    """Worst relative residual of grad = w (p - q) per slot, w fitted by least squares."""
    direction = p - q
    w = (grad * direction).sum(-1) / (direction * direction).sum(-1).clamp_min(1e-30)
    residual = (grad - w[..., None] * direction).norm(dim=-1) / grad.norm(dim=-1).clamp_min(1e-30)
    return residual[mask].max().item() if mask.any() else math.inf


def _check_alignment(lab: Lab, shift: Verdict, trained: Tensor, should: Tensor, optional: Tensor) -> None:
    """Slot 0's token and the loss mask's alignment are part of the shift: either breaks the pairing of a
    slot's input with its target."""
    wrong_tokens = lab.facts.get("slot0_tokens_wrong") or []
    valid = lab.batch.anchor_valid[..., None].expand_as(trained).clone()
    valid[..., 0] = False
    extra = (trained & ~should & ~optional & valid)
    lacking = (~trained & should)
    problems = []
    if wrong_tokens:
        n, a, token = wrong_tokens[0]
        offset = next((d for d in (1, -1, 2) if 0 <= a + d < lab.layout.seq_len
                       and int(lab.batch.input_ids[n, a + d]) == token), None)
        problems.append(f"slot 0 does not hold the anchor's token ({len(wrong_tokens)} blocks; e.g. row {n}, anchor {a}"
                        + (f": the token at p{offset:+d})" if offset is not None else ")"))
    if extra.any() and not lacking.any() and bool((trained | ~valid).all()):
        # Every slot of every valid block is trained: the loss mask is not applied per slot at all. The references
        # apply it at p+j, but DFLASH.md's shift rule is about the teacher's position, so this is neither claimed
        # nor flagged (unknown, saying so); a mask at the wrong offset leaves supervised slots untrained and is
        # flagged below.
        shift.coverage["slot_loss_mask"] = "not applied per slot"
        shift.not_exercised.append(f"the loss mask per slot: the loss trains every slot, {int(extra.sum())} of them "
                                   "with an unsupervised token at p+j (the references leave those out)")
    elif extra.any() or lacking.any():
        problems.append(f"the loss mask is misaligned: {int(extra.sum())} slots with an unsupervised token at p+j are "
                        f"trained, {int(lacking.sum())} supervised slots get no weight")
    if problems:
        shift.status = "mismatch"
        shift.observed = "; ".join(filter(None, [shift.observed, *problems]))
        shift.fix = shift.fix or "Slot 0 holds the token at the anchor; slot j's loss mask is the one of token p+j."


def _kind_verdict(lab: Lab, kind: str | None, form: float, self_labels: bool, decided: bool, source: Verdict,
                  measurement: str, measured: dict, common: dict[str, Any]) -> Verdict:
    configured, where = lab.configured_value("loss")
    verdict = Verdict(invariant="dflash.loss_kind", status="unknown", hypothesis="the loss pulls each slot toward the "
                      "target's distribution (one-hot argmax for CE, softmax for KL), with grad = w (softmax(z) - q)",
                      measurement=measurement, measured=measured,
                      expected=str(configured) if configured else " or ".join(lab.expectations.loss_kinds), **common)
    if self_labels:
        verdict.status = "mismatch"
        verdict.observed = "CE against the drafter's own argmax, not the target's (the labels move with its logits)"
        verdict.fix = "Take the CE labels from the teacher (the target's logits or the data), never the draft logits."
        return verdict
    measured_kind = kind if form < GRADIENT_FORM else ("other" if math.isfinite(form) else None)
    if measured_kind is None:
        verdict.reason = "the loss's gradient at random logits could not be read"
        return verdict
    if measured_kind == "other":
        verdict.status = "mismatch"
        verdict.observed = (f"neither CE nor KL: the gradient is not w (softmax(z) - q) for a fixed target (residual "
                            f"{form:.2g}; e.g. a loss on softmax(logits) or on scaled logits)")
        verdict.fix = "Apply cross-entropy (or KL) to the raw draft logits, against the teacher's argmax (or softmax)."
        return verdict
    if kind is None:
        verdict.reason = "the recovered targets are neither one-hot nor the teacher's softmax"
        return verdict
    if not decided and source.status != "mismatch":
        verdict.reason = source.reason
        return verdict
    verdict.observed = "ce (one-hot to the teacher's argmax)" if kind == "ce" else "kl (the teacher's soft distribution)"
    if configured is not None:
        wanted = "kl" if str(configured).lower().startswith("kl") else "ce" if str(configured).lower() == "ce" else str(configured)
        if wanted != kind:
            verdict.status = "mismatch"
            verdict.observed += f"; configured {configured} ({where})"
            return verdict
        if from_run_config(where):
            verdict.config_bound = ["loss"]
    verdict.status = "match" if kind in lab.expectations.loss_kinds else "mismatch"
    return verdict


def _slot0_verdict(lab: Lab, trained: Tensor, w_hat: Tensor, measurement: str, common: dict[str, Any]) -> Verdict:
    valid = lab.batch.anchor_valid
    verdict = Verdict(invariant="dflash.anchor_slot_untrained", status="unknown",
                      hypothesis="slot 0 (the anchor) gets loss weight 0", measurement=measurement,
                      expected="slot 0 weight 0", **common)
    w1 = w_hat[..., 1][valid & trained[..., 1]]
    if lab.block_size < 2 or w1.numel() == 0:
        verdict.reason = "slot 1 gets no weight: the slot weights cannot be read"
        return verdict
    slot0 = w_hat[..., 0][valid]
    verdict.measured = {"slot0_over_slot1": (slot0.max() / w1.mean()).item()}
    if not trained[..., 0][valid].any():
        verdict.status, verdict.observed = "match", "slot 0 gets no gradient in any block"
    else:
        verdict.status = "mismatch"
        verdict.observed = f"slot 0 weighs {(slot0.max() / w1.mean()).item():.3g} x slot 1"
        verdict.fix = "Give slot 0 (the anchor, an input) weight 0 in the loss."
    return verdict


def _weights(grad: Tensor, p: Tensor, q: Tensor) -> Tensor:
    """Least-squares w per slot in grad = w * (p - q)."""
    direction = p - q
    return (grad * direction).sum(-1) / (direction * direction).sum(-1).clamp_min(1e-30)


def dpace_weights(confidence: Tensor, mask: Tensor, alpha: float) -> Tensor:
    """speculators' D-PACE weights (losses/utils.py `dpace_loss_decay`) for per-slot confidences [*, B]."""
    smooth = torch.where(mask > 0, (1 - alpha) * confidence + alpha, torch.ones_like(confidence))
    prefix = torch.cumprod(smooth, -1)
    return torch.flip(torch.cumsum(torch.flip(prefix * mask, [-1]), -1), [-1]) * mask


def _profile(weights: Tensor, full: Tensor) -> Tensor | None:
    """Mean w_k / w_1 over blocks whose every slot 1..B-1 is trained ([B-1]); None without such a block."""
    if not full.any():
        return None
    chosen = weights[full]  # [M, B]
    return (chosen[:, 1:] / chosen[:, 1:2].clamp_min(1e-30)).mean(0)


def _profile_from_partial_blocks(weights: Tensor, trained: Tensor) -> Tensor | None:
    """w_k / w_1 for k = 1..B-1 where no block has every slot trained: each block's weights relative to its first
    trained slot f, rescaled to slot 1 under the exponential the ratios themselves fit (w_k / w_f =
    exp(-(k-f)/gamma)); None without a block of two trained slots. A weighting that is not exponential leaves a
    residual the caller's fit reports."""
    rel, usable = _relative(weights, trained)
    slots = torch.arange(weights.shape[-1], dtype=torch.float64).expand_as(rel)
    first = trained.double().argmax(-1, keepdim=True).expand_as(rel).double()
    steps = slots - first
    pick = usable & (steps > 0)
    if not pick.any():
        return None
    logs = torch.log(rel[pick].clamp_min(1e-300))
    dk = steps[pick]
    slope = (dk * logs).sum() / (dk * dk).sum()  # -1/gamma, least squares through the origin
    return torch.exp(slope * torch.arange(0, weights.shape[-1] - 1, dtype=torch.float64))


def _relative(weights: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each block's weights over its first trained slot, and the slots where that ratio says something
    (trained, in a block with at least two trained slots)."""
    first = mask.double().argmax(-1, keepdim=True)  # [N, A, 1]
    ref = weights.gather(-1, first).clamp_min(1e-30)
    usable = mask & (mask.sum(-1, keepdim=True) >= 2)
    return weights / ref, usable


def _model_error(model: Tensor, measured: Tensor, mask: Tensor) -> float:
    m, usable = _relative(model, mask)
    x, _ = _relative(measured, mask)
    if not usable.any():
        return math.inf
    return ((m - x).abs() / m.abs().clamp_min(1e-30))[usable].max().item()


def _identify_weighting(lab: Lab, runs: list[tuple[Tensor, Tensor]], q: Tensor, mask: Tensor,
                        full: Tensor) -> tuple[dict[str, Any], str]:
    """What the measured slot weights are: {"mode": none | fixed-exp | dpace | other, ...} and a description.
    A fixed decay is fitted on the blocks whose every slot is trained (or, where none is, as at B = 16 on short
    documents, on each block's weights relative to its first trained slot), D-PACE on every block's relative
    weights; both are checked on every block (those with unsupervised slots too: a weighting that sums over
    masked slots, or mixes slots of different blocks, shows there)."""
    b = lab.block_size
    trained = mask > 0
    drift = 0.0
    if len(runs) > 1:
        r0, usable = _relative(runs[0][1], trained)
        r1, _ = _relative(runs[1][1], trained)
        drift = (r1 - r0)[usable].abs().max().item() if usable.any() else 0.0
    profile = _profile(runs[0][1], full)
    if profile is None:
        profile = _profile_from_partial_blocks(runs[0][1], trained)
    if profile is None:
        return {"mode": None}, "no block has two trained slots: the slot weights cannot be read"
    if drift > DATA_DEPENDENT:
        best = (math.nan, math.inf)
        for step in range(1, 101):
            alpha = step / 100
            error = max(_model_error(dpace_weights((p * q).sum(-1), mask.double(), alpha), measured, trained)
                        for p, measured in runs)
            if error < best[1]:
                best = (alpha, error)
        if best[1] < WEIGHT_FIT:
            return {"mode": "dpace", "alpha": best[0], "drift": drift}, f"D-PACE weighting (alpha {best[0]:.2f})"
        return {"mode": "other", "drift": drift}, (f"data-dependent slot weights (they change by {drift:.2g} with the "
                                                   f"drafter's confidence) that are not D-PACE (best alpha "
                                                   f"{best[0]:.2f}: error {best[1]:.2g})")
    k = torch.arange(1, b, dtype=torch.float64) - 1  # k - 1
    logs = torch.log(profile.clamp_min(1e-300))
    slots = torch.arange(b, dtype=torch.float64)
    if logs.abs().max().item() < 1e-6:
        found, text = {"mode": "none", "drift": drift}, "no decay: every slot k >= 1 weighs the same (gamma = infinity)"
        model = torch.ones(b, dtype=torch.float64)
    else:
        gamma = -(k * k).sum().item() / (k * logs).sum().item()
        residual = (logs + k / gamma).abs().max().item()
        if gamma <= 0 or residual > EXP_FIT:
            return {"mode": "other", "drift": drift, "profile": profile.tolist()}, (
                f"slot weights {', '.join(f'{x:.3g}' for x in profile.tolist())} (relative to slot 1) follow no "
                f"exp(-(k-1)/gamma) (residual {residual:.3g} of log-weights)")
        found = {"mode": "fixed-exp", "gamma": gamma, "drift": drift}
        text = f"gamma {gamma:.4g} (weights exp(-(k-1)/{gamma:.4g}))"
        model = torch.exp(-(slots - 1).clamp(min=0) / gamma)
    error = _model_error(model.expand_as(runs[0][1]) * mask, runs[0][1], trained)
    if error > WEIGHT_FIT:
        return {"mode": "other", "drift": drift}, (f"{text} where every slot is trained, but not in blocks with "
                                                   f"unsupervised slots (error {error:.2g})")
    return found, text


def _same_weighting(configured: dict[str, Any], measured: dict[str, Any]) -> bool:
    mode = configured.get("mode")
    if mode != measured.get("mode"):
        return False
    if mode == "fixed-exp":
        return abs(measured["gamma"] - configured["gamma"]) <= GAMMA_RTOL * configured["gamma"]
    if mode == "dpace" and configured.get("alpha") is not None:
        return abs(measured["alpha"] - configured["alpha"]) <= 0.015
    return True


def _configured_weighting(lab: Lab) -> tuple[dict[str, Any] | None, str]:
    mode, source = lab.configured_value("weighting")
    if mode is None:
        return None, ""
    gamma, gamma_source = lab.configured_value("gamma")
    alpha, _ = lab.configured_value("dpace_alpha")
    found: dict[str, Any] = {"mode": mode}
    if mode == "fixed-exp":
        found["gamma"] = float(gamma)
        source = gamma_source or source
    if mode == "dpace":
        found["alpha"] = None if alpha is None else float(alpha)
    return found, source or ""


def _describe_weighting(w: dict[str, Any]) -> str:
    mode = w.get("mode")
    if mode == "fixed-exp":
        return f"exp(-(k-1)/gamma) with gamma {w['gamma']:g}"
    if mode == "dpace":
        return "D-PACE" + (f" (alpha {w['alpha']:g})" if w.get("alpha") is not None else "")
    if mode == "none":
        return "no decay"
    return str(mode)


def _gamma_verdict(lab: Lab, grad: Tensor, grad2: Tensor | None, p2: Tensor, q: Tensor, trained: Tensor,
                   common: dict[str, Any]) -> Verdict:
    b, v = lab.block_size, lab.target.vocab_size
    expect = lab.expectations
    accepted = {expect.gamma} if expect.gamma is not None else set()
    if b in expect.gamma_by_block_size:
        accepted.add(expect.gamma_by_block_size[b])
    configured, where = _configured_weighting(lab)
    verdict = Verdict(invariant="dflash.loss_decay_gamma", status="unknown",
                      hypothesis="the slot weights are the configured weighting: exp(-(k-1)/gamma), D-PACE or none",
                      measurement="", expected=(f"{_describe_weighting(configured)} ({where})" if configured else
                                                f"gamma {' or '.join(f'{g:g}' for g in sorted(accepted))} at B={b}"),
                      **common)
    if configured:
        verdict.coverage["loss_weighting"] = f"{_describe_weighting(configured)} ({where})"
    if b < 3:
        verdict.reason = "fewer than two trained slots per block: no decay to fit"
        return verdict
    mask = trained.double()
    full = trained[..., 1:].all(-1) & lab.batch.anchor_valid  # blocks with every slot 1..B-1 trained
    runs = [(torch.full_like(grad, 1.0 / v), torch.where(trained, _weights(grad, torch.full_like(grad, 1.0 / v), q), 0.0))]
    if grad2 is not None:
        runs.append((p2, torch.where(trained, _weights(grad2, p2, q), 0.0)))
    measured, text = _identify_weighting(lab, runs, q, mask, full)
    profile = _profile(runs[0][1], full)
    verdict.measured = {**measured, "ratios": profile.tolist() if profile is not None else None}
    if measured.get("mode") == "fixed-exp":
        verdict.measured["gamma"] = measured["gamma"]
    elif measured.get("mode") == "none":
        verdict.measured["gamma"] = "inf"
    verdict.measurement = ("slot weights w_k/w_1, k = 1..{}: {}; change with the drafter's confidence: {:.2g}".format(
        b - 1, ", ".join(f"{r:.4g}" for r in (profile.tolist() if profile is not None else [])),
        measured.get("drift", 0.0)))
    if measured.get("mode") is None:
        verdict.reason = text
        return verdict
    verdict.observed = text
    if configured is not None:
        if not _same_weighting(configured, measured):
            verdict.status = "mismatch"
            verdict.observed = f"configured {_describe_weighting(configured)} ({where}), the loss applies: {text}"
            verdict.fix = "Pass the configured loss weighting (gamma / D-PACE) through to the loss."
            return verdict
        if from_run_config(where):
            verdict.status, verdict.config_bound = "match", ["loss_decay_gamma"]
            verdict.observed = f"the loss applies the configured {_describe_weighting(configured)} ({where})"
            return verdict
        if "probe choice" in where:
            verdict.reason = (f"the code applies a configured weighting as configured ({text}, with "
                              f"{_describe_weighting(configured)} set by the probe); which weighting the run used is "
                              "its config's, and none was given")
            default = lab.configured_value("default_weighting")[0]
            if default:
                verdict.reason += f" (the code's default: {default})"
            return verdict
        # the subject's own default: judged against the reference like any value
    if measured["mode"] == "dpace":
        verdict.status = "match"
        verdict.observed = text + ": data-dependent, so gamma does not apply; it is speculators' DFlash training default"
    elif measured["mode"] == "none" and configured is not None:
        verdict.reason = (f"the default is no decay ({where}); the run's gamma is set by its config, and none was given")
    elif measured["mode"] == "other":
        verdict.status = "mismatch"
        verdict.fix = f"Weigh slot k >= 1 by exp(-(k-1)/{min(accepted) if accepted else 4:g})."
    elif not accepted:
        verdict.reason = "no expected gamma to compare with"
    elif measured["mode"] == "fixed-exp" and any(abs(measured["gamma"] - g) <= GAMMA_RTOL * g for g in accepted):
        verdict.status = "match"
    else:
        verdict.status = "mismatch"
        verdict.fix = f"Weigh slot k >= 1 by exp(-(k-1)/{min(accepted):g})."
    return verdict
