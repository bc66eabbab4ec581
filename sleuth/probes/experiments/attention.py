"""What a block attends to: the dependence map over context and blocks, and each layer's visibility within a block."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sleuth.probes.experiments.lab import EFFECT, NO_EFFECT, Lab, from_run_config, influence, seen
from sleuth.probes.protocol import NotProvided
from sleuth.probes.target import perturb_positions
from sleuth.probes.verdict import Verdict


def _block_changes(base: Tensor, after: Tensor, blocks: list[tuple[int, int, int]]) -> dict[tuple[int, int], float]:
    return {(n, i): influence(base[n, i], after[n, i]) for n, i, _ in blocks}


def probe_attention(lab: Lab) -> list[Verdict]:
    """The whole dependence map: every context position (one at a time, all rows at once), every block's
    tokens, and two slots of every block, against what each block may see."""
    layout, b, base = lab.layout, lab.block_size, lab.baseline
    blocks = lab.valid_blocks()
    s = layout.seq_len
    # depends[(row, anchor index)][k]: change of that block when context position k of every row is perturbed
    depends: dict[tuple[int, int], list[float]] = {(n, i): [] for n, i, _ in blocks}
    runs = lab.logits_of_many([perturb_positions(lab.batch, [(n, k) for n in range(lab.rows)], seed=1000 + k)
                               for k in range(s)])
    for before, after in runs:
        for key, change in _block_changes(before, after, blocks).items():
            depends[key].append(change)
    cross_row: dict[tuple[int, int], float] = {}
    if lab.rows > 1:
        for r in range(lab.rows):
            after = lab.logits(perturb_positions(lab.batch, [(r, k) for k in range(s)], seed=2000 + r))
            for (n, i), change in _block_changes(base, after, blocks).items():
                if n != r:
                    cross_row[(n, i)] = max(cross_row.get((n, i), 0.0), change)

    anchor_seen, missing, future, other_doc, ambiguous = [], [], [], [], []
    context_seen_anywhere = False
    for n, i, a in blocks:
        row = layout.rows[n]
        start, _end = row.document_of(a) or (0, row.length)
        allowed = set(range(start, a))
        for k, change in enumerate(depends[(n, i)]):
            verdict = seen(change)
            if verdict is None:
                ambiguous.append((n, a, k))
                continue
            if k in allowed:
                context_seen_anywhere |= verdict
                if not verdict:
                    missing.append((n, a, k))
            elif verdict:
                (anchor_seen if k == a else future if k > a else other_doc).append((n, a, k))

    # Block tokens: each block's tokens perturbed in turn (all rows at once), the padded slots' too: a block that
    # sees a padding block (one that shares its anchor position 0, say) is as wrong as one that sees a real block.
    token_leaks, own_controls = [], []
    num_slots = layout.num_anchors
    for i in range(num_slots):
        hooks = lab.bump_block_tokens(list(range(i * b, (i + 1) * b)), seed=3000 + i)
        after = lab.logits(None, hooks)
        for (n, j), change in _block_changes(base, after, blocks).items():
            if j == i:
                own_controls.append(change)
            elif seen(change) is not False:
                token_leaks.append((n, j, i, change))
    coverage = lab.coverage(perturbed_positions=s, tensors_observed=["draft logits per block"])
    edge = layout.edge_anchors()
    anchor = Verdict(
        invariant="dflash.context_excludes_anchor", experiment="dependence-map",
        hypothesis="every block sees the context of its document strictly before its anchor p: positions < p, "
        "never p itself",
        perturbed=f"every target layer's hidden state at one position at a time (all {s} positions of every row)",
        measurement=_map_summary(blocks, anchor_seen, missing, ambiguous, "sees its anchor position",
                                 "misses context it should see"),
        threshold=f"not seen <= {NO_EFFECT:g}; seen >= {EFFECT:g}", expected="context positions < anchor seen, the anchor not",
        measured={"anchor_seen": anchor_seen, "missing": missing[:20], "ambiguous": ambiguous[:20]},
        status="unknown", coverage=coverage,
    )
    tokens_leak = any(seen(x[3]) for x in token_leaks)
    if tokens_leak:
        anchor.reason = ("blocks see each other's tokens, so what a block sees of the context cannot be told apart "
                         "from what the blocks it sees do (see blocks_isolated)")
    elif anchor_seen:
        anchor.status = "mismatch"
        anchor.observed = f"{len(anchor_seen)} of {len(blocks)} blocks see their anchor's own context position " \
                          f"(kv <= anchor; e.g. row {anchor_seen[0][0]}, anchor {anchor_seen[0][1]})"
        anchor.fix = "Mask context keys at or after the anchor: kv_pos < anchor, not <=."
    elif other_doc:
        # DFLASH.md's rule is context before the anchor *in the anchor's document*: another document's context
        # breaks it (the drafter is trained on states it never has at serving time), whatever else it sees.
        anchor.status = "mismatch"
        anchor.observed = (f"blocks see another document's context ({len(other_doc)} (row, anchor, position) cases; "
                           f"e.g. {other_doc[0]})")
        anchor.fix = "Mask context keys of other documents: same document and kv_pos < anchor."
    elif ambiguous:
        anchor.reason = f"{len(ambiguous)} changes are between the thresholds (e.g. row, anchor, position {ambiguous[0]})"
    elif not context_seen_anywhere:
        anchor.reason = "no block sees any context position: the context does not reach the blocks at all"
    elif missing:
        anchor.status = "mismatch"
        gaps = sorted({a - k for _, a, k in missing})
        anchor.observed = (f"blocks miss context before their anchor ({len(missing)} positions, at anchor - "
                           f"{', '.join(map(str, gaps[:6]))}; e.g. row {missing[0][0]}, anchor {missing[0][1]}, "
                           f"position {missing[0][2]})")
        anchor.fix = "Let a block see every context position of its document before its anchor (kv_pos < anchor)."
    else:
        anchor.status, anchor.observed = "match", "every block sees its document's context before its anchor, not the anchor"
        if lab.packed and not edge["last position of a document"]:
            anchor.not_exercised.append("an anchor on a document's last position")

    packed = lab.packed
    leaks = {
        "another block's tokens": [x for x in token_leaks if seen(x[3])],
        "context after its anchor": future,
        "another row": [k for k, v in cross_row.items() if seen(v)],
    }
    if leaks["another block's tokens"]:  # the context map is then confounded: a block sees what the others see
        leaks["context after its anchor"] = []
    undecided = [x for x in token_leaks if seen(x[3]) is None] + [k for k, v in cross_row.items() if seen(v) is None]
    isolated = Verdict(
        invariant="dflash.blocks_isolated", experiment="dependence-map",
        hypothesis="a block sees neither another block's tokens, nor context after its anchor, nor another "
        "row's context (another document's context is context_excludes_anchor's rule)",
        perturbed=f"(1) every context position of every row, one at a time; (2) the input embeddings of each "
        f"block's tokens in turn; (3) every position of one row at a time (other rows' blocks observed)",
        measurement=f"(1) blocks seeing later context: {len(future)}; "
        f"(2) largest change of another block: {max((x[3] for x in token_leaks), default=0.0):.2g} (a block's "
        f"own tokens: smallest {min(own_controls, default=0.0):.2g}); (3) largest change of another row: "
        f"{max(cross_row.values(), default=0.0):.2g}",
        threshold=f"isolated: every leak <= {NO_EFFECT:g}; the controls >= {EFFECT:g}", expected="no leak",
        measured={"leaks": {k: len(v) for k, v in leaks.items()}, "own_block_min": min(own_controls, default=0.0)},
        status="unknown", coverage=coverage,
    )
    if own_controls and min(own_controls) < EFFECT:
        isolated.reason = "a block does not change when its own tokens do: the block's own inputs do not reach it"
    elif any(leaks.values()):
        isolated.status = "mismatch"
        isolated.observed = "blocks see " + ", ".join(f"{k} ({len(v)})" for k, v in leaks.items() if v)
        isolated.fix = "A block's queries may see its own block's tokens and same-document context before its anchor only."
    elif undecided or ambiguous:
        isolated.reason = "a leak measurement is between the thresholds"
    else:
        isolated.status = "match"
        isolated.observed = "no leak from other blocks or later context" + (" or other rows" if lab.rows > 1 else "")
        isolated.not_exercised += lab.packing_gap()
        if not layout.adjacent_pairs():
            isolated.not_exercised.append("adjacent anchors (overlapping blocks)")

    verdicts = [anchor, isolated, _bidirectional(lab, blocks, coverage)]
    return [v.gated() for v in verdicts]


def _map_summary(blocks: list, bad: list, missing: list, ambiguous: list, bad_text: str, missing_text: str) -> str:
    return (f"over {len(blocks)} blocks: {len(bad)} (row, anchor, position) cases where a block {bad_text}, "
            f"{len(missing)} where it {missing_text}, {len(ambiguous)} between the thresholds")


def _layer_inputs(args: tuple, kwargs: dict) -> Tensor | None:
    if args and isinstance(args[0], Tensor):
        return args[0]
    value = kwargs.get("hidden_states")
    return value if isinstance(value, Tensor) else None


def _within_layer_changes(lab: Lab, layers: list[Any], tokens: list[int], seed: int) -> list[Tensor]:
    """For each layer alone: the change of its output per block token [N, T] when its own block-token input
    is perturbed at `tokens` (attention is the only path between tokens inside a layer).

    A subject that runs its rows one at a time calls each layer once per row: the outputs of one forward are
    concatenated in call order, which is the rows' order."""
    outputs: dict[int, list[Tensor]] = {}
    target = {"layer": -1}

    def pre(index: int):
        def hook(module, args, kwargs):
            if index != target["layer"]:
                return None
            x = _layer_inputs(args, kwargs)
            if x is None:
                raise RuntimeError(f"layer {index} takes no hidden_states")
            g = torch.Generator().manual_seed(seed + index)
            bumped = x.clone()
            idx = torch.tensor(tokens, dtype=torch.long)
            bumped[..., idx, :] += 3.0 * torch.randn(bumped[..., idx, :].shape, generator=g).to(x.dtype)
            if args and isinstance(args[0], Tensor):
                return (bumped, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": bumped}

        return hook

    def post(index: int):
        def hook(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            outputs.setdefault(index, []).append(out.detach().float().clone())

        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post(i)))
    def forward() -> dict[int, Tensor]:
        outputs.clear()
        lab.logits()
        joined = {}
        for index, parts in outputs.items():
            whole = torch.cat([p.reshape(-1, *p.shape[-2:]) for p in parts], 0)
            if whole.shape[0] != lab.rows:
                raise RuntimeError(f"draft layer {index} ran {len(parts)} time(s) per forward on pieces that do not "
                                   f"make the batch's {lab.rows} rows")
            joined[index] = whole
        return joined

    try:
        base = forward()
        changes = []
        for i in range(len(layers)):
            target["layer"] = i
            after_all = forward()
            before, after = base[i], after_all[i]
            scale = before.abs().max().clamp_min(1e-12)
            changes.append(((after - before).abs().amax(-1) / scale).reshape(lab.rows, -1))  # [N, T]
    finally:
        for handle in handles:
            handle.remove()
    return changes


def _captured_masks(lab: Lab, layers: list[Any]) -> dict[int, list[Tensor]]:
    """The `attention_mask` each draft layer is called with in one forward, per call (a subject that runs its
    rows one at a time calls each layer once per row), when it is a tensor."""
    found: dict[int, list[Tensor]] = {}

    def pre(index: int):
        def hook(_module, _args, kwargs):
            mask = kwargs.get("attention_mask")
            if isinstance(mask, Tensor):
                found.setdefault(index, []).append(mask.detach().clone())
        return hook

    handles = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        lab.logits()
    finally:
        for handle in handles:
            handle.remove()
    return found


def _in_block_masks(lab: Lab, layers: list[Any], expect: list[str],
                    blocks: list[tuple[int, int, int]]) -> tuple[list[str], str]:
    """Each layer's mask inside every valid block against the configured rule: every slot sees every slot of
    its block (bidirectional), or itself and the earlier ones (causal). Read only where every layer's mask is
    a [.., Q, S + Q] tensor (context keys, then the block's) whose polarity the context part settles."""
    b, s = lab.block_size, lab.layout.seq_len
    q = lab.layout.num_anchors * b
    try:
        captured = _captured_masks(lab, layers)
    except Exception:  # the forward itself is judged elsewhere; the masks are only an extra observable
        return [], ""
    if len(captured) != len(layers) or any(len(v) not in (1, lab.rows) for v in captured.values()):
        return [], ""
    problems: list[str] = []
    for layer, mode in enumerate(expect):
        calls = captured[layer]
        per_row = []
        for n in range(lab.rows):
            m = calls[n] if len(calls) == lab.rows else calls[0]
            m = m if m.dtype == torch.bool else (m > -1e3) if m.is_floating_point() else m != 0
            if len(calls) != lab.rows and m.dim() >= 3 and m.shape[0] == lab.rows:
                m = m[n]  # one call for the whole batch: this row's mask
            while m.dim() > 2:
                m = m[0]  # heads (or a batch of one) share the mask
            if tuple(m.shape) != (q, s + q):
                return [], ""
            per_row.append(m)
        # polarity from the context part: the positions before an anchor in its document are what it sees
        before = [bool(per_row[n][i * b, k]) for n, i, a in blocks
                  for k in range(*(lab.layout.rows[n].document_of(a) or (0, 0))) if k < a]
        if not before:
            return [], ""
        attend = sum(before) / len(before)
        if 0.2 < attend < 0.8:
            return [], ""
        hidden_self, peek, blind = 0, 0, 0
        for n, i, _a in blocks:
            part = per_row[n][i * b:(i + 1) * b, s + i * b:s + (i + 1) * b]
            part = part if attend >= 0.8 else ~part
            for j in range(b):
                for k in range(b):
                    want = True if mode == "bidirectional" else k <= j
                    got = bool(part[j, k])
                    if got == want:
                        continue
                    if j == k:
                        hidden_self += 1
                    elif got:
                        peek += 1
                    else:
                        blind += 1
        if hidden_self:
            problems.append(f"layer {layer} ({expect[layer]}): its mask hides {hidden_self} slots from their own token")
        if peek:
            problems.append(f"layer {layer} ({expect[layer]} by configuration): its mask lets {peek} (slot, later slot) "
                            "pairs through")
        if blind:
            problems.append(f"layer {layer} ({expect[layer]}): its mask hides {blind} (slot, slot) pairs of a block")
    return problems, f"every layer's attention mask read inside {len(blocks)} blocks"


def _bidirectional(lab: Lab, blocks: list[tuple[int, int, int]], coverage: dict[str, Any]) -> Verdict:
    """Layer by layer: which slots of a block see which (full attention: all; causal sliding-window layers,
    where the subject's configuration makes them so: the earlier ones only)."""
    b = lab.block_size
    first, last = (1, b - 1) if b >= 3 else (0, b - 1)
    slots = lab.layout.num_anchors
    try:
        layers = list(lab.subject.draft_layers() or [])
    except NotProvided as exc:  # the dependence map above still stands; within-block needs the layers
        layers, missing = [], exc.reason
    else:
        missing = "the subject exposes no draft layers"
    types = list(lab.info.get("layer_types") or ["full_attention"] * len(layers))
    causal_sliding = bool(lab.info.get("sliding_causal_within_block"))
    # Non-causal sliding layers are a run's choice (speculators' sliding_window_non_causal): where the trainer's
    # own default made them so, the expectation is the reference's (DFLASH.md: causal within the block unless
    # set), as for any default value.
    non_causal, non_causal_source = lab.configured_value("sliding_window_non_causal")
    by_default = (non_causal is True and bool(non_causal_source) and not from_run_config(non_causal_source)
                  and "probe choice" not in str(non_causal_source) and "sliding_attention" in types)
    causal_sliding = causal_sliding or by_default
    expect = ["causal" if t == "sliding_attention" and causal_sliding else "bidirectional" for t in types]
    bidi = Verdict(
        invariant="dflash.block_bidirectional", experiment="within-block",
        hypothesis="in every full-attention layer every slot of a block sees every other slot of it, both ways"
        + ("; in the sliding-window layers (causal within the block by the subject's configuration) a slot sees "
           "the earlier slots only" if "causal" in expect else ""),
        perturbed=f"one layer at a time: its input at slot {last}, then at slot {first}, of every block",
        measurement="", threshold=f"seen >= {EFFECT:g}; not seen <= {NO_EFFECT:g}",
        expected=", ".join(f"layer {i}: {e}" for i, e in enumerate(expect)) or "bidirectional",
        status="unknown", coverage={**coverage, "layer_types": types},
    )
    if b < 2:
        bidi.status, bidi.reason = "not_applicable", "a block of one token has no other slot"
        return bidi
    if not layers:
        bidi.reason = missing
        return bidi
    late = _within_layer_changes(lab, layers, [i * b + last for i in range(slots)], seed=4001)
    early = _within_layer_changes(lab, layers, [i * b + first for i in range(slots)], seed=4101)
    problems: list[str] = []
    ambiguous = False
    for layer, mode in enumerate(expect):
        blind, peek = [], []
        for n, i, _ in blocks:
            for j in range(b):
                to_late = float(early[layer][n, i * b + j])  # slot j when `first` moved
                to_early = float(late[layer][n, i * b + j])  # slot j when `last` moved
                if j > first and seen(to_late) is not True:
                    (blind.append if seen(to_late) is False else lambda _: None)((n, i, j))
                    ambiguous |= seen(to_late) is None
                if j < last:
                    if mode == "bidirectional" and seen(to_early) is not True:
                        ambiguous |= seen(to_early) is None
                        if seen(to_early) is False:
                            blind.append((n, i, j))
                    if mode == "causal" and seen(to_early) is not False:
                        ambiguous |= seen(to_early) is None
                        if seen(to_early):
                            peek.append((n, i, j))
        if peek:
            problems.append(f"layer {layer} ({types[layer]}, causal by configuration) lets {len(peek)} slots see a later slot")
        if blind:
            later = sum(1 for _, _, j in blind if j < last)
            what = "causal within the block (earlier slots do not see later ones)" if mode == "bidirectional" and \
                later == len(blind) else f"{len(blind)} (block, slot) pairs do not see a slot of their block"
            problems.append(f"layer {layer} ({types[layer]}): {what}")
    # The masks themselves, where the layers are handed readable ones: a slot hidden from its own token (a
    # strict `<` in a causal rule) is invisible to the perturbations above, since a slot's own input reaches
    # its output through the residual whatever the mask says.
    mask_problems, mask_note = _in_block_masks(lab, layers, expect, blocks)
    problems += mask_problems
    if mask_note:
        bidi.coverage = {**bidi.coverage, "masks_read": mask_note}
    bidi.measurement = (f"per layer, smallest change of an earlier slot when slot {last} moves: "
                        + ", ".join(f"{i}: {float(c.min()):.2g}" for i, c in enumerate(late))
                        + f"; of a later slot when slot {first} moves: "
                        + ", ".join(f"{i}: {float(c.max()):.2g}" for i, c in enumerate(early)))
    if problems and by_default:
        problems.insert(0, f"the sliding-window layers are non-causal within the block by the trainer's default "
                           f"(sliding_window_non_causal, {non_causal_source}), where DFlash's sliding layers are causal "
                           "within the block unless a run sets it")
    if problems:
        bidi.status, bidi.observed = "mismatch", "; ".join(problems)
        bidi.fix = ("Full-attention layers: every slot attends to every slot of its own block (non-causal); "
                    "causal sliding-window layers: the earlier slots only" + (
                        " (make sliding_window_non_causal default to off for DFlash)." if by_default else "."))
    elif ambiguous:
        bidi.reason = "a change is between the thresholds"
    else:
        bidi.status = "match"
        bidi.observed = ("every slot sees the others both ways, in every block and layer" if "causal" not in expect
                         else "as configured per layer: " + ", ".join(f"{i} {e}" for i, e in enumerate(expect)))
    return bidi
