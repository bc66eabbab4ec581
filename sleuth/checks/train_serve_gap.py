"""`dflash.train_serve_gap`: does the training objective's acceptance show up when the drafter serves?

The run records both numbers on the same held-out eval sequences at the same step (run-directory
contract: eval.json `tau`, `tau_per_prompt`, `teacher_forced.acceptance`,
`teacher_forced.acceptance_per_prompt`; eval rows of metrics.jsonl `tau`, `tau_per_prompt`,
`tf_acceptance`, `tf_acceptance_per_prompt`). A drafter trained on the serving semantics reaches about
the teacher-forced acceptance when it serves; real tau falling short of it beyond the per-prompt noise
means the training semantics differ from serving somewhere (SpecForge #533: 98% in training, 10% in
vLLM; z-lab #41: accuracy 0.99, acceptance 0.12). The finding names the invariants that can open such a
gap and which of them this diagnosis found broken.

Noise, block by block: with serving semantics the training objective's prefix at a verify step IS the real
acceptance, so the two differ only where an argmax ties, either way. Besides the per-prompt spread, a
one-sided sign test over the differing steps (eval.json `teacher_forced.verify_steps_above` / `_below`)
tells a training objective that scores more than serving accepts from ties. At temperature 0 the decoded
tokens are what serving verifies against, so `label_agreement` (training labels = decoded tokens) below 99%
measures directly that training scores against other labels, and says which side of the contract (labels
or the drafter's inputs) the explanation is on.

The serving side comes first: both numbers assume the eval decoded the target's own greedy continuation. If
it did not (eval.json `lossless` false at T=0, beyond argmax ties), tau and the served tokens belong to a
decoder that is off, and a low label agreement measures that decoder, not training's labels. The known way
to get there: a target with a recurrent state (linear attention, state-space, lightning attention layers:
Qwen3-Next / Qwen3.5 / Qwen3.6, Kimi Linear, MiniMax, Granite 4 hybrid, Mamba ...) decoded with a plain
KV-cache crop after a rejected block, which leaves the rejected tokens in the state (transformers: such a
cache is not croppable by itself). eval.json `target_rollback` says how the eval rolled back: `state_history` (the
cache's own state after each verified position, transformers >= 5.25) and `state_replay` (the saved state and a
replay of the kept tokens) are both exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from sleuth.checks.context import ContractContext, read_json, text_config
from sleuth.findings import Evidence, Finding, Fix

ID = "dflash.train_serve_gap"
# The invariants whose violation makes training score something serving does not reward.
EXPLAINS_GAP = (
    "dflash.context_excludes_anchor",
    "dflash.target_logits_source",
    "dflash.target_shift",
    "dflash.blocks_isolated",
    "dflash.block_position_ids",
    "dflash.target_forward_fidelity",
    "dflash.mask_token_distinct",
    "dflash.rope_served_as_trained",
    "dflash.sliding_window_served",
    "dflash.target_tables_resolve",
    "dflash.hidden_state_capture",
    "dflash.chat_template_consistency",
    "dflash.export_contract",
)
NOISE_SIGMAS = 3.0  # a gap must exceed 3 standard errors of the paired per-prompt difference
# ... or, block by block, be as unlikely under the tie-only noise as a 3-sigma one-sided event.
SIGN_TEST_P = NormalDist().cdf(-NOISE_SIGMAS)
# What a slot is scored against (training's labels) vs what the drafter is given (block, context, positions):
# the teacher-forced labels' agreement with the served tokens tells which side a gap comes from.
LABEL_SIDE = (
    "dflash.target_logits_source",
    "dflash.target_shift",
    "dflash.target_forward_fidelity",
    "dflash.hidden_state_capture",
)
INPUT_SIDE = tuple(i for i in EXPLAINS_GAP if i not in LABEL_SIDE) + ("dflash.hidden_state_capture",)
# At temperature 0 training's labels are the served tokens exactly, up to argmax ties between the full
# teacher-forced forward and serving's incremental one (float32: none measured; bf16 flips near-ties):
# below 99% of the slots they are other labels, whatever the drafter has learned of them so far.
LABEL_AGREEMENT_FLOOR = 0.99
MIN_LABEL_SLOTS = 100  # fewer labelled slots say too little about a 1% rate
# Block by block at serving's anchors, a drafter trained on serving semantics scores exactly its real
# acceptance (same block, context and labels); only float ties in argmax can differ. A floor of 0.02
# tokens per step keeps a stray tie from becoming a finding when every prompt agrees (se 0).
MIN_SHORTFALL_AT_VERIFY = 0.02
# The expected acceptance from per-slot accuracies over all positions differs systematically from the
# realised one (slots are not independent; serving visits only some anchors): the gap must also exceed a
# tenth of the predicted gain over plain decoding.
MIN_RELATIVE_SHORTFALL = 0.10
PROBE_HINT = "run the probes (`sleuth diagnose --probe`) to localise it"
# Layer kinds that carry a recurrent state across positions (transformers' layer_types names), and families
# whose config.json names none of them yet keep such a state.
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "mamba", "mamba2", "hybrid", "hybrid_sliding", "recurrent", "rwkv"})
RECURRENT_MODEL_TYPES = frozenset({
    "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "kimi_linear", "minimax",
    "granitemoehybrid", "falcon_h1", "falcon_mamba", "mamba", "mamba2", "jamba", "bamba", "zamba", "zamba2",
    "nemotron_h", "rwkv", "recurrent_gemma", "xlstm",
})
# eval.json `target_rollback` values that restore a recurrent state exactly (trainer/eval/target_cache.py).
EXACT_STATE_ROLLBACKS = frozenset({"state_history", "state_replay"})
STATE_FIX = ("evaluate with a decoder that restores a recurrent state after a rejected block (`trainer eval` "
             "puts back the state the cache recorded after each verified position, or saves the state before each "
             "verify pass and replays the committed tokens; its eval.json says `target_rollback: state_history` or "
             "`state_replay`), then compare again")
DECODER_FIX = ("find where the eval's speculative output leaves greedy decoding (in float32 it must not: the verify "
               "pass, the cache rollback, the stop rule), then compare again")


@dataclass
class _Measurement:
    step: int | None
    tau: float
    predicted: float
    tau_per_prompt: list[Any]
    predicted_per_prompt: list[Any]
    location: str
    at_verify: bool  # block by block at serving's anchors (no systematic difference) or expected from acc_k
    steps_above: int | None = None  # compared verify steps where training's prefix is longer / shorter
    steps_below: int | None = None
    label_agreement: float | None = None  # training labels == served tokens, at temperature 0 only
    label_slots: int | None = None


def _from_fields(holder: dict[str, Any], step: Any, location: str, names: dict[str, str]) -> _Measurement | None:
    """names: the keys of tau, predicted, their per-prompt lists, and (optional) the step counts and the
    label agreement in `holder`, for either comparison."""
    tau, predicted = _number(holder.get(names["tau"])), _number(holder.get(names["predicted"]))
    if tau is None or predicted is None:
        return None
    above, below = (_count(holder.get(names.get(k, ""))) for k in ("above", "below"))
    greedy = _number(holder.get("temperature", 0.0)) == 0.0  # eval rows are greedy; eval.json says its T
    return _Measurement(
        steps_above=above if below is not None else None,
        steps_below=below if above is not None else None,
        label_agreement=_number(holder.get(names.get("labels", ""))) if greedy else None,
        label_slots=_count(holder.get(names.get("label_slots", ""))),
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        tau=tau, predicted=predicted,
        tau_per_prompt=list(holder.get(names["tau_per_prompt"]) or []),
        predicted_per_prompt=list(holder.get(names["predicted_per_prompt"]) or []),
        location=f"{location}: {names['tau']}, {names['predicted']}",
        at_verify=names["predicted"].endswith("at_verify"),
    )


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _latest_measurement(ctx: ContractContext) -> _Measurement | None:
    """The newest step that has both numbers; at a step, the block-by-block comparison when recorded."""
    run = ctx.run
    if run is None:
        return None
    candidates: list[_Measurement] = []
    report = run.eval_report or {}
    teacher_forced = report.get("teacher_forced")
    if isinstance(teacher_forced, dict):
        where = str(run.path / "eval.json")
        merged = {**teacher_forced, "tau_all": report.get("tau"), "tau_per_prompt_all": report.get("tau_per_prompt"),
                  "temperature": report.get("temperature", 0.0)}
        for names in (
            {"tau": "tau_at_verify", "predicted": "at_verify", "tau_per_prompt": "tau_at_verify_per_prompt",
             "predicted_per_prompt": "at_verify_per_prompt", "above": "verify_steps_above",
             "below": "verify_steps_below", "labels": "label_agreement", "label_slots": "label_slots"},
            {"tau": "tau_all", "predicted": "acceptance", "tau_per_prompt": "tau_per_prompt_all",
             "predicted_per_prompt": "acceptance_per_prompt", "labels": "label_agreement",
             "label_slots": "label_slots"},
        ):
            found = _from_fields(merged, report.get("step"), where + " teacher_forced", names)
            if found is not None:
                candidates.append(found)
                break
    for row in reversed(run.metrics):
        where = f"{run.path / 'metrics.jsonl'} step {row.get('step')}"
        found = _from_fields(row, row.get("step"), where, {
            "tau": "tf_tau_at_verify", "predicted": "tf_at_verify", "tau_per_prompt": "tf_tau_at_verify_per_prompt",
            "predicted_per_prompt": "tf_at_verify_per_prompt", "above": "tf_verify_steps_above",
            "below": "tf_verify_steps_below", "labels": "tf_label_agreement",
            "label_slots": "tf_label_slots"}) or _from_fields(row, row.get("step"), where, {
            "tau": "tau", "predicted": "tf_acceptance", "tau_per_prompt": "tau_per_prompt",
            "predicted_per_prompt": "tf_acceptance_per_prompt", "labels": "tf_label_agreement",
            "label_slots": "tf_label_slots"})
        if found is not None:
            candidates.append(found)
            break
    if not candidates:
        return None
    return max(candidates, key=lambda m: m.step if m.step is not None else -1)


def paired_standard_error(predicted: list[Any], real: list[Any]) -> tuple[float | None, int]:
    """Standard error of the mean per-prompt difference predicted - real, over prompts with both."""
    diffs = [p - r for p, r in ((_number(p), _number(r)) for p, r in zip(predicted, real))
             if p is not None and r is not None]
    n = len(diffs)
    if n < 2:
        return None, n
    mean = sum(diffs) / n
    variance = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    return math.sqrt(variance / n), n


def sign_test_p(above: int, below: int) -> float:
    """One-sided P(at least `above` of the differing steps fall above) when each differs either way with
    probability 1/2, as an argmax tie does."""
    n = above + below
    if n == 0:
        return 1.0
    return sum(math.comb(n, k) for k in range(above, n + 1)) / 2**n


@dataclass
class _ServingSide:
    off: bool  # established: the eval's decoding is not the target's greedy decoding beyond argmax ties
    cause: str  # what is known about it ('' when nothing is)
    evidence: list[Evidence]
    unverified: bool = False  # a recurrent target decoded without a recorded rollback, losslessness unchecked
    remedy: str = DECODER_FIX


def _recurrent_target(ctx: ContractContext) -> str | None:
    """'kimi_linear (linear_attention layers)' when the target's config.json describes a recurrent state."""
    target_dir, _ = ctx.resolve_target_dir()
    config = read_json(target_dir / "config.json") if target_dir is not None else None
    if config is None:
        return None
    text = text_config(config)
    model_type = text.get("model_type") or config.get("model_type")
    kinds = sorted({k for k in text.get("layer_types") or [] if isinstance(k, str)} & RECURRENT_LAYER_TYPES)
    if kinds:
        return f"{model_type or 'the target'} ({', '.join(kinds)} layers)"
    if model_type in RECURRENT_MODEL_TYPES or config.get("model_type") in RECURRENT_MODEL_TYPES:
        return f"{model_type} (recurrent-state layers)"
    return None


def _serving_side(ctx: ContractContext, m: _Measurement) -> _ServingSide:
    """Whether the eval's own decoding is the target's (eval.json lossless, target_rollback and the target's
    layer kinds), before anything is blamed on training."""
    run = ctx.run
    report = (run.eval_report if run is not None else None) or {}
    where = str(run.path / "eval.json") if run is not None else "eval.json"
    lossless = report.get("lossless")
    rollback = report.get("target_rollback")
    recurrent = _recurrent_target(ctx)
    mismatched = report.get("lossless_mismatch_prompts")
    prompts = len(report.get("tau_per_prompt") or []) or None
    unrolled = recurrent is not None and rollback not in EXACT_STATE_ROLLBACKS
    rolled = ("records no state rollback (no target_rollback: a decoder that crops the cache)" if rollback is None
              else f"records target_rollback {rollback!r}")
    state = (f"the target {recurrent} keeps a recurrent state that no cache crop can roll back, and the eval "
             f"{rolled}") if unrolled else ""
    evidence = []
    if lossless is False:
        count = f"{len(mismatched)} of {prompts}" if isinstance(mismatched, list) and prompts else "some"
        evidence.append(Evidence(kind="metrics", location=f"{where}: lossless", value=f"false ({count} prompts)"))
        # Argmax ties (bf16) flip a token here and there, and greedy decoding resumes right after: the labels
        # still equal the served tokens at >= 99% of the slots. A decoder that is off drifts for good.
        ties = m.label_agreement is not None and m.label_agreement >= LABEL_AGREEMENT_FLOOR
        if not ties:
            cause = (f"the eval's speculative decoding is not the target's greedy decoding (eval.json lossless false: "
                     f"{count} prompts differ at temperature 0)")
            if not state:
                return _ServingSide(True, cause, evidence)
            cause += f": {state}, so every step after a rejected block decodes from a state the target never has"
            return _ServingSide(True, cause, evidence, remedy=STATE_FIX)
        return _ServingSide(False, f"eval.json lossless false at {count} prompts, but training's labels equal the "
                                   f"served tokens at {m.label_agreement:.1%}: argmax ties, not a decoder that is off",
                            evidence)
    if state and lossless is None:
        return _ServingSide(False, f"{state}; eval.json does not say whether the decoding was lossless, so the "
                                   "served side is unverified", evidence, unverified=True, remedy=STATE_FIX)
    return _ServingSide(False, "", evidence)


def check_train_serve_gap(ctx: ContractContext) -> Finding:
    run = ctx.run
    if run is None:
        return ctx.finding(ID, "unknown", reason="no run directory: the gap needs a run's eval numbers")
    measurement = _latest_measurement(ctx)
    if measurement is None:
        streaks = [r for r in run.metrics if _number(r.get("tau")) is not None]
        hint = ""
        if streaks and _number(streaks[-1].get("eal")) is not None:
            row = streaks[-1]
            hint = (f"; the training-batch eal + 1 at step {row.get('step')} is {row['eal'] + 1:.2f} against "
                    f"tau {row['tau']:.2f}, but those are different data with no noise estimate")
        return ctx.finding(
            ID, "unknown",
            reason="the run records no teacher-forced acceptance next to its tau (eval.json "
            "teacher_forced / metrics tf_acceptance), so the two cannot be compared on the same data" + hint,
        )
    m = measurement
    serving = _serving_side(ctx, m)
    se, paired = paired_standard_error(m.predicted_per_prompt, m.tau_per_prompt)
    gap = m.predicted - m.tau
    at = f"at step {m.step}" if m.step is not None else "at the last eval"
    evidence = [Evidence(kind="metrics", location=m.location, value=f"tau {m.tau:.3f}, teacher-forced {m.predicted:.3f}")]
    observed = f"real tau {m.tau:.2f} vs teacher-forced acceptance {m.predicted:.2f} {at} (gap {gap:+.2f}"
    observed += f", noise se {se:.3f} over {paired} prompts)" if se is not None else ", no per-prompt values)"
    expected = ("real tau within noise of the teacher-forced acceptance on the same eval sequences, and (greedy "
                "eval) training's labels the served tokens")
    if se is None:
        reason = f"fewer than 2 prompts carry both per-prompt values ({paired}): no noise estimate"
        return ctx.finding(ID, "unknown", expected=expected, observed=observed, evidence=evidence + serving.evidence,
                           reason=reason + (f"; serving side: {serving.cause}" if serving.cause else ""))
    floor = MIN_SHORTFALL_AT_VERIFY if m.at_verify else MIN_RELATIVE_SHORTFALL * max(m.predicted - 1.0, 0.0)
    floor_text = f"{MIN_SHORTFALL_AT_VERIFY:g} tokens" if m.at_verify else f"{MIN_RELATIVE_SHORTFALL:.0%} of the predicted gain"
    threshold = max(NOISE_SIGMAS * se, floor)
    compared = ("block by block at the anchors serving used" if m.at_verify
                else "expected acceptance from per-slot accuracy over all generated positions")
    observed += f"; compared {compared}"
    # Block by block, serving semantics give the same prefix at every step; a step differs only on an argmax
    # tie, which goes either way. So beside the spread over prompts (how big the gap is elsewhere), the sign
    # of the differing steps tests whether training scores something serving does not reward at all.
    sign_p = None
    if m.at_verify and m.steps_above is not None and m.steps_below is not None:
        sign_p = sign_test_p(m.steps_above, m.steps_below)
        observed += (f"; training's prefix is longer at {m.steps_above} and shorter at {m.steps_below} of the "
                     f"verify steps (one-sided sign test p {sign_p:.1e})")
    if m.label_agreement is not None and m.label_slots is not None:
        observed += f"; training's labels are the served tokens at {m.label_agreement:.1%} of {m.label_slots} slots"
    by_spread = gap > threshold
    by_sign = sign_p is not None and gap > floor and sign_p <= SIGN_TEST_P
    # Other labels than serving's are a gap in the making: measured directly, before the drafter has
    # learned enough of them for acceptance to show it.
    by_labels = (m.label_agreement is not None and m.label_agreement < LABEL_AGREEMENT_FLOOR
                 and (m.label_slots or 0) >= MIN_LABEL_SLOTS)
    broken = [f for f in ctx.findings if f.id in EXPLAINS_GAP and f.status == "mismatch"]
    unknown = [f.id for f in ctx.findings if f.id in EXPLAINS_GAP and f.status == "unknown"]
    notes = [f"invariants that can open a train-serve gap: {', '.join(EXPLAINS_GAP)}"]
    if serving.cause:
        notes.append(f"serving side: {serving.cause}")
    if serving.off:
        return _serving_side_finding(ctx, m, serving, by_spread or by_sign or by_labels, expected, observed,
                                     evidence, broken, notes)
    side = _side(m)
    if side is not None:
        notes.append(side[1])
    if not (by_spread or by_sign or by_labels):
        if gap < -threshold and not m.at_verify:
            notes.append("real tau is above the teacher-forced prediction: acceptance is not independent across "
                         "slots here (long runs of correct drafts), which the product of per-slot accuracies misses")
        reason = f"the shortfall {gap:+.3f} is within max({NOISE_SIGMAS:g} x se, {floor_text}) = {threshold:.3f}"
        if sign_p is not None:
            reason += f" and the differing steps are no more one-sided than argmax ties (p {sign_p:.2g})"
        return ctx.finding(ID, "match", expected=expected, observed=observed, evidence=evidence, confidence=0.8,
                           reason=reason, notes=notes)
    if by_spread or by_sign:
        beyond = (f"{_in_se(gap, se)}" if by_spread else
                  f"{_in_se(gap, se)} over prompts, but one-sided at the verify steps: sign test p {sign_p:.1e}")
        shortfall = f"real tau falls short of what training measures by {gap:.2f} ({beyond})"
    else:
        shortfall = (f"training scores against other labels than serving verifies: they equal the served tokens "
                     f"at {m.label_agreement:.1%} of {m.label_slots} labelled slots (greedy eval; serving's labels "
                     f"give 100%); real tau is short by only {gap:+.2f} so far (within noise: the drafter has not "
                     f"learned much of those labels yet), a gap that opens as it does")
    # Broken invariants on the side the measurement points at explain the gap; the others are listed after.
    fitting = [f for f in broken if side is None or f.id in side[0]]
    others = [f for f in broken if f not in fitting]
    if fitting:
        explanation = ", ".join(f.id for f in fitting)
        reason = f"{shortfall}; explained by the broken invariant(s) this diagnosis found: {explanation}"
        if others:
            reason += f" (also broken, on the other side of the measurement: {', '.join(f.id for f in others)})"
        evidence += [e for f in fitting for e in f.evidence[:1]]
    else:
        explanation = None
        reason = f"{shortfall}, and no finding of this diagnosis explains it"
        if others:
            reason += (f" (broken, but not where the measurement points: {', '.join(f.id for f in others)})")
        reason += f"; {PROBE_HINT}"
        if unknown:
            reason += f" (and settle the unknown ones: {', '.join(unknown)})"
    if serving.unverified:  # the first suspect, ahead of anything on the training side
        reason += f"; but check the serving side first: {serving.cause}"
    notes.insert(0, f"explanation found: {explanation}" if explanation else "explanation found: none")
    return ctx.finding(ID, "mismatch", expected=expected, observed=observed, evidence=evidence,
                       confidence=0.85, reason=reason, notes=notes)


def _serving_side_finding(ctx: ContractContext, m: _Measurement, serving: _ServingSide, gap_shows: bool,
                          expected: str, observed: str, evidence: list[Evidence], broken: list[Finding],
                          notes: list[str]) -> Finding:
    """The eval's decoding is off: its tau and served tokens are not the target's, so neither the gap nor the
    label agreement says anything about training until it is fixed."""
    evidence = evidence + serving.evidence
    measured = ""
    if m.label_agreement is not None and m.label_slots is not None:
        measured = (f"; the label agreement ({m.label_agreement:.1%} of {m.label_slots} slots) compares training's "
                    "labels with that decoder's tokens, so it does not implicate the labels")
    also = f" (also broken in this diagnosis: {', '.join(f.id for f in broken)})" if broken else ""
    fix = Fix(code_hint=serving.remedy, applicability="safe")
    if not gap_shows:
        return ctx.finding(ID, "unknown", expected=expected, observed=observed, evidence=evidence, notes=notes,
                           reason=f"the served side is off before training can be judged: {serving.cause}{measured}; "
                           f"{serving.remedy}{also}", fix=fix)
    notes.insert(0, "explanation found: the serving side (the eval's decoding is not the target's)")
    return ctx.finding(ID, "mismatch", expected=expected, observed=observed, evidence=evidence, confidence=0.85,
                       reason=f"the served side is off, before training: {serving.cause}{measured}; "
                       f"{serving.remedy}{also}", notes=notes, fix=fix)


def _side(m: _Measurement) -> tuple[tuple[str, ...], str] | None:
    """Which invariants the label agreement implicates, and the note that says why (None: not measured)."""
    if m.label_agreement is None or (m.label_slots or 0) < MIN_LABEL_SLOTS:
        return None
    share = f"{m.label_agreement:.1%}"
    if m.label_agreement < LABEL_AGREEMENT_FLOOR:
        return LABEL_SIDE, (f"training's labels equal the served tokens at {share} of the slots (greedy eval: "
                            f"serving's labels would give 100%): training scores against other labels, so the "
                            f"gap lies in what a slot is scored against ({', '.join(LABEL_SIDE)})")
    return INPUT_SIDE, (f"training's labels equal the served tokens at {share} of the slots: the labels are "
                        f"serving's, so a gap would lie in what the drafter is given ({', '.join(INPUT_SIDE)})")


def _in_se(gap: float, se: float) -> str:
    return f"{gap / se:.1f} se" if se > 0 else "every prompt agrees on it"
