"""The observation (observer.py's JSON, from an untrusted process) -> verdicts and what the report says of it.

Torch-free. The rule: `match` only for what the observed step exercised, with the evidence saying so; what it
did not exercise is `unknown: not exercised by the observed step`; a link the observer could not follow says so.
Every value read from the observation is type-checked: a malformed one is `unknown`, never a crash.
"""

from __future__ import annotations

import math
from typing import Any

from sleuth.observe.judge_attention import ATTENTION_INVARIANTS, judge_attention
from sleuth.observe.optimization_judge import describe_optimization, judge_optimization
from sleuth.oracle import accepted_gammas, slot_weight, target_layer_ids
from sleuth.probes.answer import safe_text
from sleuth.probes.verdict import Expectations, Verdict

EXPERIMENT = "observed-step"
NOT_EXERCISED = "not exercised by the observed step"
# Invariants the observation decides (each gets a verdict, unknown where the step did not exercise it).
OBSERVED_INVARIANTS = ("dflash.target_layer_ids", "dflash.fc_input_layers", "dflash.frozen_embed_head",
                       "dflash.loss_decay_gamma", "dflash.anchor_slot_untrained", "dflash.target_shift",
                       "dflash.target_logits_source") + ATTENTION_INVARIANTS
SHIFTS = (0, 1, 2)  # label of slot j = the teacher's top-1 at anchor + j - shift; the reference's shift is 1
PATTERN_TOLERANCE = 1e-3
MAX_BLOCK = 128


def _text(value: Any, limit: int = 300) -> str:
    return safe_text(str(value), limit=limit)


def _verdict(invariant: str, status: str, *, hypothesis: str, measurement: str = "", observed: str = "",
             expected: str = "", reason: str = "", fix: str = "", coverage: dict[str, Any] | None = None) -> Verdict:
    return Verdict(invariant=invariant, status=status, experiment=EXPERIMENT, hypothesis=hypothesis, perturbed="nothing: "
                   "the run's own step, observed", measurement=measurement, threshold="", observed=observed,
                   expected=expected, reason=reason, fix=fix, coverage=coverage or {})


def _unknown(invariant: str, reason: str) -> Verdict:
    return _verdict(invariant, "unknown", hypothesis="", reason=reason)


def judge(observation: dict[str, Any], expectations: Expectations) -> tuple[list[Verdict], list[str]]:
    """Verdicts for OBSERVED_INVARIANTS, and the report's lines on what was observed."""
    notes = describe(observation)
    verdicts: list[Verdict] = []
    for part in (_layers, _frozen, _weights):
        try:
            verdicts += part(observation, expectations)
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as exc:
            invariants = {_layers: OBSERVED_INVARIANTS[:2], _frozen: OBSERVED_INVARIANTS[2:3],
                          _weights: OBSERVED_INVARIANTS[3:7]}[part]
            verdicts += [_unknown(i, f"the observation is malformed ({type(exc).__name__})") for i in invariants]
    verdicts += judge_optimization(observation)  # optimizer groups, the schedule's horizon, clipping and resume
    attention, attention_notes = judge_attention(observation)
    return verdicts + attention, notes + attention_notes + describe_optimization(observation)


# --- target layers ------------------------------------------------------------------------------------------


def _layers(observation: dict[str, Any], _expectations: Expectations) -> list[Verdict]:
    ids = OBSERVED_INVARIANTS[:2]
    gathered = [g for g in observation.get("features") or [] if isinstance(g, dict) and g.get("reached_backward")]
    if not gathered:
        seen = [g for g in observation.get("features") or [] if isinstance(g, dict)]
        if seen:
            last = seen[-1]
            taken = [c.get("layer", c.get("module")) for c in last.get("chunks") or [] if isinstance(c, dict)]
            why = (f"{NOT_EXERCISED}: the target features gathered at {_text(last.get('site'))} (layers "
                   f"{_text(taken)}) never reached the loss's backward: transformed further under no_grad, detached, "
                   "or copied before the drafter read them (link not followed)")
        else:
            why = (f"{NOT_EXERCISED}: no concatenation of target layer outputs reached the loss (features read from "
                   "a cache, precomputed in another process, or gathered without torch.cat/stack: link not followed)")
        return [_unknown(i, why) for i in ids]
    features = gathered[-1]
    chunks = [c for c in features["chunks"] if isinstance(c, dict)]
    layers: list[int] = []
    normed = False
    for chunk in chunks:
        if isinstance(chunk.get("layer"), int):
            layers.append(int(chunk["layer"]))
        elif chunk.get("embeddings"):
            layers.append(-1)  # HF hidden_states[0]
        elif chunk.get("after_last_layer") and isinstance(chunk.get("layers"), int):
            layers.append(int(chunk["layers"]) - 1)  # HF hidden_states[L]: the last layer's output after the norm
            normed = True
        else:
            why = (f"the features gathered at {_text(features.get('site'))} hold the output of "
                   f"{_text(chunk.get('module'))}, which is not a layer of a layer stack: link not followed")
            return [_unknown(i, why) for i in ids]
    depth = max(int(c.get("layers") or 0) for c in chunks)
    reached = [layer for layer, c in zip(layers, chunks) if float(c.get("grad_abs_sum") or 0.0) > 0.0]
    unread = [layer for layer in layers if layer not in reached]
    site = _text(features.get("site"))
    stack = _text(next((c.get("stack") for c in chunks if c.get("stack")), "?"))
    coverage = {"features": f"{features.get('kind')} at {site}, shape {features.get('shape')}",
                "target_stack": f"{stack} ({depth} layers)", "layers_gathered": layers, "layers_reaching_loss": reached}
    measurement = ("gradient of the observed step's loss at each gathered block: "
                   + ", ".join(f"layer {layer}: {_num(c.get('grad_abs_sum'))}" for layer, c in zip(layers, chunks)))
    verdicts: list[Verdict] = []
    everything = len(set(layers)) >= depth > 0
    if everything:
        verdicts.append(_unknown(ids[1], f"{NOT_EXERCISED} as a selection: the run gathers every layer of {stack} "
                                 f"at {site} and selects afterwards (by indexing, which is not observed)"))
        chosen = reached
    elif unread:
        verdicts.append(_verdict(ids[1], "mismatch", hypothesis="every target layer the run gathers reaches fc and the "
                                 "loss", measurement=measurement,
                                 observed=f"layers {unread} of the gathered {layers} never reach the loss (gradient 0); "
                                 f"fc reads {reached}", expected=f"fc reads all {len(layers)} gathered layers",
                                 fix=f"concatenate all {len(layers)} gathered layers into fc's input "
                                 f"(nn.Linear({len(layers)}*H, H)) at the drafter's fc", coverage=coverage))
        chosen = layers
    else:
        verdicts.append(_all_gathered_reach(ids[1], observation, layers, depth, measurement, coverage))
        chosen = layers
    if not chosen or depth < 4:
        verdicts.append(_unknown(ids[0], f"{NOT_EXERCISED}: the layers that reach the loss ({chosen}) or the target "
                                 f"depth ({depth}) cannot be judged against the layer rule"))
        return verdicts
    rule = target_layer_ids(depth, len(chosen))
    status = "match" if sorted(chosen) == rule else "mismatch"
    observed = f"{chosen} of a {depth}-layer target (id i = output of decoder layer i)" + (
        f"; layer {depth - 1} read after the target's final norm" if normed else "")
    verdicts.append(_verdict(ids[0], status, hypothesis="the drafter reads the reference's layers", measurement=measurement,
                             observed=observed, expected=f"{rule} (evenly from 1 to L-3)",
                             fix="" if status == "match" else f"read decoder layers {rule} (HF hidden_states[i + 1])",
                             coverage=coverage))
    return verdicts


def _all_gathered_reach(invariant: str, observation: dict[str, Any], layers: list[int], depth: int,
                        measurement: str, coverage: dict[str, Any]) -> Verdict:
    """Every gathered layer reaches the loss; that is all k the run selected only where the selection is seen.

    The step shows what was concatenated, not what the run meant to concatenate: a selection sliced before the
    gathering (`ids[:-1]`) leaves every gathered layer reaching the loss. The selection is seen where the run's
    command or config names it (its count must be the gathered count), or where the gathered layers are the
    reference's whole selection for their count (a slice of one is not)."""
    hypothesis = "fc reads every target layer the run selects"
    declared = (observation.get("configured") or {}).get("layer_ids")
    observed = f"all {len(layers)} gathered layers {layers} reach the loss"
    if isinstance(declared, dict) and isinstance(declared.get("value"), list):
        named = declared["value"]
        where = f"`{declared.get('key')}` in {declared.get('source')}"
        if len(named) == len(layers):
            return _verdict(invariant, "match", hypothesis=hypothesis, measurement=measurement,
                            observed=f"{observed}; the run selects {len(named)} ({where}: {named})",
                            expected="fc over all k selected layers", coverage=coverage)
        return _verdict(invariant, "mismatch", hypothesis=hypothesis, measurement=measurement,
                        observed=f"fc reads {len(layers)} layers {layers}; the run selects {len(named)} ({where}: {named})",
                        expected=f"fc over all {len(named)} selected layers",
                        fix=f"gather all {len(named)} selected layers into fc's input (nn.Linear({len(named)}*H, H))",
                        coverage=coverage)
    if depth >= 4 and sorted(layers) == target_layer_ids(depth, len(layers)):
        return _verdict(invariant, "match", hypothesis=hypothesis, measurement=measurement,
                        observed=f"{observed}; they are the reference's whole selection for {len(layers)} layers",
                        expected="fc over all k selected layers", coverage=coverage)
    return _unknown(invariant, f"{NOT_EXERCISED} as a selection: {observed}, but which layers the run selected is not "
                    f"seen (a selection sliced before the gathering leaves the rest unread and unseen) and {layers} is "
                    "not the reference's whole selection for its count; name the ids in the run's config "
                    "(target_layer_ids) for a verdict")


def _num(value: Any) -> str:
    try:
        return f"{float(value):.3g}"
    except (TypeError, ValueError):
        return "none"


# --- frozen embeddings and head --------------------------------------------------------------------------------


def _frozen(observation: dict[str, Any], _expectations: Expectations) -> list[Verdict]:
    invariant = OBSERVED_INVARIANTS[2]
    rows = [r for r in observation.get("frozen") or [] if isinstance(r, dict)]
    embeddings = [r for r in rows if r.get("role") == "embeddings"]
    heads = [r for r in rows if r.get("role") == "draft head"]
    trained = [r for r in rows if r.get("changed_by_step") is True]
    if trained:
        shown = "; ".join(f"{_text(r.get('param'))} ({r.get('role')}, lr {r.get('lr')})" for r in trained)
        return [_verdict(invariant, "mismatch", hypothesis="the embeddings and head the drafter borrows stay frozen",
                         measurement="parameters compared before and after the observed optimizer step",
                         observed=f"the observed step changed {shown}",
                         expected="token embeddings and lm_head are the target's, frozen",
                         fix="freeze them (requires_grad_(False)) and leave them out of the optimizer",
                         coverage={"embeddings": [_text(r.get("param")) for r in embeddings],
                                   "heads": [_text(r.get("param")) for r in heads]})]
    if not rows:
        return [_unknown(invariant, f"{NOT_EXERCISED}: no embedding or draft head ran in the observed step")]
    unknown_change = [r for r in rows if r.get("changed_by_step") is not False]
    missing = []
    if not embeddings:
        missing.append("no embedding module ran (token embeddings computed without nn.Embedding)")
    if not heads:
        missing.append("no module produced the draft logits (a functional head): its parameters were not watched")
    if unknown_change:
        missing.append("the step's change of " + ", ".join(_text(r.get("param")) for r in unknown_change)
                       + " was not measured")
    # Trainable and handed to the optimizer, yet unchanged: this step's learning rate for it may just be 0 (a warm-up
    # from zero); a later step would train it, so the step says nothing for it.
    idle = [r for r in rows if r.get("in_optimizer") and r.get("requires_grad") and r.get("changed_by_step") is False]
    if idle:
        missing.append(", ".join(_text(r.get("param")) for r in idle) + " trainable and in the optimizer, left "
                       "unchanged by this step (a learning rate of 0 here?): whether a later step trains it")
    verdict = _verdict(invariant, "match", hypothesis="the embeddings and head the drafter borrows stay frozen",
                       measurement="parameters compared before and after the observed optimizer step",
                       observed="unchanged by the observed step: " + ", ".join(
                           f"{_text(r.get('param'))} ({r.get('role')}; "
                           + ("not optimised" if not r.get("in_optimizer") else
                              "requires_grad False" if not r.get("requires_grad") else "in the optimizer, no change")
                           + ")" for r in rows),
                       expected="token embeddings and lm_head frozen", coverage={"watched": len(rows)})
    verdict.not_exercised = missing
    return [verdict.gated()]


# --- per-slot loss weights --------------------------------------------------------------------------------


def block_pattern(weights: list[float], shape: list[int]) -> tuple[int, list[list[float]]] | None:
    """The block size: the shortest period whose blocks all carry the same relative weights (normalised by slot 1),
    and the usable blocks; None when no period fits. A flat pattern (no decay, slot 0 trained) repeats at every
    period: the logits' own block dimension decides it, or nothing does."""
    total = len(weights)
    shaped = [d for d in reversed(shape[1:-1]) if isinstance(d, int) and 2 <= d <= MAX_BLOCK]
    for size in range(2, min(MAX_BLOCK, total) + 1):
        if total % size:
            continue
        blocks = [weights[i:i + size] for i in range(0, total, size)]
        usable = [b for b in blocks if all(w > 0 for w in b[1:])]
        if not usable or (size not in shaped and len(usable) < 2):
            continue
        reference = [w / usable[0][1] for w in usable[0]]
        if not all(abs(w / b[1] - r) <= PATTERN_TOLERANCE * max(1.0, abs(r)) for b in usable for w, r in zip(b, reference)):
            continue
        if all(abs(r - 1.0) <= PATTERN_TOLERANCE for r in reference):  # flat: any period fits
            inner = shaped[0] if shaped else None
            if inner is None or inner == size:
                return (size, usable) if inner == size else None
            continue
        return size, usable
    return None


def _weights(observation: dict[str, Any], expectations: Expectations) -> list[Verdict]:
    gamma_id, anchor_id, shift_id, source_id = OBSERVED_INVARIANTS[3:7]
    logits = observation.get("logits")
    if not isinstance(logits, dict):
        why = (f"{NOT_EXERCISED}: no module output with the vocabulary's width received a softmax loss's gradient "
               "(draft logits computed functionally or through a reduced vocabulary: link not followed)")
        return [_unknown(i, why) for i in (gamma_id, anchor_id, shift_id, source_id)]
    where = f"{_text(logits.get('module'))} output {logits.get('shape')}"
    weights = logits.get("weights")
    if not logits.get("hard_labels") or not isinstance(weights, list):
        why = (f"the gradient at the draft logits ({where}) is not that of a cross-entropy against one label per "
               "position: per-slot weights are not recovered for soft targets yet")
        return [_unknown(i, why) for i in (gamma_id, anchor_id, shift_id, source_id)]
    values = [float(w) for w in weights]
    found = block_pattern(values, [int(d) for d in logits.get("shape") or []])
    if found is None:
        why = (f"the per-position weights recovered at {where} repeat in no block pattern (data-dependent weights "
               "such as D-PACE, or blocks of several sizes)")
        return [_unknown(i, why) for i in (gamma_id, anchor_id, shift_id, source_id)]
    size, blocks = found
    verdicts = _shift(logits, values, size, where)
    pattern = [sum(b[k] / b[1] for b in blocks) / len(blocks) for k in range(size)]
    shown = "[" + ", ".join(f"{w:.4f}" for w in pattern) + "]"
    measurement = (f"per-slot weights recovered from the gradient of the loss at the draft logits ({where}), "
                   f"{len(blocks)} block(s) of {size} slots, relative to slot 1: {shown}")
    coverage = {"draft_logits": where, "block_size": size, "blocks": len(blocks),
                "loss": _text((observation.get("loss") or {}).get("site"))}
    slot0 = [b[0] / b[1] for b in blocks]
    if any(w > PATTERN_TOLERANCE for w in slot0):
        verdicts.append(_verdict(anchor_id, "mismatch", hypothesis="slot 0 (the anchor) carries no loss",
                                 measurement=measurement, observed=f"slot 0 weight {max(slot0):.4f} of slot 1's",
                                 expected="slot 0 weight 0", fix="zero the weight of slot 0 (k = 0) in the loss",
                                 coverage=coverage))
    else:
        verdicts.append(_verdict(anchor_id, "match", hypothesis="slot 0 (the anchor) carries no loss",
                                 measurement=measurement, observed="slot 0 weight 0 in every observed block",
                                 expected="slot 0 weight 0", coverage=coverage))
    tail = pattern[1:]
    accepted = accepted_gammas(expectations.gamma, expectations.gamma_by_block_size, size)
    if len(tail) < 2:
        verdicts.append(_unknown(gamma_id, f"{NOT_EXERCISED}: blocks of {size} slots leave one trained slot, no decay "
                                 "to measure"))
        return verdicts
    if all(abs(w - 1.0) <= PATTERN_TOLERANCE for w in tail):
        gamma: float | None = math.inf
    else:
        fits = [-(k - 1) / math.log(w) for k, w in enumerate(tail, start=1) if k >= 2 and 0 < w < 1]
        gamma = sum(fits) / len(fits) if fits and len(fits) == len(tail) - 1 else None
        if gamma is not None and any(abs(slot_weight(k, gamma) - w) > 10 * PATTERN_TOLERANCE
                                     for k, w in enumerate(tail, start=1)):
            gamma = None
    expected = " or ".join(f"exp(-(k-1)/{g:g})" for g in accepted) or "the playbook gives no gamma"
    if gamma is None:
        # Not a fixed decay: the reference also accepts D-PACE (playbook `accept`), whose weights follow the drafter's
        # confidence and, on an untrained drafter, repeat from block to block like a fixed pattern. Which of the two
        # this is, the weights alone do not say: no counterexample, so no mismatch.
        verdicts.append(_unknown(gamma_id, f"weights {shown} at {where}: not an exponential decay; a data-dependent "
                                 "weighting (D-PACE, which the reference accepts) is not told apart from a fixed one "
                                 "yet"))
        return verdicts
    ok = any(math.isfinite(gamma) and abs(gamma - g) <= 0.01 * g for g in accepted)
    gamma_text = "no decay (gamma infinite)" if math.isinf(gamma) else f"gamma {gamma:.3f}"
    verdicts.append(_verdict(gamma_id, "match" if ok else "mismatch", hypothesis="slot k >= 1 weighs "
                             "exp(-(k-1)/gamma) with the reference gamma", measurement=measurement,
                             observed=f"{gamma_text} at block size {size}", expected=expected,
                             fix="" if ok else f"use gamma {accepted[0]:g} (loss_decay_gamma) for block size {size}"
                             if accepted else "", coverage=coverage))
    return verdicts


def _shift(logits: dict[str, Any], weights: list[float], size: int, where: str) -> list[Verdict]:
    """The shift verdict, and where the teacher that placed the blocks came from (target_logits_source)."""
    found, teacher = _placed(logits, weights, size, where)
    if teacher is None:
        return [found, _unknown(OBSERVED_INVARIANTS[6], found.reason or "no captured target output placed the labels")]
    return [found, _source(teacher)]


def _source(teacher: dict[str, Any]) -> Verdict:
    """The teacher whose top-1 the labels are: the target's final output is lm_head(final_norm(last layer))."""
    invariant = OBSERVED_INVARIANTS[6]
    source = teacher.get("source") if isinstance(teacher.get("source"), dict) else {}
    head = _text(teacher.get("module"))
    through, before = _text(source.get("through", "?")), _text(source.get("before", "?"))
    layer, layers = source.get("before_layer"), source.get("before_layers")
    coverage = {"teacher": head, "head_input_from": through, "before_that": before}
    measurement = f"the labels are the top-1 of {head}, whose input came from {through}, fed by {before}"
    if isinstance(source.get("through_layer"), int):
        return _verdict(invariant, "mismatch", hypothesis="targets are the target's final output",
                        measurement=measurement, observed=f"the head reads layer {source['through_layer']}'s output "
                        "directly (no final norm)", expected="lm_head(final_norm(h_L))",
                        fix="train toward the target's own logits (its output), not a head over a layer", coverage=coverage)
    if isinstance(layer, int) and isinstance(layers, int):
        if layer == layers - 1:
            return _verdict(invariant, "match", hypothesis="targets are the target's final output",
                            measurement=measurement, observed=f"{head} over {through} over the last layer ({layer} of "
                            f"{layers})", expected="lm_head(final_norm(h_L))", coverage=coverage)
        return _verdict(invariant, "mismatch", hypothesis="targets are the target's final output", measurement=measurement,
                        observed=f"targets from layer {layer} of {layers} (through {through})",
                        expected="lm_head(final_norm(h_L)), h_L the last layer's output",
                        fix="train toward the target's own logits (its output), not a head over an intermediate layer",
                        coverage=coverage)
    return _unknown(invariant, f"the source of the labels' teacher {head} could not be followed to a layer ({through}, "
                    f"{before}): link not followed")


def _placed(logits: dict[str, Any], weights: list[float], size: int, where: str) -> tuple[Verdict, Any]:
    """Which position of the target's output each slot is trained toward: the labels (recovered from the gradient)
    against the top-1 of each captured target output, at the anchor the block's slot 0 holds."""
    invariant = OBSERVED_INVARIANTS[5]
    labels, block_ids, teachers = logits.get("labels"), logits.get("block_ids"), logits.get("teachers") or []
    if not isinstance(labels, list) or not isinstance(block_ids, list) or len(block_ids) != len(labels) or not teachers:
        return _unknown(invariant, f"{NOT_EXERCISED}: the block's input tokens or a target output of the vocabulary's "
                        "width were not captured (link not followed)"), None
    starts = [i for i in range(0, len(labels) - size + 1, size) if all(weights[i + k] > 0 for k in range(1, size))]
    # Only a teacher whose head input was followed to a layer stack ran on the ids it is paired with: a head over
    # hidden states gathered from a cache (anchor - 1 rows, say) is paired with ids by shape alone, and its rows are
    # not positions of them.
    followed = [t for t in teachers if isinstance(t, dict) and isinstance(t.get("source"), dict)
                and any(isinstance(t["source"].get(key), int) for key in ("through_layer", "before_layer"))]
    if not followed:
        return _unknown(invariant, f"{NOT_EXERCISED}: no captured target output of the vocabulary's width was computed "
                        "by a target forward over the block's tokens (its input was not followed to a layer stack: "
                        "hidden states from a cache, link not followed)"), None
    for teacher in reversed(followed):
        top1, ids = teacher.get("top1"), teacher.get("ids")
        where_anchor: dict[Any, list[tuple[int, int]]] = {}
        for row, tokens in enumerate(ids):
            for position, token in enumerate(tokens):
                where_anchor.setdefault(token, []).append((row, position))
        counts = dict.fromkeys(SHIFTS, 0)
        decided = 0
        for start in starts:
            fits = set()
            for row, anchor in where_anchor.get(block_ids[start], []):
                line = top1[row]
                for shift in SHIFTS:
                    if all(0 <= anchor + j - shift < len(line) and line[anchor + j - shift] == labels[start + j]
                           for j in range(1, size)):
                        fits.add(shift)
            decided += bool(fits)
            for shift in fits:
                counts[shift] += 1
        if not decided:
            continue
        if 2 * decided <= len(starts):  # most blocks found no place in this output: it is not their teacher
            return _unknown(invariant, f"only {decided} of {len(starts)} observed block(s) could be placed in a "
                            "captured target output (labels from data or several target forwards): not decided"), None
        source = _text(teacher.get("module"))
        measurement = (f"labels recovered from the gradient at {where} against the top-1 of {source}'s output at "
                       f"the position of each block's anchor token: {decided} of {len(starts)} block(s) placed")
        coverage = {"teacher": source, "blocks_placed": decided, "blocks": len(starts)}
        # A shift is decided when it alone explains every placed block (a repetitive target output fits several)
        explains = [shift for shift in SHIFTS if counts[shift] == decided]
        if explains == [1]:
            return _verdict(invariant, "match", hypothesis="slot j is trained toward the target's prediction at "
                            "anchor + j - 1", measurement=measurement, observed=f"shift 1 in all {decided} placed "
                            "block(s)", expected="slot j <- target output at anchor + j - 1", coverage=coverage), teacher
        wrong = [shift for shift in explains if shift != 1]
        if 1 not in explains and wrong:
            return _verdict(invariant, "mismatch", hypothesis="slot j is trained toward the target's prediction at "
                            "anchor + j - 1", measurement=measurement,
                            observed=f"slot j is trained toward the target's output at anchor + j - {wrong[0]}"
                            if wrong[0] else "slot j is trained toward the target's output at anchor + j",
                            expected="anchor + j - 1 (the distribution of token anchor + j)",
                            fix="gather the target's prediction at anchor + j - 1 for slot j", coverage=coverage), teacher
        return _unknown(invariant, f"no single shift explains every placed block (blocks fitting shift 0, 1, 2: "
                        f"{counts[0]}, {counts[1]}, {counts[2]} of {decided}): a repetitive target output or repeated "
                        "anchor tokens leave it ambiguous"), teacher
    return _unknown(invariant, "the labels of the observed blocks are the top-1 of no captured target output at their "
                    "anchors (labels from data or another model): the shift is not decided by this step"), None


# --- what the report says of the observation ------------------------------------------------------------------


def describe(observation: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    try:
        lines.append(f"observed {observation.get('steps')} optimizer step(s) of the command "
                     f"(asked {observation.get('steps_wanted')}; ended at {_text(observation.get('when'))}; "
                     f"{observation.get('modules_called')} modules ran; {_num(observation.get('seconds'))} s in the "
                     f"command)")
        for features in observation.get("features") or []:
            chunks = features.get("chunks") or []
            stack = next((c.get("stack") for c in chunks if c.get("stack")), None)
            taken = ", ".join(str(c.get("layer", c.get("module"))) for c in chunks)
            lines.append(f"target features: {features.get('kind')} at {_text(features.get('site'))} of the outputs of "
                         f"{_text(stack or 'modules that did not train')} layers [{_text(taken)}] (why: outputs of "
                         f"modules that did not train, concatenated); reached the loss: "
                         f"{'yes' if features.get('reached_backward') else 'no'}")
        logits = observation.get("logits")
        if isinstance(logits, dict):
            lines.append(f"draft logits: output of {_text(logits.get('module'))} ({_text(logits.get('class'))}, shape "
                         f"{logits.get('shape')}; why: the last output of the vocabulary's width that received the "
                         f"loss's gradient); cross-entropy against one label per position: {logits.get('hard_labels')}")
        else:
            lines.append("draft logits: not found (link not followed)")
        loss = observation.get("loss")
        if isinstance(loss, dict):
            lines.append(f"loss: the tensor backward ran on at {_text(loss.get('site'))} (value {_num(loss.get('value'))})")
        for opt in observation.get("optimizers") or []:
            for index, group in enumerate(opt.get("groups") or []):
                hyper = group.get("hyper") or {}
                owners = ", ".join(_text(o, 80) for o in (group.get("owners") or [])[:6])
                more = group.get("owners_total", 0) - min(6, len(group.get("owners") or []))
                lines.append(f"drafter (what the optimizer trains): {_text(opt.get('class'))} at {_text(opt.get('site'))}"
                             f" group {index}: lr {hyper.get('lr')}, weight decay {hyper.get('weight_decay')}, "
                             f"{group.get('params')} tensors ({group.get('numel')} values) of {owners}"
                             + (f" and {more} more" if more > 0 else ""))
        for row in observation.get("frozen") or []:
            lines.append(f"{row.get('role')}: {_text(row.get('param'))} requires_grad {row.get('requires_grad')}, "
                         f"optimised {row.get('in_optimizer')}, changed by the step {row.get('changed_by_step')}")
    except (TypeError, ValueError, AttributeError):
        lines.append("part of the observation is malformed and was not shown")
    return lines
