"""Block position ids: the position of every query and key, read from what attention is handed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from sleuth.probes.experiments.lab import Lab, POSITION_FIT
from sleuth.probes.target import Layout
from sleuth.probes.verdict import Verdict


@contextlib.contextmanager
def _capture_attention() -> Iterator[list[tuple[Tensor, Tensor]]]:
    """Every (query, key) handed to torch's scaled_dot_product_attention while the block runs: the tensors
    after the rotary embedding was applied, whatever code applied it."""
    import torch.nn.functional as functional

    original = functional.scaled_dot_product_attention
    seen_qk: list[tuple[Tensor, Tensor]] = []

    def spy(query, key, *args, **kwargs):
        seen_qk.append((query.detach().float().clone(), key.detach().float().clone()))
        return original(query, key, *args, **kwargs)

    functional.scaled_dot_product_attention = spy
    try:
        yield seen_qk
    finally:
        functional.scaled_dot_product_attention = original


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rotate_pairs(x: Tensor) -> Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


# (name, rotate function, table layout, sign of the angle): the layouts a rotary embedding is applied in
_CONVENTIONS = (("rotate_half", _rotate_half, False, 1.0), ("interleaved pairs", _rotate_pairs, True, 1.0),
                ("rotate_half, angle reversed", _rotate_half, False, -1.0),
                ("interleaved pairs, angle reversed", _rotate_pairs, True, -1.0))


def _positions_of(pre: Tensor, post: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, str]:
    """The position each row of `post` [H, T, hd] was rotated to from `pre`, searched over the rotary table
    cos/sin [P, rd] (rd < hd: a partial rotary, the rest of the head unrotated); the relative residual per
    row at the position found [T]; and the convention that fits (the one with the smallest worst residual)."""
    best: tuple[Tensor, Tensor, str] | None = None
    rd = cos.shape[-1]
    norm = post.pow(2).sum(-1).sum(0).clamp_min(1e-30)  # [T]
    for name, turn, pairs, sign in _CONVENTIONS:
        c, s_ = (_interleave(cos), _interleave(sin)) if pairs else (cos, sin)
        head, tail = pre[..., :rd], pre[..., rd:]
        # [H, T, P, rd]: every row rotated to every candidate position
        candidates = head[:, :, None, :] * c[None, None] + sign * turn(head)[:, :, None, :] * s_[None, None]
        error = (candidates - post[:, :, None, :rd]).pow(2).sum(-1).sum(0)  # [T, P], summed over heads
        error = error + (tail - post[..., rd:]).pow(2).sum(-1).sum(0)[:, None]
        found = error.argmin(-1)  # [T]
        residual = (error.gather(1, found[:, None]).squeeze(1) / norm).sqrt()  # [T]
        if best is None or residual.max() < best[1].max():
            best = (found, residual, name)
    assert best is not None
    return best


def _interleave(table: Tensor) -> Tensor:
    """A half-split cos/sin table ([f0..fn, f0..fn]) laid out for interleaved pairs ([f0, f0, f1, f1, ...])."""
    half = table.shape[-1] // 2
    return table[..., :half].repeat_interleave(2, dim=-1)


def probe_positions(lab: Lab) -> list[Verdict]:
    layout, b = lab.layout, lab.block_size
    blocks = lab.valid_blocks()
    batch = lab.batch
    expected_block = {(n, i): (batch.position_ids[n, a] + torch.arange(b)).tolist() for n, i, a in blocks}
    verdict = Verdict(
        invariant="dflash.block_position_ids",
        experiment="rotary-positions",
        hypothesis="block token j of the block anchored at p sits at position_ids[p] + j, as a query and as a key; "
        "context keys keep their own (per-document) positions",
        perturbed="the rotary embedding replaced by the identity (to read the queries and keys before rotation)",
        measurement="",
        threshold=f"exact positions (a query / key equals its rotation at one position within {POSITION_FIT:g})",
        expected="block queries and keys at position_ids[anchor] + j; context keys at position_ids",
        status="unknown",
        coverage=lab.coverage(tensors_observed=["rotary position ids", "queries and keys handed to attention"]),
    )
    rotary = lab.subject.rotary()
    if rotary is None:
        verdict.reason = "the subject exposes no rotary embedding module"
        return [verdict]
    called: list[Tensor] = []

    def record(module, args, kwargs):
        ids = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if isinstance(ids, Tensor):
            called.append(ids.detach().clone())

    not_a_table = {"seen": False}

    def identity(module, args, output):
        if isinstance(output, tuple) and len(output) == 2:
            return torch.ones_like(output[0]), torch.zeros_like(output[1])
        not_a_table["seen"] = True  # a module that rotates in place of a (cos, sin) table: left as it is
        return None

    handle = rotary.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with _capture_attention() as rotated:
            lab.logits()
    finally:
        handle.remove()
    handle = rotary.register_forward_hook(identity)
    try:
        with _capture_attention() as unrotated:
            lab.logits()
    finally:
        handle.remove()
    n_rows, q_len, s = lab.rows, layout.num_anchors * b, layout.seq_len
    if not_a_table["seen"]:
        verdict.not_exercised.append("the rotation itself (the rotary module returns no (cos, sin) table to "
                                     "replace by the identity)")
        return [_positions_from_rotary_call(lab, verdict, called, expected_block)]
    if not rotated or not unrotated or len(rotated) != len(unrotated):
        return [_positions_from_rotary_call(lab, verdict, called, expected_block)]
    q_post, k_post = rotated[0]
    q_pre, k_pre = unrotated[0]
    if q_post.dim() == 4 and q_post.shape[0] == 1 != n_rows and q_post.shape[2] == q_len:
        # Rows attended one at a time (a per-row loop, our trainer's segmented CPU attention): judge each call.
        return [_positions_per_row_calls(lab, verdict, rotated, unrotated, rotary, expected_block)]
    if q_post.dim() != 4 or q_post.shape[0] != n_rows or q_post.shape[2] != q_len or k_post.shape[2] != s + q_len:
        verdict.not_exercised.append(f"the queries and keys handed to attention (shapes {tuple(q_post.shape)} and "
                                     f"{tuple(k_post.shape)} are not [N, heads, A*B, hd] and [N, heads, S+A*B, hd])")
        return [_positions_from_rotary_call(lab, verdict, called, expected_block)]
    reach = int(batch.position_ids.max().item()) + b + 8
    with torch.no_grad():
        cos, sin = rotary(q_post.new_zeros(1, reach, q_post.shape[-1]), torch.arange(reach)[None])
    cos, sin = cos.reshape(reach, -1).float(), sin.reshape(reach, -1).float()
    wrong_q, wrong_k, worst, conventions = [], [], 0.0, set()
    observed_q: dict[tuple[int, int], list[int]] = {}
    for n in range(n_rows):
        q_found, q_res, q_conv = _positions_of(q_pre[n], q_post[n], cos, sin)
        k_found, k_res, k_conv = _positions_of(k_pre[n], k_post[n], cos, sin)
        conventions |= {q_conv, k_conv}
        row = layout.rows[n]
        for i, a in enumerate(row.anchors):
            got = q_found[i * b : (i + 1) * b].tolist()
            observed_q[(n, i)] = got
            worst = max(worst, q_res[i * b : (i + 1) * b].max().item(), k_res[s + i * b : s + (i + 1) * b].max().item())
            if got != expected_block[(n, i)]:
                wrong_q.append((n, a, got))
            if k_found[s + i * b : s + (i + 1) * b].tolist() != expected_block[(n, i)]:
                wrong_k.append((n, a, k_found[s + i * b : s + (i + 1) * b].tolist()))
        ctx = k_found[: row.length].tolist()
        worst = max(worst, k_res[: row.length].max().item())
        if ctx != batch.position_ids[n, : row.length].tolist():
            wrong_k.append((n, "context", ctx))
    verdict.measured = {"query_positions": {f"{n},{i}": v for (n, i), v in observed_q.items()}, "residual": worst}
    verdict.measurement = (f"positions found per query and key by matching each to its rotation (worst residual "
                           f"{worst:.2g}); e.g. row 0 block at {layout.rows[0].anchors[0]}: queries "
                           f"{observed_q.get((0, 0))}")
    reversed_ = sorted(c for c in conventions if "reversed" in c)
    if worst > POSITION_FIT:
        # The table is the subject's own rotary module's output, so a correct application fits exactly.
        verdict.status = "mismatch"
        verdict.observed = (f"queries / keys are not the rotary embedding's rotation of their unrotated values at "
                            f"any position (residual {worst:.2g}): the rotation is applied wrongly")
        verdict.fix = "Apply the rotary embedding as q * cos + rotate_half(q) * sin, the same way to queries and keys."
    elif reversed_ or len(conventions) > 1:
        verdict.status = "mismatch"
        verdict.observed = (f"queries / keys rotated as {', '.join(sorted(conventions))}: not the rotary "
                            "embedding's rotation (the angle is reversed, or queries and keys disagree)")
        verdict.fix = "Apply the rotary embedding as q * cos + rotate_half(q) * sin, the same way to queries and keys."
    elif wrong_q or wrong_k:
        verdict.status = "mismatch"
        verdict.observed = _describe_wrong_positions(wrong_q, wrong_k, expected_block, layout)
        verdict.fix = "Rotate block token j (its query and its key) at the anchor's position plus j; keep context keys at theirs."
    else:
        verdict.status = "match"
        verdict.observed = "queries and keys of block token j at anchor + j; context keys at their own positions"
        verdict.not_exercised += [g.replace("cross-document rules", "positions restarting per document")
                                  for g in lab.packing_gap()]
    return [verdict.gated()]


def _positions_per_row_calls(lab: Lab, verdict: Verdict, rotated: list, unrotated: list, rotary: Any,
                             expected: dict) -> Verdict:
    """Attention called once per row (batch 1, all A*B queries, the row's context keys first, possibly only
    those some block sees): every call must be some row's queries and keys at position_ids[anchor] + j with
    its context keys at that row's positions, and every row must be seen. Which call is which row is not
    assumed (layers and rows may be looped in either order): a call that fits no row is the mismatch."""
    layout, b, n_rows = lab.layout, lab.block_size, lab.rows
    q_len = layout.num_anchors * b
    per_row: dict[int, list[int]] = {}
    for n, i, _a in lab.valid_blocks():
        per_row.setdefault(n, []).append(i)
    calls = [(post, pre) for post, pre in zip(rotated, unrotated)
             if post[0].dim() == 4 and post[0].shape[0] == 1 and post[0].shape[2] == q_len]
    if not calls:
        verdict.not_exercised.append("attention calls holding one row's block queries")
        verdict.reason = "no attention call held one row's block queries"
        return verdict.gated()
    if len(calls) % n_rows:
        verdict.not_exercised.append(f"{len(calls)} per-row attention calls that do not divide into {n_rows} rows")
        verdict.reason = verdict.not_exercised[-1]
        return verdict.gated()
    reach = int(lab.batch.position_ids.max().item()) + b + 8
    head_dim = calls[0][0][0].shape[-1]
    with torch.no_grad():
        cos, sin = rotary(calls[0][0][0].new_zeros(1, reach, head_dim), torch.arange(reach)[None])
    cos, sin = cos.reshape(reach, -1).float(), sin.reshape(reach, -1).float()

    def read(chosen: list) -> tuple[float, set, list]:
        worst, conventions, found = 0.0, set(), []
        for (q_post, k_post), (q_pre, k_pre) in chosen:
            q_found, q_res, q_conv = _positions_of(q_pre[0], q_post[0], cos, sin)
            k_found, k_res, k_conv = _positions_of(k_pre[0], k_post[0], cos, sin)
            conventions |= {q_conv, k_conv}
            worst = max(worst, q_res.max().item(), k_res.max().item())
            found.append((q_found, k_found))
        return worst, conventions, found

    # Only the first layer's calls compare a rotated with its unrotated input (the identity rotary changes what
    # later layers receive). Which calls those are depends on the loop order: layers outside and rows inside
    # (the first N calls), or rows outside (every (calls / N)-th). In the true order a correct rotation fits
    # exactly; a mixed-up order does not, so the first order that fits is the first layer's.
    per_layer = len(calls) // n_rows
    orders = [calls[:n_rows], calls[::per_layer]] if per_layer > 1 else [calls]
    readings = [read(order) for order in orders]
    worst, conventions, found = next((r for r in readings if r[0] <= POSITION_FIT), readings[0])
    seen_rows, misfits = set(), []
    for index, (q_found, k_found) in enumerate(found):
        context = k_found.shape[0] - q_len
        fitting = [n for n in per_row
                   if all(q_found[i * b : (i + 1) * b].tolist() == expected[(n, i)]
                          and k_found[context + i * b : context + (i + 1) * b].tolist() == expected[(n, i)]
                          for i in per_row[n])
                   # the context keys may be a subset (an attention that drops keys no block sees): each must
                   # still be at one of the row's own positions
                   and set(k_found[:context].tolist()) <= set(lab.batch.position_ids[n].tolist())]
        seen_rows |= set(fitting)
        if not fitting:
            misfits.append((index, q_found.tolist()))
    calls = found
    verdict.measurement = (f"{len(calls)} attention calls of one row each; positions found per query and key by "
                           f"matching each to its rotation (worst residual {worst:.2g}); rows whose calls fit: "
                           f"{sorted(seen_rows)}")
    if worst > POSITION_FIT:
        verdict.status = "mismatch"
        verdict.observed = (f"queries / keys are not the rotary embedding's rotation of their unrotated values at "
                            f"any position (residual {worst:.2g}): the rotation is applied wrongly")
        verdict.fix = "Apply the rotary embedding as q * cos + rotate_half(q) * sin, the same way to queries and keys."
    elif any("reversed" in c for c in conventions) or len(conventions) > 1:
        verdict.status = "mismatch"
        verdict.observed = f"queries / keys rotated as {', '.join(sorted(conventions))}: not the rotary embedding's rotation"
        verdict.fix = "Apply the rotary embedding as q * cos + rotate_half(q) * sin, the same way to queries and keys."
    elif misfits:
        index, got = misfits[0]
        verdict.status = "mismatch"
        verdict.observed = (f"{len(misfits)} of {len(calls)} per-row attention calls are no row's blocks at "
                            f"position_ids[anchor] + j (call {index}: queries at {got[:2 * b]}...)")
        verdict.fix = "Rotate block token j (its query and its key) at the anchor's position plus j; keep context keys at theirs."
    elif seen_rows != set(per_row):
        verdict.reason = f"rows {sorted(set(per_row) - seen_rows)} were never seen in an attention call"
    else:
        verdict.status = "match"
        verdict.observed = "queries and keys of block token j at anchor + j; context keys at their own positions"
        verdict.not_exercised += [g.replace("cross-document rules", "positions restarting per document")
                                  for g in lab.packing_gap()]
    return verdict.gated()


def _describe_wrong_positions(wrong_q: list, wrong_k: list, expected: dict, layout: Layout) -> str:
    parts = []
    if wrong_q:
        n, a, got = wrong_q[0]
        i = layout.rows[n].anchors.index(a)
        want = expected[(n, i)]
        offsets = {g - w for _, a_, gs in wrong_q for g, w in zip(gs, expected[(_, layout.rows[_].anchors.index(a_))])}
        if got == list(range(len(got))):
            what = "queries rotated at their slot index 0..B-1, not at anchor + j"
        elif len(offsets) == 1:
            what = f"queries at anchor + j {next(iter(offsets)):+d}"
        else:
            what = f"queries at {got} for the block at {a} (expected {want})"
        parts.append(f"{what} ({len(wrong_q)} blocks)")
    if wrong_k:
        n, a, got = wrong_k[0]
        parts.append(f"keys of {'the context' if a == 'context' else f'the block at {a}'} in row {n} at {got[:12]}"
                     f"{'...' if len(got) > 12 else ''}")
    return "; ".join(parts)


def _positions_from_rotary_call(lab: Lab, verdict: Verdict, called: list[Tensor], expected: dict) -> Verdict:
    """Without the rotated queries and keys: the ids the rotary module was called with (the weaker reading)."""
    layout, b = lab.layout, lab.block_size
    verdict.not_exercised.append("the rotation of each query and key (the attention does not call "
                                 "torch.nn.functional.scaled_dot_product_attention, so only the ids given to the "
                                 "rotary module were read)")
    if not called:
        verdict.reason = "the rotary module was not called with position ids"
        return verdict.gated()
    q = layout.num_anchors * b
    # Every row of every call that is long enough to hold the block tokens (their ids are the last A*B). A
    # subject that runs its rows one at a time calls the rotary module once (or twice: queries, keys) per row
    # with a batch of 1, so a call's row index is not the batch row: each batch row is judged against every
    # call-row, and only a row whose blocks are at anchor + j in none of them is a mismatch.
    candidates = [r for ids in called for r in ids.reshape(-1, ids.shape[-1]) if r.shape[-1] >= q]
    if not candidates:
        verdict.reason = f"the rotary module was never called with ids for the {q} block tokens"
        return verdict.gated()
    per_row: dict[int, list[tuple[int, int]]] = {}
    for n, i, a in lab.valid_blocks():
        per_row.setdefault(n, []).append((i, a))

    def fits(row: Tensor, n: int) -> bool:
        tail = row[-q:]
        return all(tail[i * b : (i + 1) * b].tolist() == expected[(n, i)] for i, _ in per_row[n])

    wrong = []
    for n in sorted(per_row):
        if any(fits(row, n) for row in candidates):
            continue
        # shown: the call-row closest to this row's expectation (most blocks at anchor + j)
        row = max(candidates, key=lambda r: sum(r[-q:][i * b : (i + 1) * b].tolist() == expected[(n, i)]
                                                 for i, _ in per_row[n]))
        i, a = next(((i, a) for i, a in per_row[n] if row[-q:][i * b : (i + 1) * b].tolist() != expected[(n, i)]),
                    per_row[n][0])
        wrong.append((n, a, row[-q:][i * b : (i + 1) * b].tolist(), expected[(n, i)]))
    ids = candidates[0][None]
    verdict.measurement = f"position ids given to the rotary module for the block tokens: {ids[0, -q:].tolist()}"
    if wrong:
        verdict.status = "mismatch"
        n, a, got, want = wrong[0]
        verdict.observed = (f"block tokens at {got} for the block at {a} in row {n} (expected position_ids[anchor] + j "
                            f"= {want}; no rotary call gave that row's blocks those ids)")
        verdict.fix = "Give block token j the position of its anchor plus j."
    else:
        verdict.status, verdict.observed = "match", "anchor + j given to the rotary module"
    return verdict.gated()
