"""The attention record -> verdict rules (torch-free): the mask as called decides, a malformed record never crashes."""

from __future__ import annotations

from sleuth.observe.judge_attention import ATTENTION_INVARIANTS, block_layout, judge_attention

DATA = [[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]  # one row, 12 positions, every token distinct
MASK = 63


def record(allow, *, positions=None, special=None, data=DATA, anchors=(3, 7), size=3) -> dict:
    """An observation of one attention call: `allow(q, k)` over keys [context (len(data[0])), block]."""
    length = len(data[0])
    blocks = [[data[0][a]] + [MASK] * (size - 1) for a in anchors]
    ids = [[t for b in blocks for t in b]]
    lq = len(ids[0])
    rows = []
    for q in range(lq):
        vis = [allow(q, k, anchors, size) for k in range(length + lq)]
        out = []
        for part in (vis[:length], vis[length:]):
            seen = [i for i, v in enumerate(part) if v]
            out += [seen[0], seen[-1] + 1, len(seen)] if seen else [-1, 0, 0]
        rows.append(out)
    rotary = [] if positions is None else [{"module": "D.rotary", "order": 3, "positions": [positions]}]
    return {"attention": {"calls": [{"how": "scaled_dot_product_attention: boolean mask", "pattern": 0, "lq": lq,
                                     "lk": length + lq, "layer": 0, "module": "D.layers.0", "order": 4}],
                          "patterns": [{"rows": [rows]}], "rotary": rotary, "special_ids": special or {},
                          "embedded": [{"ids": data, "order": 1}, {"ids": ids, "order": 2}]}}


def reference(q, k, anchors, size, length=12):
    block = q // size
    if k < length:
        return k < anchors[block]
    return (k - length) // size == block


def verdicts(obs: dict) -> dict:
    found, _notes = judge_attention(obs)
    assert {v.invariant for v in found} == set(ATTENTION_INVARIANTS)
    return {v.invariant: v for v in found}


def test_the_reference_mask_matches_and_each_defect_is_named() -> None:
    clean = verdicts(record(reference, positions=list(range(12)) + [3, 4, 5, 7, 8, 9], special={"eos_token_id": [62]}))
    assert all(v.status == "match" for v in clean.values()), {k: v.reason for k, v in clean.items()}
    leak = verdicts(record(lambda q, k, a, s: reference(q, k, a, s) or (k < 12 and k == a[q // s])))
    assert leak["dflash.context_excludes_anchor"].status == "mismatch"
    crossing = verdicts(record(lambda q, k, a, s: reference(q, k, a, s) or k >= 12))
    assert crossing["dflash.blocks_isolated"].status == "mismatch"
    causal = verdicts(record(lambda q, k, a, s: reference(q, k, a, s) and (k < 12 or k - 12 <= q)))
    assert causal["dflash.block_bidirectional"].status == "mismatch"
    assert "(causal within the block)" in causal["dflash.block_bidirectional"].observed
    shifted = verdicts(record(reference, positions=list(range(12)) + [4, 5, 6, 8, 9, 10]))
    assert shifted["dflash.block_position_ids"].status == "mismatch"
    eos = verdicts(record(reference, special={"eos_token_id": [MASK]}))
    assert eos["dflash.mask_token_distinct"].status == "mismatch"


def test_unplaceable_anchors_and_missing_parts_stay_unknown() -> None:
    # every block's first token occurs at two places on both sides of what the slots see: not placed
    repeated = [[5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]
    found = verdicts(record(reference, data=repeated))
    assert found["dflash.context_excludes_anchor"].status in ("unknown", "match")
    assert found["dflash.mask_token_distinct"].status == "unknown"  # no special ids read
    assert found["dflash.block_position_ids"].reason.startswith("not exercised by the observed step")


def test_malformed_records_are_unknown_never_a_crash() -> None:
    for broken in ({}, {"attention": None}, {"attention": {"calls": "x"}},
                   {"attention": {"calls": [{"lq": 3, "lk": 9, "pattern": 5}], "patterns": [[1]], "embedded": 7}},
                   {"attention": {"calls": [{"lq": 3, "lk": 9, "pattern": 0}], "patterns": [{"rows": [[["a"]]]}],
                                  "embedded": [{"ids": [[1, 2, 3]], "order": 0}]}}):
        found = verdicts(broken)
        assert all(v.status == "unknown" for v in found.values()), broken


def test_block_layout() -> None:
    assert block_layout([[4, 9, 9, 9, 7, 9, 9, 9]]) == (4, 9)
    assert block_layout([[1, 2, 3, 4]]) is None


def test_a_step_of_two_forwards_is_judged_on_the_last_with_its_own_blocks() -> None:
    first = record(reference, anchors=(5, 9))["attention"]
    last = record(reference, anchors=(3, 7))["attention"]
    for item in last["embedded"]:
        item["order"] += 10
    merged = {**last, "calls": [first["calls"][0], {**last["calls"][0], "pattern": 1, "order": 14}],
              "patterns": first["patterns"] + last["patterns"], "embedded": first["embedded"] + last["embedded"]}
    found = verdicts({"attention": merged})
    assert found["dflash.context_excludes_anchor"].status == "match", found["dflash.context_excludes_anchor"].observed
    assert found["dflash.context_excludes_anchor"].coverage["calls"] == 1


def test_blocks_that_see_earlier_blocks_are_not_thereby_narrowed_within_their_own() -> None:
    """Seeing another block's keys is blocks_isolated's defect; a slot that still sees all of its own block is not
    a bidirectionality mismatch, and one that sees part of it is, however many other keys it sees."""
    earlier = verdicts(record(lambda q, k, a, s: reference(q, k, a, s) or (k >= 12 and (k - 12) // s < q // s)))
    assert earlier["dflash.blocks_isolated"].status == "mismatch"
    assert earlier["dflash.block_bidirectional"].status == "match", earlier["dflash.block_bidirectional"].reason
    causal_all = verdicts(record(lambda q, k, a, s: (k < 12 and k < a[q // s]) or (k >= 12 and k - 12 <= q)))
    assert causal_all["dflash.block_bidirectional"].status == "mismatch"


def test_packed_rows_documents_come_from_the_positions_handed_to_rotary() -> None:
    """Two documents of 6 in one row (positions restart at 0): a block's context must start at its own document,
    and its slots sit at the anchor's own position + j."""
    context = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    blocks = [3, 4, 5, 1, 2, 3]  # anchor 3 at position 3, anchor 7 at position 1

    def same_document(q, k, a, s):
        return reference(q, k, a, s) and (k >= 12 or k >= (6 if a[q // s] >= 6 else 0))

    clean = verdicts(record(same_document, positions=context + blocks))
    assert clean["dflash.context_excludes_anchor"].status == "match", clean["dflash.context_excludes_anchor"].reason
    assert clean["dflash.block_position_ids"].status == "match", clean["dflash.block_position_ids"].reason
    crossing = verdicts(record(reference, positions=context + blocks))
    assert crossing["dflash.context_excludes_anchor"].status == "mismatch"
    assert "in the document before" in crossing["dflash.context_excludes_anchor"].observed
    absolute = verdicts(record(same_document, positions=context + [3, 4, 5, 7, 8, 9]))
    assert absolute["dflash.block_position_ids"].status == "mismatch"


def test_a_layer_the_drafter_declares_sliding_may_be_causal_within_the_block() -> None:
    """speculators' default drafter: every layer sliding, causal within the block, its window wider than a tiny
    sequence (so its mask looks full). Declared sliding by the drafter's own config: not a bidirectionality alarm."""
    causal = record(lambda q, k, a, s: reference(q, k, a, s) and (k < 12 or k - 12 <= q))
    causal["attention"]["layer_types"] = ["sliding_attention"]
    found = verdicts(causal)["dflash.block_bidirectional"]
    assert found.status == "unknown" and "declared sliding" in found.reason
    causal["attention"]["layer_types"] = ["full_attention"]
    assert verdicts(causal)["dflash.block_bidirectional"].status == "mismatch"
