"""The drafter's attention as the observed step called it (attention.py's record) -> verdicts; torch-free.

The keys of a DFlash layer are the context (one per position of the sequence the target read) followed by the
block tokens; the queries are the block tokens (shared/DFLASH.md). From the observed step:
  * the block tokens are the ids of the embedding call as long as the attention's queries; the mask token is
    their most common id, and the block size the longest period in which every slot but the first holds it;
  * the sequence is the ids of the embedding call as long as the context part of the keys; a block's anchor is a
    position of its row holding the block's first token (a block whose first token occurs at several positions
    decides only what holds for each of them);
  * which keys each query could weigh is the mask as called (or the scores as softmax received them).
A `match` covers the layers, rows and blocks the step exercised, and says so; what it did not exercise is
`unknown`. Every value read is type-checked: a malformed observation is `unknown`, never a crash.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from sleuth.probes.answer import safe_text
from sleuth.probes.verdict import Verdict

EXPERIMENT = "observed-step"
NOT_EXERCISED = "not exercised by the observed step"
CONTEXT, ISOLATED, BIDIRECTIONAL, MASK_TOKEN, POSITIONS = ATTENTION_INVARIANTS = (
    "dflash.context_excludes_anchor", "dflash.blocks_isolated", "dflash.block_bidirectional",
    "dflash.mask_token_distinct", "dflash.block_position_ids")
MAX_BLOCK = 128
SHOWN = 3  # violations quoted in a verdict


def _text(value: Any, limit: int = 300) -> str:
    return safe_text(str(value), limit=limit)


def _verdict(invariant: str, status: str, hypothesis: str, measurement: str, observed: str, expected: str,
             fix: str = "", coverage: dict[str, Any] | None = None) -> Verdict:
    return Verdict(invariant=invariant, status=status, experiment=EXPERIMENT, hypothesis=hypothesis,
                   perturbed="nothing: the run's own step, observed", measurement=measurement, threshold="",
                   observed=observed, expected=expected, fix=fix, coverage=coverage or {})


def _unknown(invariant: str, reason: str) -> Verdict:
    return Verdict(invariant=invariant, status="unknown", experiment=EXPERIMENT, hypothesis="", perturbed="",
                   measurement="", threshold="", reason=_text(reason, 600))


def judge_attention(observation: dict[str, Any]) -> tuple[list[Verdict], list[str]]:
    try:
        return _judge(observation)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as exc:
        why = f"the observation of the drafter's attention is malformed ({type(exc).__name__})"
        return [_unknown(i, why) for i in ATTENTION_INVARIANTS], []


def _ints(rows: Any) -> list[list[int]] | None:
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) and r for r in rows):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for r in rows for v in r):
        return None
    return rows


def block_layout(rows: list[list[int]]) -> tuple[int, int] | None:
    """(block size, mask token): the longest period B dividing the length in which every slot but the first of
    every row holds one token, the most common one."""
    length = len(rows[0])
    mask = Counter(v for r in rows for v in r).most_common(1)[0][0]
    for size in range(min(length, MAX_BLOCK), 1, -1):
        if length % size or not all(len(r) == length for r in rows):
            continue
        if all(r[i] == mask for r in rows for i in range(length) if i % size):
            if any(r[i] != mask for r in rows for i in range(0, length, size)):
                return size, mask
    return None


def _judge(observation: dict[str, Any]) -> tuple[list[Verdict], list[str]]:
    record = observation.get("attention")
    if not isinstance(record, dict):
        why = f"{NOT_EXERCISED}: the observer recorded no attention (an observer without attention capture)"
        return [_unknown(i, why) for i in ATTENTION_INVARIANTS], []
    calls = [c for c in record.get("calls") or [] if isinstance(c, dict) and isinstance(c.get("lq"), int)
             and isinstance(c.get("lk"), int) and isinstance(c.get("pattern"), int)]
    if not calls:
        why = (f"{NOT_EXERCISED}: no attention call inside the drafter was captured (no scaled_dot_product_attention "
               "with trained queries and no softmax over scores carrying gradient: flex attention or a fused kernel; "
               "link not followed)")
        leak = _dependence(record, None)
        context = leak if leak is not None else _unknown(CONTEXT, why)
        return [context, *[_unknown(i, why) for i in (ISOLATED, BIDIRECTIONAL)], _mask_token_alone(record, why),
                _unknown(POSITIONS, why)], []
    # The last call whose keys outnumber its queries (context + block): a softmax over something else that carries
    # gradient (a router's gate) has no context part.
    last = next((c for c in reversed(calls) if c["lk"] > c["lq"]), calls[-1])
    lq, lk = int(last["lq"]), int(last["lk"])
    calls = [c for c in calls if c["lq"] == lq and c["lk"] == lk]
    split = lk - lq
    embedded = [e for e in record.get("embedded") or [] if isinstance(e, dict) and _ints(e.get("ids"))
                and isinstance(e.get("order"), int)]
    block_call = next((e for e in reversed(embedded) if len(e["ids"][0]) == lq and e["order"] < last.get("order", 0)),
                      None)
    if block_call is not None:  # the last forward's calls (a step of several forwards embeds each one's blocks)
        calls = [c for c in calls if int(c.get("order") or 0) > block_call["order"]]
    first_order = min(int(c.get("order") or 0) for c in calls)
    data_call = next((e for e in reversed(embedded) if len(e["ids"][0]) == split and e is not block_call
                      and e["order"] < first_order), None)
    layers = sorted({c["layer"] for c in calls if isinstance(c.get("layer"), int)})
    where = ", ".join(sorted({_text(c.get("module"), 80) for c in calls}))
    hows = sorted({_text(c.get("how"), 120) for c in calls})
    notes = [f"drafter attention: {len(calls)} call(s) in {where} ({'; '.join(hows)}), {lq} queries over {lk} keys "
             f"(why: queries or scores carrying gradient, grad mode on)"]
    if block_call is None:
        why = (f"{NOT_EXERCISED}: no embedding call before the attention held {lq} ids per row (the block tokens): the "
               "block's tokens and the mask token were not observed (link not followed)")
        return [_unknown(i, why) for i in ATTENTION_INVARIANTS], notes
    layout = block_layout(block_call["ids"])
    if layout is None:
        why = (f"{NOT_EXERCISED}: the {lq} block tokens per row repeat no [token, mask, ..., mask] pattern: block size "
               "and mask token not recovered")
        return [_unknown(i, why) for i in ATTENTION_INVARIANTS], notes
    size, mask = layout
    blocks = lq // size
    data = data_call["ids"] if data_call is not None and len(data_call["ids"]) == len(block_call["ids"]) else None
    anchors = None
    if data is not None:
        anchors = [[[p for p, token in enumerate(data[r]) if token == block_call["ids"][r][n * size]]
                    for n in range(blocks)] for r in range(len(data))]
    shared = {"layers": layers or where, "calls": len(calls), "block_size": size, "blocks_per_row": blocks,
              "rows": len(block_call["ids"]), "queries": lq, "keys": lk}
    verdicts = _mask_verdicts(record, calls, size, blocks, split, anchors, shared,
                              _doc_starts(_context_positions(record, first_order, lq, lk)))
    leak = _dependence(record, block_call)
    if leak is not None and verdicts[0].status != "mismatch":  # the mask captured is not all the drafter computed
        verdicts[0] = leak
    verdicts.append(_mask_token(record, mask, data, size, shared))
    verdicts.append(_positions(record, first_order, lq, lk, size, blocks, anchors, shared))
    return verdicts, notes


def _handed_positions(record: dict[str, Any], first_order: int) -> dict[str, Any] | None:
    """The last positions handed to a rotary module inside the drafter before its attention ran."""
    rotary = [r for r in record.get("rotary") or [] if isinstance(r, dict) and int(r.get("order") or 0) < first_order]
    return next((r for r in reversed(rotary) if _ints(r.get("positions"))), None)


def _context_positions(record: dict[str, Any], first_order: int, lq: int, lk: int) -> list[list[int]] | None:
    """Per row, the positions handed to rotary for the context keys (None where only the block's were handed)."""
    handed = _handed_positions(record, first_order)
    if handed is None or len(handed["positions"][0]) != lk or lk <= lq:
        return None
    return [row[:lk - lq] for row in handed["positions"]]


def _doc_starts(context: list[list[int]] | None) -> list[list[int]] | None:
    """Per row and position, where its document starts: positions restart at 0 at every packed document. None
    where the positions are not of that shape (0 or the previous + 1 at every place)."""
    if context is None:
        return None
    out = []
    for row in context:
        if not row or row[0] != 0 or any(b not in (0, a + 1) for a, b in zip(row, row[1:])):
            return None
        starts, start = [], 0
        for index, position in enumerate(row):
            start = index if position == 0 else start
            starts.append(start)
        out.append(starts)
    return out


def _dependence(record: dict[str, Any], block_call: dict[str, Any] | None) -> Verdict | None:
    """A mismatch when the loss depends on the target features at or after every anchor of a row: a context position
    no query weighs passes exactly zero gradient back, whatever computed the attention (a kernel sleuth does not
    capture included). A measurement of dependence finds a counterexample only; it never makes a match."""
    reached = record.get("features_reached")
    if not isinstance(reached, dict) or not _ints(reached.get("rows")) or not isinstance(reached.get("length"), int):
        return None
    length, rows = reached["length"], reached["rows"]
    embedded = [e for e in record.get("embedded") or [] if isinstance(e, dict) and _ints(e.get("ids"))]
    data = next((e["ids"] for e in reversed(embedded) if len(e["ids"][0]) == length and len(e["ids"]) == len(rows)),
                None)
    if block_call is None:
        block_call = next((e for e in reversed(embedded) if e["ids"] is not data and len(e["ids"]) == len(rows)
                           and block_layout(e["ids"]) is not None), None)
    layout = block_layout(block_call["ids"]) if block_call is not None else None
    if data is None or layout is None or len(block_call["ids"]) != len(rows):
        return None
    size = layout[0]
    found = []
    for r, row in enumerate(rows):
        firsts = block_call["ids"][r][::size]
        latest = [max((p for p, token in enumerate(data[r]) if token == first), default=None) for first in firsts]
        if not latest or any(a is None for a in latest):
            continue
        last_anchor = max(latest)
        beyond = [p for p in range(last_anchor, len(row)) if row[p]]
        if beyond:
            found.append(f"row {r}: positions {beyond[:6]} reach the loss, at or after its last anchor {last_anchor}")
    if not found:
        return None
    return _verdict(CONTEXT, "mismatch", "a block's queries see context strictly before its anchor",
                    f"the gradient of the observed step's loss at the target features gathered at "
                    f"{_text(reached.get('site'))}, per position (a position no query weighs gets exactly 0)",
                    observed="; ".join(found[:SHOWN]) + ": some block sees context at or after its own anchor",
                    expected="no gradient at positions at or after the last anchor of a row",
                    fix="build the context part of the mask with kv_pos < anchor (not <=)",
                    coverage={"rows": len(rows), "block_size": size, "positions": length})


def _rows(pattern: Any, rows: int) -> list[list[list[int]]] | None:
    found = pattern.get("rows") if isinstance(pattern, dict) else None
    if not isinstance(found, list) or not found:
        return None
    if len(found) == 1 and rows > 1:
        found = found * rows
    checked = []
    for row in found[:rows]:
        if not isinstance(row, list) or not all(isinstance(q, list) and len(q) == 6 for q in row):
            return None
        checked.append([[int(v) for v in q] for q in row])
    return checked


def _mask_verdicts(record: dict[str, Any], calls: list[dict[str, Any]], size: int, blocks: int, split: int,
                   anchors: list[list[list[int]]] | None, shared: dict[str, Any],
                   doc_starts: list[list[int]] | None = None) -> list[Verdict]:
    patterns = record.get("patterns") or []
    rows = shared["rows"]
    leaks: list[str] = []
    crossings: list[str] = []
    narrowed: list[str] = []
    unsure: list[str] = []  # blocks whose own keys the summary cannot count (they see other blocks too)
    context_ok = context_blocks = windowed = judged_blocks = 0
    unplaced: list[str] = []
    judged_layers: list[str] = []
    causal_call = next((c for c in calls if "is_causal" in str(c.get("how"))), None)
    for index in sorted({c["pattern"] for c in calls}):
        summary = _rows(patterns[index] if 0 <= index < len(patterns) else None, rows)
        if summary is None:
            continue
        users = [c for c in calls if c["pattern"] == index]
        label = ", ".join(f"layer {c['layer']}" if isinstance(c.get("layer"), int) else _text(c.get("module"), 80)
                          for c in users)
        # The keys are [context, block] when most queries see the key at their own place in the block part; a
        # pattern that does not (another order of the keys, or is_causal's top-left triangle) is not judged here.
        queries = sum(len(row) for row in summary)
        own = sum(blo <= q < bhi for row in summary for q, (_a, _b, _c, blo, bhi, _n) in enumerate(row))
        if 2 * own <= queries:
            unplaced.append(label)
            continue
        judged_layers.append(label)
        declared = record.get("layer_types") if isinstance(record.get("layer_types"), list) else []
        sliding = any(isinstance(c.get("layer"), int) and c["layer"] < len(declared)
                      and "sliding" in str(declared[c["layer"]]) for c in users)
        for r, row in enumerate(summary):
            # every query's context starts at 0 and the drafter does not declare the layer sliding (a window wider
            # than the observed sequence looks full, and a sliding layer may be causal within the block)
            full_layer = all(q[0] <= 0 for q in row) and not sliding
            windowed += not full_layer
            for n in range(min(blocks, len(row) // size)):
                slots = row[n * size:(n + 1) * size]
                judged_blocks += 1
                lo, hi = n * size, (n + 1) * size
                for j, (_clo, _chi, _ccount, blo, bhi, bcount) in enumerate(slots):
                    if bcount and (blo < lo or bhi > hi):
                        crossings.append(f"{label}, row {r}: slot {j} of block {n} sees block keys {blo}..{bhi - 1} "
                                         f"(its block is {lo}..{hi - 1})")
                        break
                if full_layer:
                    # How many of its own block's keys each slot sees: exact where its visible keys lie inside its
                    # block; bounded where it also sees other blocks (those are blocks_isolated's, not this rule's).
                    bounds = [_own_block_seen(blo, bhi, count, lo, hi) for (_a, _b, _c, blo, bhi, count) in slots]
                    if any(most < size for _least, most in bounds):
                        seen = [most for _least, most in bounds]
                        causal = all(s == j + 1 for j, s in enumerate(seen))
                        narrowed.append(f"{label}, row {r}, block {n}: slots 0..{size - 1} see {seen} of the block's "
                                        f"{size} tokens" + (" (causal within the block)" if causal else ""))
                    elif any(least < size for least, _most in bounds):
                        unsure.append(f"{label}, row {r}, block {n}")
                if anchors is None or r >= len(anchors) or not anchors[r][n]:
                    continue
                context_blocks += 1
                end = max(s[1] for s in slots)  # one past the last context position any slot sees
                candidates = anchors[r][n]
                # Packed rows: the context must also start at the anchor's own document (where the positions handed
                # to rotary last restarted at 0); keys of the document before are another text.
                seen = [s[0] for s in slots if s[2] > 0]
                if (doc_starts is not None and r < len(doc_starts) and len(candidates) == 1 and seen
                        and candidates[0] < len(doc_starts[r]) and min(seen) < doc_starts[r][candidates[0]]):
                    leaks.append(f"{label}, row {r}, block {n} (anchor {candidates[0]}, its document from "
                                 f"{doc_starts[r][candidates[0]]}): its slots see context from position {min(seen)}, "
                                 "in the document before")
                elif all(end <= a for a in candidates):
                    context_ok += 1
                elif all(end > a for a in candidates):
                    anchor = max(a for a in candidates if a < end)
                    leaks.append(f"{label}, row {r}, block {n} (anchor {anchor}"
                                 + (", or " + ", ".join(str(a) for a in candidates if a != anchor) if len(candidates)
                                    > 1 else "") + f"): its slots see context up to position {end - 1}")
    verdicts: list[Verdict] = []
    coverage = {**shared, "blocks_judged": judged_blocks}
    measurement = (f"the mask as called by the drafter's attention ({shared['calls']} call(s), layers "
                   f"{shared['layers']}): for each query, the context and block keys it could weigh")
    covered = "; ".join(judged_layers)
    if unplaced:
        coverage["not_judged"] = f"{'; '.join(unplaced)}: keys not laid out as [context, block]"
    if not judged_layers:
        why = (f"{NOT_EXERCISED}: in no attention call do most queries see the key at their own place in the block "
               f"part (keys {split}..): the keys are not laid out as [context, block] (link not followed)")
        unknown = [_unknown(i, why) for i in (CONTEXT, ISOLATED)]
        if causal_call is None:
            return [*unknown, _unknown(BIDIRECTIONAL, why)]
        return [*unknown, _causal(causal_call, measurement, coverage)]
    # context excludes the anchor
    hypothesis = "a block's queries see context strictly before its anchor"
    if leaks:
        verdicts.append(_verdict(CONTEXT, "mismatch", hypothesis, measurement,
                                 observed=f"{len(leaks)} of {context_blocks} placed block(s) see the anchor or later: "
                                 + "; ".join(leaks[:SHOWN]), expected="context positions < anchor",
                                 fix="build the context part of the mask with kv_pos < anchor (not <=)",
                                 coverage={**coverage, "blocks_placed": context_blocks}))
    elif context_ok:
        verdicts.append(_verdict(CONTEXT, "match", hypothesis, measurement,
                                 observed=f"in {context_ok} placed block(s) of {judged_blocks} judged ({covered}), "
                                 "every slot sees only context before the block's anchor",
                                 expected="context positions < anchor",
                                 coverage={**coverage, "blocks_placed": context_ok}))
    else:
        verdicts.append(_unknown(CONTEXT, f"{NOT_EXERCISED}: no block could be placed at a single anchor in the "
                                 "sequence the target read (its first token occurs at several positions, or the "
                                 "sequence's ids were not observed)"))
    # blocks isolated
    hypothesis, expected = "a block sees no other block's tokens", "block keys limited to the query's own block"
    if crossings:
        verdicts.append(_verdict(ISOLATED, "mismatch", hypothesis, measurement,
                                 observed=f"{len(crossings)} block(s) see another block's keys: "
                                 + "; ".join(crossings[:SHOWN]), expected=expected,
                                 fix="allow block keys only where the key's block equals the query's block",
                                 coverage=coverage))
    elif blocks < 2:
        verdicts.append(_unknown(ISOLATED, f"{NOT_EXERCISED}: one block per row, no other block to see"))
    else:
        verdicts.append(_verdict(ISOLATED, "match", hypothesis, measurement,
                                 observed=f"in all {judged_blocks} block(s) ({blocks} per row, {rows} row(s); "
                                 f"{covered}) no slot sees another block's keys", expected=expected, coverage=coverage))
    # bidirectional within the block
    hypothesis = "slots of a block see each other in both directions"
    if causal_call is not None:
        verdicts.append(_causal(causal_call, measurement, coverage))
    elif narrowed:
        verdicts.append(_verdict(BIDIRECTIONAL, "mismatch", hypothesis, measurement,
                                 observed=f"{len(narrowed)} block(s) in full-attention layers: "
                                 + "; ".join(narrowed[:SHOWN]),
                                 expected=f"every slot sees all {size} tokens of its block",
                                 fix="make the block part of the mask true for every (slot, slot) pair of a block",
                                 coverage=coverage))
    elif unsure:
        verdicts.append(_unknown(BIDIRECTIONAL, f"{NOT_EXERCISED} as a whole: slots of {len(unsure)} block(s) also see "
                                 f"other blocks' keys ({'; '.join(unsure[:SHOWN])}), so the mask's summary cannot say "
                                 "whether each sees every key of its own block"))
    elif windowed and windowed >= judged_blocks // max(1, blocks):
        verdicts.append(_unknown(BIDIRECTIONAL, f"{NOT_EXERCISED}: every observed layer limits the context to a "
                                 "window or is declared sliding by the drafter's config (sliding-window layers may be "
                                 "causal within the block): no full layer seen"))
    else:
        verdicts.append(_verdict(BIDIRECTIONAL, "match", hypothesis, measurement,
                                 observed=f"in all {judged_blocks} block(s) of full-attention layers ({covered}) every "
                                 f"slot sees all {size} tokens of its block", expected="bidirectional within the block",
                                 coverage=coverage))
    return verdicts


def _own_block_seen(first: int, end: int, count: int, lo: int, hi: int) -> tuple[int, int]:
    """(at least, at most) keys of the block [lo, hi) a query sees, from its visible block keys' span [first, end)
    and count."""
    if not count:
        return 0, 0
    inside = max(0, min(end, hi) - max(first, lo))  # span positions inside the block
    if first >= lo and end <= hi:
        return count, count
    return max(0, count - ((end - first) - inside)), min(count, inside)


def _mask_token_alone(record: dict[str, Any], why: str) -> Verdict:
    """The mask token without an attention call to say which ids are the block's: the latest embedding call whose
    ids repeat [token, mask, ..., mask], against the sequence of another call with as many rows."""
    embedded = [e for e in record.get("embedded") or [] if isinstance(e, dict) and _ints(e.get("ids"))]
    block_call = next((e for e in reversed(embedded) if block_layout(e["ids"]) is not None), None)
    if block_call is None:
        return _unknown(MASK_TOKEN, why)
    size, mask = block_layout(block_call["ids"])
    data = next((e["ids"] for e in reversed(embedded) if e is not block_call and len(e["ids"]) == len(block_call["ids"])
                 and block_layout(e["ids"]) is None), None)
    shared = {"rows": len(block_call["ids"]), "block_size": size, "blocks_per_row": len(block_call["ids"][0]) // size}
    return _mask_token(record, mask, data, size, shared)


def _causal(call: dict[str, Any], measurement: str, coverage: dict[str, Any]) -> Verdict:
    """is_causal decides without the keys' layout: query i weighs keys 0..i only, so a block's first query never
    sees the key of the slot after it, wherever the block's keys sit."""
    return _verdict(BIDIRECTIONAL, "mismatch", "slots of a block see each other in both directions", measurement,
                    observed=f"{_text(call.get('how'))} at {_text(call.get('module'))}: query i weighs keys 0..i only, "
                    "so slot 0 never sees slot 1 of its block, whatever the order of the keys",
                    expected="every slot sees all B tokens of its block (full-attention layers)",
                    fix="pass an explicit mask (context < anchor, own block fully visible) instead of is_causal",
                    coverage=coverage)


def _mask_token(record: dict[str, Any], mask: int, data: list[list[int]] | None, size: int,
                shared: dict[str, Any]) -> Verdict:
    special = record.get("special_ids") if isinstance(record.get("special_ids"), dict) else {}
    named = {name: [v for v in values if isinstance(v, int)] for name, values in special.items()
             if isinstance(values, list)}
    clashes = [name.replace("_token_id", "") for name, values in named.items() if mask in values]
    occurs = sum(row.count(mask) for row in data) if data is not None else 0
    measurement = (f"the ids the drafter's embedding was called with for the block tokens: slots 1..{size - 1} of "
                   f"every block hold {mask}; compared with the sequence the target read and the special ids of the "
                   "live model configs")
    coverage = {**shared, "mask_token": mask, "special_ids": {k: v for k, v in named.items() if v},
                "data_tokens": sum(len(r) for r in data) if data is not None else 0}
    if clashes or occurs:
        said = []
        if clashes:
            said.append(f"it is the target's {' and '.join(sorted(set(clashes)))} token")
        if occurs:
            said.append(f"it occurs {occurs} time(s) in the step's own sequence")
        return _verdict(MASK_TOKEN, "mismatch", "the mask token is a dedicated id, not a real text token", measurement,
                        observed=f"mask token {mask}: " + "; ".join(said), expected="an id of its own (not eos, pad, "
                        "bos or any data token)", fix="give the mask token a dedicated id (an added special token)",
                        coverage=coverage)
    if not any(named.values()):
        return _unknown(MASK_TOKEN, f"{NOT_EXERCISED}: mask token {mask} occurs nowhere in the step's sequence, but no "
                        "live model config gave eos/pad/bos ids to compare it with")
    if data is None:
        return _unknown(MASK_TOKEN, f"{NOT_EXERCISED}: mask token {mask} is none of the special ids, but the sequence "
                        "the target read was not observed")
    return _verdict(MASK_TOKEN, "match", "the mask token is a dedicated id, not a real text token", measurement,
                    observed=f"mask token {mask}: none of {coverage['special_ids']}, absent from the step's "
                    f"{coverage['data_tokens']} sequence tokens", expected="an id of its own", coverage=coverage)


def _positions(record: dict[str, Any], first_order: int, lq: int, lk: int, size: int, blocks: int,
               anchors: list[list[list[int]]] | None, shared: dict[str, Any]) -> Verdict:
    handed = _handed_positions(record, first_order)
    if handed is None:
        return _unknown(POSITIONS, f"{NOT_EXERCISED}: no (cos, sin) pair was computed by a module inside the "
                        "drafter's forward from positions handed to it (rotary computed functionally, or none): link "
                        "not followed")
    positions = handed["positions"]
    length = len(positions[0])
    if length not in (lq, lk):
        return _unknown(POSITIONS, f"the positions handed to {_text(handed.get('module'))} cover {length} places, "
                        f"neither the {lq} queries nor the {lk} keys: link not followed")
    if anchors is None:
        return _unknown(POSITIONS, f"{NOT_EXERCISED}: the sequence the target read was not observed, so the anchors "
                        "are not placed")
    split = length - lq
    wrong: list[str] = []
    placed = 0
    for r in range(len(anchors)):
        row = positions[r] if r < len(positions) else positions[0]
        context = row[:split]
        packed = split and _doc_starts([context]) is not None  # 0..T-1, or restarting at each packed document
        if split and not packed:
            wrong.append(f"row {r}: context positions {row[:min(split, 8)]}... are neither 0..{split - 1} nor "
                         "restarting at 0 per document")
        for n in range(blocks):
            slots = row[split + n * size:split + (n + 1) * size]
            candidates = anchors[r][n]
            if not candidates:
                continue
            placed += 1
            start = slots[0]
            # the anchor's own position: its place in the row, or (context handed too) the position rotary got for it
            allowed = [context[a] for a in candidates if a < len(context)] if packed else candidates
            if start not in allowed or slots != list(range(start, start + size)):
                expected = allowed[0] if len(allowed) == 1 else f"one of {allowed}"
                wrong.append(f"row {r}, block {n}: slots at positions {slots}, the anchor at {expected}")
    measurement = (f"the positions handed to the drafter's rotary ({_text(handed.get('module'))}, {length} places: "
                   f"{'context then block' if split else 'the block'}) against each block's anchor in the sequence")
    coverage = {**shared, "rotary": _text(handed.get("module")), "blocks_placed": placed}
    if wrong:
        return _verdict(POSITIONS, "mismatch", "block slot j sits at position anchor + j; context keeps its absolute "
                        "positions", measurement, observed=f"{len(wrong)} disagreement(s): " + "; ".join(wrong[:SHOWN]),
                        expected="slot j at anchor + j", fix="hand rotary position_ids = anchor + arange(B) for each "
                        "block (context 0..T-1)", coverage=coverage)
    if not placed:
        return _unknown(POSITIONS, f"{NOT_EXERCISED}: no block's first token was found in the sequence the target read")
    return _verdict(POSITIONS, "match", "block slot j sits at position anchor + j", measurement,
                    observed=f"in all {placed} placed block(s) slot j sits at anchor + j"
                    + ("; context at 0.." + str(split - 1) if split else ""), expected="slot j at anchor + j",
                    coverage=coverage)
