"""The experiments: each perturbs one thing, measures one number and compares it with a stated threshold.

Every experiment returns `Verdict`s, one per invariant it decides: the hypothesis, what was perturbed,
what was measured (with the number), the threshold, match / mismatch / unknown (with the reason), and
its coverage: what the batch and the subject exercised, and what the run's path needs that was not
exercised. A `match` with anything left unexercised is reported `unknown` ("not exercised: ..."); a
defect that was seen is a `mismatch` whatever else was not exercised.
They run inside the probe worker, on a subject that follows `sleuth.probes.protocol`.

Influence is measured as the largest change of the drafter's logits relative to their largest value.
Masked attention contributes exactly nothing, so "does not see" is a change at rounding level
(<= NO_EFFECT) and "sees" is a change far above it (>= EFFECT); anything between is reported unknown.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from sleuth.probes.protocol import ProbeBatch, ProbeHooks, ProbeTarget
from sleuth.probes.target import PAD_TOKEN, Layout, make_batch, make_layout, perturb_layer, perturb_positions, rms_norm
from sleuth.probes.verdict import Expectations, Verdict

NO_EFFECT = 1e-6  # relative change of the logits at or below this: the perturbed input is not seen
EFFECT = 1e-3  # at or above this: it is seen
AGREEMENT = 0.9  # share of trained slots whose recovered target must agree with a candidate teacher
ONE_HOT = 0.99  # a recovered target distribution with this much mass on one token is one-hot
SOFT_TV = 0.05  # total variation below which a recovered soft target equals a candidate's softmax
GAMMA_RTOL = 0.01  # a fitted gamma within 1 % of an accepted value matches it
EXP_FIT = 0.01  # largest residual of log-weights allowed for "exp(-(k-1)/gamma)"
DATA_DEPENDENT = 1e-3  # relative change of the slot weights between two confidence levels
WEIGHT_FIT = 0.01  # largest relative error of a weighting model (D-PACE, a gamma) against the measured weights
GRADIENT_FORM = 1e-3  # residual of grad = w * (softmax(z) - q) allowed for CE and forward KL
POSITION_FIT = 1e-3  # relative residual of a query / key against its rotation at the position found
SAMPLER_DRAWS = 24  # draws of the subject's anchor sampler
STACK_ROWS = 32  # rows per forward when perturbed copies of the batch are stacked
# The layer-id rules a subject may follow (DFLASH.md `dflash.target_layer_ids`), each in its convention.
REFERENCE_DEPTHS = (36, 45, 64)  # target depths the subject's rule is also called at (45: rounding and truncation part)
RULE_COUNTS = (2, 3, 4, 5)  # numbers of selected layers the rule is called for, where it takes one


def influence(before: Tensor, after: Tensor) -> float:
    """max |after - before| / max |before|: how much a perturbation moved these outputs."""
    scale = before.abs().max().item()
    return (after - before).abs().max().item() / max(scale, 1e-12)


def seen(change: float) -> bool | None:
    if change >= EFFECT:
        return True
    if change <= NO_EFFECT:
        return False
    return None


class Lab:
    """One subject with its synthetic target and batch, and helpers to run it perturbed."""

    def __init__(self, subject: Any, info: dict[str, Any], target: ProbeTarget, expectations: Expectations,
                 seed: int = 0) -> None:
        # describe() is read again once the subject is built: building decides some of what it reports
        # (the layer ids its own rule chose for this target, the block size its config resolved to).
        info = {**info, **dict(subject.describe() or {})}
        self.subject, self.info, self.target, self.expectations, self.seed = subject, info, target, expectations, seed
        self.block_size = int(info["block_size"])
        # A subject whose forward takes no document ids (describe()["documents_per_row"] = 1) gets one document
        # per row; the verdicts that depend on packing then say so (never `match`).
        self.packed = info.get("documents_per_row") != 1
        self.max_rows = int(info.get("max_rows") or STACK_ROWS)
        self.layout: Layout = make_layout(self.block_size, packed=self.packed, rows=min(self.max_rows, 2))
        self.batch: ProbeBatch = make_batch(target, self.layout, seed + 1)
        self.configured: dict[str, dict[str, Any]] = dict(info.get("configured") or {})
        self.facts: dict[str, Any] = {}  # measurements one experiment leaves for a later one
        self._baseline: Tensor | None = None

    @property
    def rows(self) -> int:
        return len(self.layout.rows)

    def logits(self, batch: ProbeBatch | None = None, hooks: ProbeHooks | None = None) -> Tensor:  # [N, A, B, V]
        batch = batch or self.batch
        with torch.no_grad():
            out = self.subject.draft_logits(batch, hooks or ProbeHooks())
        n, a = batch.anchors.shape
        return out.detach().float().reshape(n, a, self.block_size, out.shape[-1])

    def logits_of_many(self, batches: list[ProbeBatch]) -> list[tuple[Tensor, Tensor]]:
        """(unperturbed, perturbed) logits for each batch, several per forward where the subject takes that
        many rows: the copies are stacked as extra rows (dozens of tiny forwards cost far more than a few
        wider ones), each chunk with an unperturbed copy of its own as the reference. Rows never interact
        in a correct drafter; a cross-row leak is measured on its own (and would show as a leak here too)."""
        per = max(1, min(self.max_rows, STACK_ROWS) // self.rows - 1)
        found: list[tuple[Tensor, Tensor]] = []
        for start in range(0, len(batches), per):
            chunk = batches[start : start + per]
            if per == 1:
                found += [(self.baseline, self.logits(b)) for b in chunk]
                continue
            stacked = self.logits(_stack([self.batch, *chunk]))
            parts = stacked.split(self.rows)
            found += [(parts[0], p) for p in parts[1:]]
        return found

    @property
    def baseline(self) -> Tensor:
        if self._baseline is None:
            self._baseline = self.logits()
        return self._baseline

    def with_anchors(self, keep: int) -> Lab:
        """This lab with only the first `keep` anchors of each row (and the padded slot): a batch whose blocks
        are fewer than the row's positions."""
        import copy

        from sleuth.probes.target import Layout, Row

        rows = tuple(Row(documents=r.documents, length=r.length, anchors=r.anchors[:keep], holes=r.holes)
                     for r in self.layout.rows)
        layout = Layout(block_size=self.block_size, seq_len=self.layout.seq_len, rows=rows, packed=self.packed)
        other = copy.copy(self)
        other.layout, other.facts, other._baseline = layout, dict(self.facts), None
        slots = layout.num_anchors
        anchors = torch.zeros(self.rows, slots, dtype=torch.long)
        valid = torch.zeros(self.rows, slots, dtype=torch.bool)
        for n, row in enumerate(rows):
            anchors[n, : len(row.anchors)] = torch.tensor(row.anchors)
            valid[n, : len(row.anchors)] = True
        other.batch = self.batch.replace(anchors=anchors, anchor_valid=valid)
        other.facts["slot0_tokens_wrong"] = [t for t in self.facts.get("slot0_tokens_wrong") or []
                                             if any(t[1] in r.anchors for r in rows)]
        return other

    def valid_blocks(self) -> list[tuple[int, int, int]]:
        return self.layout.blocks()

    def bump_block_tokens(self, tokens: list[int], seed: int, scale: float = 3.0) -> ProbeHooks:
        """Hooks that add noise to the input embeddings of these block-stream tokens (index a*B + j), every row."""

        def hook(x: Tensor) -> Tensor:
            g = torch.Generator().manual_seed(seed)
            x = x.clone()
            index = torch.tensor(tokens, dtype=torch.long)
            noise = torch.randn(x.index_select(-2, index).shape, generator=g).to(x.dtype)
            x.index_add_(x.dim() - 2, index, scale * noise)
            return x

        return ProbeHooks(block_embeddings=hook)

    def coverage(self, **extra: Any) -> dict[str, Any]:
        """What the batch exercised; experiments add what they observed."""
        layout = self.layout
        found = {
            "rows": self.rows,
            "blocks_per_row": [len(r.anchors) for r in layout.rows],
            "block_size": self.block_size,
            "documents_per_row": [len(r.documents) for r in layout.rows],
            "adjacent_anchors": len(layout.adjacent_pairs()),
            "anchors_at_document_edges": {k: len(v) for k, v in layout.edge_anchors().items()},
            "padded_anchor_slots": self.rows,
            "loss_mask_holes": sum(len(r.holes) for r in layout.rows),
        }
        if self.configured:
            found["config_values"] = self.configured
        found.update(extra)
        return found

    def packing_gap(self) -> list[str]:
        if self.packed:
            return []
        return ["documents packed in one row (the subject's forward takes no document ids or positions, so "
                "cross-document rules could not be tried)"]

    def configured_value(self, key: str) -> tuple[Any, str | None]:
        entry = self.configured.get(key)
        if not isinstance(entry, dict):
            return None, None
        return entry.get("value"), str(entry.get("source") or "")


def _stack(batches: list[ProbeBatch]) -> ProbeBatch:
    first = batches[0]
    cat = lambda name: torch.cat([getattr(b, name) for b in batches], dim=0)  # noqa: E731
    return first.replace(
        input_ids=cat("input_ids"), position_ids=cat("position_ids"), doc_ids=cat("doc_ids"), loss_mask=cat("loss_mask"),
        anchors=cat("anchors"), anchor_valid=cat("anchor_valid"), last_hidden=cat("last_hidden"), logits=cat("logits"),
        hidden_states=tuple(torch.cat([b.hidden_states[i] for b in batches], dim=0) for i in range(len(first.hidden_states))))


def from_run_config(source: str | None) -> bool:
    return bool(source) and "run config" in str(source)


def randomize_drafter(subject: Any, target: ProbeTarget, seed: int) -> int:
    """Give every drafter weight a visible random value, so every path carries signal.

    A fresh drafter (N(0, 0.02) linears, unit norms) passes perturbations through at 1e-5 scale, too close
    to rounding to call. Tensors equal to the target's (embeddings, lm_head, final norm) are left alone.
    """
    g = torch.Generator().manual_seed(seed)
    shared = (target.embed_weight, target.lm_head_weight, target.norm_weight)
    changed = 0
    with torch.no_grad():
        for param in subject.parameters().values():
            if not param.is_floating_point() or any(_same(param, t) for t in shared):
                continue
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=g))
            else:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=g) / math.sqrt(fan_in))
            changed += 1
    return changed


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.detach().float(), b.float())


# --- which target layers the drafter reads -------------------------------------------------------------------


def reference_layer_ids(num_layers: int, k: int) -> list[int]:
    """z-lab's rule (DFLASH.md `dflash.target_layer_ids`): k layers evenly from 1 to L-3; one layer: [L//2]."""
    if k == 1:
        return [num_layers // 2]
    return [int(round(1 + i * (num_layers - 4) / (k - 1))) for i in range(k)]


def speculators_default_layer_ids(num_layers: int, k: int) -> list[int] | None:
    """speculators' documented default when no ids are given: [2, L//2, L-3] in vLLM ids (models/utils.py)."""
    return [2, num_layers // 2, num_layers - 3] if k == 3 else None


# name -> (rule, the convention its ids are written in)
ACCEPTED_LAYER_RULES: dict[str, tuple[Callable[[int, int], list[int] | None], str]] = {
    "z-lab round(1 + i*(L-4)/(k-1))": (reference_layer_ids, "zlab"),
    "speculators' default [2, L//2, L-3]": (speculators_default_layer_ids, "vllm"),
}


def _in_convention(ids: list[int], written: str, wanted: str) -> list[int]:
    shift = {"zlab": 0, "vllm": 1}
    return [i - shift[written] + shift.get(wanted, 0) for i in ids]


def _rule_matches(ids: list[int], convention: str, num_layers: int) -> str | None:
    k = len(ids)
    for name, (rule, written) in ACCEPTED_LAYER_RULES.items():
        expected = rule(num_layers, k)
        if expected is not None and _in_convention(expected, written, convention) == list(ids):
            return name
    return None


def probe_layers_read(lab: Lab) -> list[Verdict]:
    n_layers = lab.target.num_layers
    runs = lab.logits_of_many([perturb_layer(lab.batch, i, seed=100 + i) for i in range(n_layers + 1)])
    changes = {i: influence(before, after) for i, (before, after) in enumerate(runs)}
    convention = lab.info.get("layer_id_convention", "zlab")
    source = lab.info.get("layer_ids_source") or "declared by the subject (describe()['layer_ids'])"
    common = dict(
        experiment="layers-read",
        perturbed=f"hidden_states[i] of the target, one layer at a time, i = 0..{n_layers} (noise of scale 3)",
        measurement="relative change of the drafter's logits per perturbed layer: "
        + ", ".join(f"{i}: {c:.2g}" for i, c in changes.items()),
        threshold=f"read: change >= {EFFECT:g}; not read: <= {NO_EFFECT:g}",
        measured={str(i): c for i, c in changes.items()},
    )
    ambiguous = [i for i, c in changes.items() if seen(c) is None]
    read = sorted(i for i, c in changes.items() if seen(c))
    declared = [int(i) for i in lab.info.get("layer_ids") or []]
    verdicts: list[Verdict] = []
    fc = Verdict(
        invariant="dflash.fc_input_layers",
        hypothesis=f"fc reads all {len(declared)} selected target layers",
        status="unknown",
        expected=f"{len(declared)} of {len(declared)} selected layers read",
        coverage=lab.coverage(layer_ids_from=source, tensors_observed=["draft logits"]),
        **common,
    )
    if ambiguous:
        fc.reason = f"layers {ambiguous} changed the logits by an amount between the thresholds"
    elif not declared:
        fc.reason = "the subject did not say which layers it selects"
    elif not read:
        fc.reason = "no target layer changes the drafter's output: the context does not reach it at all"
    else:
        fc.status = "match" if len(read) == len(declared) else "mismatch"
        fc.observed = f"{len(read)} of {len(declared)} selected layers read (hidden_states {read})"
        if fc.status == "mismatch":
            fc.fix = "Concatenate every selected layer into fc: Linear(k*H, H) over all k target_layer_ids."
    if fc.status == "match":
        _check_fc_layout(lab, fc, read, declared)
    verdicts.append(fc)
    verdicts.append(_layer_ids_verdict(lab, common, read, declared, ambiguous, convention, source, fc.reason))
    return [v.gated() for v in verdicts]


def _check_fc_layout(lab: Lab, fc: Verdict, read: list[int], declared: list[int]) -> None:
    """fc's own input (`feature_projection()`): each selected layer fills its own contiguous block of k*H
    columns, in the order of the ids, and fc has no bias (DFLASH.md: Linear(k*H, H, bias=False))."""
    projection = getattr(lab.subject, "feature_projection", None)
    module = projection() if callable(projection) else None
    if module is None:
        fc.not_exercised.append("fc's input layout (the subject exposes no feature_projection): which columns each "
                                "layer fills")
        return
    if getattr(module, "bias", None) is not None:
        fc.status = "mismatch"
        fc.observed = "fc has a bias: the reference's fc (and the serving engine's) is bias-free"
        fc.fix = "Build fc as Linear(k*H, H, bias=False)."
        return
    seen_inputs: list[Tensor] = []
    handle = module.register_forward_pre_hook(lambda _m, args: seen_inputs.append(args[0].detach().float().clone()))
    try:
        lab.logits()
        for index in read:
            lab.logits(perturb_layer(lab.batch, index, seed=100 + index))
    finally:
        handle.remove()
    if len(seen_inputs) != len(read) + 1 or seen_inputs[0].shape[-1] % max(len(read), 1):
        fc.not_exercised.append("fc's input layout (fc was not called once per forward on the features)")
        return
    width = seen_inputs[0].shape[-1] // len(read)
    blocks = []
    for after in seen_inputs[1:]:
        moved = ((after - seen_inputs[0]).abs().reshape(-1, after.shape[-1]).amax(0) > 0).nonzero().squeeze(-1).tolist()
        blocks.append(moved)
    expected = [list(range(j * width, (j + 1) * width)) for j in range(len(read))]
    fc.measured = {**(fc.measured or {}), "fc_columns": [[b[0], b[-1], len(b)] if b else [] for b in blocks]}
    if blocks != expected:
        fc.status = "mismatch"
        order = [next((j for j, e in enumerate(expected) if b == e), None) for b in blocks]
        fc.observed = ("fc's input interleaves or spreads the layers (a layer's state does not fill one contiguous "
                       f"block of {width} columns)" if None in order else
                       f"fc's input holds the layers in another order ({order} for hidden_states {read})")
        fc.fix = "Concatenate the selected layers on the last dim, in the order of the ids: cat([h_i for i in ids], -1)."
    else:
        fc.observed += f"; each fills its own block of {width} columns of fc's input, in order"


def _call_rule(rule: Callable[..., Any], depth: int, count: int | None) -> list[int] | None:
    if count is None:
        return [int(i) for i in rule(depth)]
    try:
        return [int(i) for i in rule(depth, count)]
    except TypeError:  # a rule for the subject's own count only
        return None


def _layer_ids_verdict(lab: Lab, common: dict[str, Any], read: list[int], declared: list[int], ambiguous: list[int],
                       convention: str, source: str, fc_reason: str) -> Verdict:
    n_layers = lab.target.num_layers
    configured_ids, ids_source = lab.configured_value("target_layer_ids")
    rule_for = getattr(lab.subject, "layer_ids_for", None)
    # (depth, count) -> ids: the subject's rule for the probe's target, other depths (odd ones and ones where
    # rounding and truncation part), and other numbers of layers where the rule takes one.
    rule_ids: dict[tuple[int, int | None], list[int]] = {}
    rule_error = None
    if configured_ids is None and callable(rule_for):
        try:
            for depth in (n_layers, *REFERENCE_DEPTHS):
                for count in (None, *RULE_COUNTS):
                    found = _call_rule(rule_for, depth, count)
                    if found is not None and found not in [v for (d, _), v in rule_ids.items() if d == depth]:
                        rule_ids[(depth, count)] = found
        except Exception as exc:  # the subject's rule failing is a finding about it, not a crash of the probe
            rule_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    coverage = lab.coverage(layer_ids_from=source, rule_called_at=sorted({d for d, _ in rule_ids}),
                            rule_counts=sorted({len(v) for v in rule_ids.values()}), tensors_observed=["draft logits"])
    ids = Verdict(
        invariant="dflash.target_layer_ids",
        hypothesis="the layers read are the selected ids (id i = hidden_states[i+1] in z-lab's convention, "
        "hidden_states[i] in vLLM's), and the ids are the configured ones or follow an accepted rule for the "
        "target's depth",
        status="unknown", coverage=coverage, **common,
    )
    ids.expected = (f"ids {reference_layer_ids(n_layers, max(len(declared), 1))} (z-lab) for an L={n_layers} target, "
                    "or speculators' default [2, L//2, L-3] (vLLM ids)")
    problems: list[str] = []
    if convention != "external":
        if ambiguous or not read or not declared:
            ids.reason = fc_reason or "nothing read"
            return ids
        offset = 1 if convention == "zlab" else 0
        read_ids = [i - offset for i in read]
        ids.observed = f"reads hidden_states {read} = ids {read_ids} ({convention} convention); selected {declared}"
        if not set(read_ids) <= set(declared):
            shifted = [i for i in read if i not in {d + offset for d in declared}]
            note = ""
            if set(read) <= {d + offset - 1 for d in declared} or set(read) <= {d + offset + 1 for d in declared}:
                note = f": off by one (hidden_states {shifted} are not the selected layers)"
            ids.status, ids.observed = "mismatch", ids.observed + note
            ids.fix = "Read hidden_states[id + 1] for z-lab layer id `id` (hidden_states[0] is the embeddings)."
            return ids
    else:
        ids.coverage["reading"] = ("not the subject's: its features arrive selected by the serving engine "
                                   "(vLLM id i = hidden_states[i]); only its id rule is probed")
    if configured_ids is not None:  # the configured ids must be the ones the drafter selects
        ids.observed = (ids.observed + "; " if ids.observed else "") + f"ids {configured_ids} from the {ids_source}"
        if declared and [int(i) for i in configured_ids] != declared:
            ids.status = "mismatch"
            ids.observed += f", but the drafter selects {declared}: the configured ids do not reach it"
            ids.fix = "Pass the configured target layer ids to the drafter."
            return ids
        ids.status = "match"
        if from_run_config(ids_source):
            ids.config_bound = ["target_layer_ids"]
        return ids
    if rule_error is not None:
        ids.status = "mismatch"
        ids.observed = f"the subject's layer-id rule fails: {rule_error}"
        return ids
    if not rule_ids:
        rule_ids = {(n_layers, None): declared}
        ids.not_exercised.append(f"the subject's layer-id rule at other target depths ({', '.join(map(str, REFERENCE_DEPTHS))}; "
                                 f"it exposes no layer_ids_for): only its ids for this L={n_layers} target were seen")
    written = "vllm" if convention in ("vllm", "external") else "zlab"
    own = rule_ids.get((n_layers, None))
    if own is not None and declared and own != declared:
        problems.append(f"its rule gives {own} at L={n_layers} but the built drafter selects {declared}")
    matched = {key: _rule_matches(found, written, key[0]) for key, found in rule_ids.items()}
    wrong = {key: rule_ids[key] for key, name in matched.items() if name is None}
    if wrong:
        problems.append("ids follow no accepted rule: " + ", ".join(
            f"L={d}, k={len(i)}: {i} (z-lab rule: {_in_convention(reference_layer_ids(d, len(i)), 'zlab', written)})"
            for (d, _), i in list(wrong.items())[:4]))
    names = sorted({n for n in matched.values() if n})
    rule_text = "; ".join(f"L={d}: {i}" for (d, c), i in rule_ids.items() if c is None)
    ids.observed = (ids.observed + "; " if ids.observed else "") + f"the subject's rule: {rule_text}"
    if problems:
        ids.status = "mismatch"
        ids.observed += "; " + "; ".join(problems)
        ids.fix = "Select round(1 + i*(L-4)/(k-1)) for i < k (z-lab ids; +1 in vLLM's convention)."
    else:
        ids.status = "match"
        ids.observed += f" ({' / '.join(names)}; {len(rule_ids)} (depth, count) pairs)"
    return ids


# --- what a block attends to ----------------------------------------------------------------------------------


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

    # Block tokens: each block's tokens perturbed in turn (all rows at once).
    token_leaks, own_controls = [], []
    num_slots = layout.num_anchors
    for i in range(num_slots - 1):
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
        "another document's context": other_doc,
        "another row": [k for k, v in cross_row.items() if seen(v)],
    }
    if leaks["another block's tokens"]:  # the context map is then confounded: a block sees what the others see
        leaks["context after its anchor"], leaks["another document's context"] = [], []
    undecided = [x for x in token_leaks if seen(x[3]) is None] + [k for k, v in cross_row.items() if seen(v) is None]
    isolated = Verdict(
        invariant="dflash.blocks_isolated", experiment="dependence-map",
        hypothesis="a block sees neither another block's tokens, nor context after its anchor, nor another "
        "document's or another row's context",
        perturbed=f"(1) every context position of every row, one at a time; (2) the input embeddings of each "
        f"block's tokens in turn; (3) every position of one row at a time (other rows' blocks observed)",
        measurement=f"(1) blocks seeing later context: {len(future)}, another document: {len(other_doc)}; "
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
        isolated.observed = "no leak from other blocks, later context" + (", other documents" if packed else "") + \
            (" or other rows" if lab.rows > 1 else "")
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
    is perturbed at `tokens` (attention is the only path between tokens inside a layer)."""
    outputs: dict[int, Tensor] = {}
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
            outputs[index] = out.detach().float().clone()

        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post(i)))
    try:
        lab.logits()
        base = dict(outputs)
        changes = []
        for i in range(len(layers)):
            target["layer"] = i
            lab.logits()
            before, after = base[i], outputs[i]
            scale = before.abs().max().clamp_min(1e-12)
            changes.append(((after - before).abs().amax(-1) / scale).reshape(lab.rows, -1))  # [N, T]
    finally:
        for handle in handles:
            handle.remove()
    return changes


def _bidirectional(lab: Lab, blocks: list[tuple[int, int, int]], coverage: dict[str, Any]) -> Verdict:
    """Layer by layer: which slots of a block see which (full attention: all; causal sliding-window layers,
    where the subject's configuration makes them so: the earlier ones only)."""
    b = lab.block_size
    first, last = (1, b - 1) if b >= 3 else (0, b - 1)
    slots = lab.layout.num_anchors
    layers = list(lab.subject.draft_layers() or [])
    types = list(lab.info.get("layer_types") or ["full_attention"] * len(layers))
    causal_sliding = bool(lab.info.get("sliding_causal_within_block"))
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
        bidi.reason = "the subject exposes no draft layers"
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
    bidi.measurement = (f"per layer, smallest change of an earlier slot when slot {last} moves: "
                        + ", ".join(f"{i}: {float(c.min()):.2g}" for i, c in enumerate(late))
                        + f"; of a later slot when slot {first} moves: "
                        + ", ".join(f"{i}: {float(c.max()):.2g}" for i, c in enumerate(early)))
    if problems:
        bidi.status, bidi.observed = "mismatch", "; ".join(problems)
        bidi.fix = ("Full-attention layers: every slot attends to every slot of its own block (non-causal); "
                    "causal sliding-window layers: the earlier slots only.")
    elif ambiguous:
        bidi.reason = "a change is between the thresholds"
    else:
        bidi.status = "match"
        bidi.observed = ("every slot sees the others both ways, in every block and layer" if "causal" not in expect
                         else "as configured per layer: " + ", ".join(f"{i} {e}" for i, e in enumerate(expect)))
    return bidi


# --- context reaches every layer ------------------------------------------------------------------------------


def probe_kv_injection(lab: Lab) -> list[Verdict]:
    verdict = Verdict(
        invariant="dflash.kv_injection",
        experiment="context-per-layer",
        hypothesis="every drafter layer takes the context directly (its own K/V projection of it)",
        perturbed="every target hidden state at every position, while each layer's block-token input is held "
        "at its unperturbed value",
        measurement="",
        threshold=f"reached: change of the layer's output >= {EFFECT:g}; not reached: <= {NO_EFFECT:g}",
        expected="every layer",
        status="unknown",
        coverage=lab.coverage(tensors_observed=["each draft layer's input and output"]),
    )
    layers = list(lab.subject.draft_layers() or [])
    if not layers:
        verdict.reason = "the subject exposes no draft layers"
        return [verdict]
    inputs: dict[int, Tensor] = {}
    outputs: dict[int, Tensor] = {}
    freeze = {"on": False}

    def pre_hook(index: int):
        def hook(module, args, kwargs):
            if freeze["on"]:
                held = inputs[index]
                if args and isinstance(args[0], Tensor):
                    return (held, *args[1:]), kwargs
                if isinstance(kwargs.get("hidden_states"), Tensor):
                    return args, {**kwargs, "hidden_states": held}
                raise RuntimeError(f"layer {index} takes no hidden_states to hold")
            if args and isinstance(args[0], Tensor):
                inputs[index] = args[0].detach().clone()
            elif isinstance(kwargs.get("hidden_states"), Tensor):
                inputs[index] = kwargs["hidden_states"].detach().clone()
            return None

        return hook

    def post_hook(index: int):
        def hook(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            outputs[index] = out.detach().float().clone()

        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post_hook(i)))
    try:
        lab.logits()
        before = dict(outputs)
        if len(inputs) != len(layers):
            verdict.reason = f"only {len(inputs)} of {len(layers)} layers ran with a block-token input"
            return [verdict]
        freeze["on"] = True
        everywhere = [(n, k) for n in range(lab.rows) for k in range(lab.layout.seq_len)]
        lab.logits(perturb_positions(lab.batch, everywhere, seed=301))
    finally:
        for handle in handles:
            handle.remove()
    changes = [influence(before[i], outputs[i]) for i in range(len(layers))]
    verdict.measured = changes
    untrained = _context_path_untrained(lab)
    if untrained:
        verdict.status = "mismatch"
        verdict.observed = (f"the loss's gradient does not reach the context projection ({untrained}): the context "
                            "is detached on its way into the layers, so fc and its norm never train")
        verdict.measurement = "change of each layer's output: " + ", ".join(f"{i}: {c:.2g}" for i, c in enumerate(changes))
        verdict.fix = "Do not detach the fused context before the layers' k/v projections."
        return [verdict]
    verdict.measurement = "change of each layer's output: " + ", ".join(f"{i}: {c:.2g}" for i, c in enumerate(changes))
    if any(seen(c) is None for c in changes):
        verdict.reason = "a layer's change is between the thresholds"
    elif all(seen(c) for c in changes):
        verdict.status, verdict.observed = "match", f"all {len(layers)} layers take the context directly"
    else:
        missing = [i for i, c in enumerate(changes) if not seen(c)]
        verdict.status = "mismatch"
        verdict.observed = f"context does not reach layers {missing} of {len(layers)} directly"
        verdict.fix = "Project the fused context with every layer's own k_proj/v_proj and prepend it to that layer's K/V."
    return [verdict.gated()]


def _context_path_untrained(lab: Lab) -> str | None:
    """The parameters of the feature projection (fc) that get no gradient from the loss, or None."""
    projection = getattr(lab.subject, "feature_projection", None)
    module = projection() if callable(projection) else None
    if module is None:
        return None
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return "fc does not require grad"
    for p in params:
        p.grad = None
    loss = lab.subject.loss(lab.batch, ProbeHooks())
    if not isinstance(loss, Tensor) or not loss.requires_grad:
        return None
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    dead = [i for i, g in enumerate(grads) if g is None or g.abs().max().item() == 0.0]
    return f"{len(dead)} of {len(params)} fc tensors get no gradient" if len(dead) == len(params) else None


# --- block position ids ---------------------------------------------------------------------------------------


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

    def identity(module, args, output):
        if isinstance(output, tuple) and len(output) == 2:
            return torch.ones_like(output[0]), torch.zeros_like(output[1])
        raise RuntimeError("the rotary module does not return (cos, sin)")

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
    if not rotated or not unrotated or len(rotated) != len(unrotated):
        return [_positions_from_rotary_call(lab, verdict, called, expected_block)]
    q_post, k_post = rotated[0]
    q_pre, k_pre = unrotated[0]
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
    ids = called[0].reshape(-1, called[0].shape[-1])
    wrong = []
    for n, i, a in lab.valid_blocks():
        row = ids[min(n, ids.shape[0] - 1)]
        got = row[-q:][i * b : (i + 1) * b].tolist()
        if got != expected[(n, i)]:
            wrong.append((n, a, got))
    verdict.measurement = f"position ids given to the rotary module for the block tokens: {ids[0, -q:].tolist()}"
    if wrong:
        verdict.status = "mismatch"
        verdict.observed = f"block tokens at {wrong[0][2]} for the block at {wrong[0][1]} (expected anchor + j)"
        verdict.fix = "Give block token j the position of its anchor plus j."
    else:
        verdict.status, verdict.observed = "match", "anchor + j given to the rotary module"
    return verdict.gated()


# --- the block's inputs: anchor token and mask token ------------------------------------------------------------


def _capture_block_tokens(lab: Lab) -> tuple[Tensor | None, float]:
    """The token id behind each block-stream input embedding [N, A*B] (nearest embedding row), and the
    smallest cosine similarity of a match (1.0: every input is exactly one of the target's embeddings)."""
    captured: list[Tensor] = []

    def hook(x: Tensor) -> Tensor:
        captured.append(x.detach().float().clone())
        return x

    lab.logits(None, ProbeHooks(block_embeddings=hook))
    if not captured:
        return None, 0.0
    x = captured[0]
    x = x.reshape(-1, x.shape[-2], x.shape[-1])
    table = lab.target.embed_weight.float()
    cosine = torch.nn.functional.normalize(x, dim=-1) @ torch.nn.functional.normalize(table, dim=-1).T  # [N, T, V]
    best = cosine.max(-1)
    return best.indices, best.values.min().item()


def probe_block_inputs(lab: Lab) -> list[Verdict]:
    b = lab.block_size
    tokens, similarity = _capture_block_tokens(lab)
    source = lab.info.get("mask_token_source") or "the probe target's mask_token_id (handed to the subject)"
    verdict = Verdict(
        invariant="dflash.mask_token_distinct", experiment="block-inputs",
        hypothesis="slots 1..B-1 of every block hold one dedicated mask token: not pad / eos, never a data token",
        perturbed="nothing: the input embeddings of the block tokens are read and matched to the vocabulary",
        measurement="", threshold="every input embedding equals one vocabulary row (cosine >= 0.999)",
        expected="one mask id, distinct from the data tokens and from pad / eos",
        status="unknown", coverage=lab.coverage(mask_token_from=source, tensors_observed=["block input embeddings"]),
    )
    if tokens is None:
        verdict.reason = "the block_embeddings hook was never called"
        return [verdict]
    if similarity < 0.999:
        verdict.reason = f"the block's input embeddings are not rows of the target's embeddings (cosine {similarity:.3f})"
        return [verdict]
    blocks = lab.valid_blocks()
    masks = sorted({int(tokens[min(n, tokens.shape[0] - 1), i * b + j]) for n, i, _ in blocks for j in range(1, b)})
    anchors_wrong = [(n, a, int(tokens[min(n, tokens.shape[0] - 1), i * b])) for n, i, a in blocks
                     if int(tokens[min(n, tokens.shape[0] - 1), i * b]) != int(lab.batch.input_ids[n, a])]
    lab.facts["slot0_tokens_wrong"] = anchors_wrong
    data = set(lab.batch.input_ids[lab.batch.loss_mask.bool()].tolist())
    verdict.measurement = f"slots 1..B-1 hold token ids {masks}; data tokens use {len(data)} ids; pad / eos = {PAD_TOKEN}"
    verdict.measured = {"mask_ids": masks}
    if len(masks) != 1:
        verdict.status = "mismatch"
        verdict.observed = f"slots 1..B-1 hold {len(masks)} different ids {masks[:8]} (not one mask token)"
    elif masks[0] == PAD_TOKEN or masks[0] in data:
        verdict.status = "mismatch"
        verdict.observed = (f"mask token {masks[0]} is the pad / eos token" if masks[0] == PAD_TOKEN
                            else f"mask token {masks[0]} is a data token")
        verdict.fix = "Use the tokenizer's dedicated mask token or an unused embedding row."
    else:
        verdict.status = "match"
        verdict.observed = f"mask token {masks[0]}: not pad / eos, never a data token"
    return [verdict.gated()]


# --- what the loss trains each slot toward ---------------------------------------------------------------------


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
            scores[(name, offset)] = agree.sum().item() / max(judged.sum().item(), 1)
    ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0][0] != "final", kv[0][1] != -1))
    (best_name, best_offset), best = ranked[0]
    runner_up = next((sc for key, sc in ranked[1:] if key[0] != best_name or key[1] != best_offset), 0.0)
    where = (pos + best_offset).clamp(0, s - 1)
    teacher_logits = candidates[best_name].gather(
        1, where.flatten(1)[..., None].expand(-1, -1, v)).view(n, a, b, v)  # [N, A, B, V]
    one_hot = bool((q_hat.max(-1).values[judged] >= ONE_HOT).all())
    soft_tv = 0.5 * (q_hat - torch.softmax(teacher_logits, -1)).abs().sum(-1)[judged].mean().item()
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
    form = _form_residual(grad2, p2, q_model, judged) if grad2 is not None else math.inf
    self_labels = grad2 is not None and _form_residual(
        grad2, p2, torch.nn.functional.one_hot(z2.argmax(-1), v).double(), judged) < GRADIENT_FORM
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
    if extra.any() or lacking.any():
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
    The weighting is fitted on the blocks whose every slot is trained, and checked on every block (those
    with unsupervised slots too: a weighting that sums over masked slots shows there)."""
    b = lab.block_size
    trained = mask > 0
    drift = 0.0
    if len(runs) > 1:
        r0, usable = _relative(runs[0][1], trained)
        r1, _ = _relative(runs[1][1], trained)
        drift = (r1 - r0)[usable].abs().max().item() if usable.any() else 0.0
    profile = _profile(runs[0][1], full)
    if profile is None:
        return {"mode": None}, "no block has every slot trained: the profile cannot be read"
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


# --- the anchor sampler ------------------------------------------------------------------------------------------


def _sampler_batch(lab: Lab) -> tuple[ProbeBatch, Tensor]:
    """The probe batch with a loss mask that starts unsupervised and has a hole in the middle (samplers that
    return ranks among eligible positions instead of positions land in the unsupervised start)."""
    batch = lab.batch
    mask = batch.loss_mask.clone()
    for n, row in enumerate(lab.layout.rows):
        mask[n, :5] = 0
        middle = row.length // 2
        mask[n, middle : middle + 3] = 0
    return batch.replace(loss_mask=mask), mask


def probe_anchor_sampling(lab: Lab) -> list[Verdict]:
    b = lab.block_size
    exclusions = list(lab.info.get("anchor_exclusions") or [])
    verdict = Verdict(
        invariant="dflash.anchor_sampling", experiment="anchor-sampling",
        hypothesis="anchors are drawn uniformly without replacement from the supervised positions (less the "
        "positions the implementation's documented rule excludes), sorted; padded slots are flagged invalid and "
        "carry no loss",
        perturbed=f"nothing: the subject's own sampler is called {SAMPLER_DRAWS} times on a loss mask with an "
        "unsupervised start and a hole, and once on a nearly empty one",
        measurement="", threshold="exact support; duplicates, unsorted or unsupervised anchors count at once; "
        "balance of the two halves within 5 standard deviations",
        expected="uniform over the eligible positions, sorted, without replacement", status="unknown",
        coverage=lab.coverage(anchor_sampler=lab.info.get("anchor_sampler_source") or "the subject's sample_anchors",
                              draws=SAMPLER_DRAWS, documented_exclusions=exclusions),
    )
    sampler = getattr(lab.subject, "sample_anchors", None)
    if lab.facts.get("padded_anchor_trained"):
        verdict.status = "mismatch"
        verdict.observed = "the padded anchor slot (anchor_valid False) is trained"
        verdict.fix = "Zero the loss of blocks whose anchor is padding (anchor_valid False)."
        return [verdict]
    if not callable(sampler):
        verdict.reason = "not exercised: the subject's anchor sampler (it exposes no sample_anchors)"
        return [verdict]
    batch, mask = _sampler_batch(lab)
    eligible: list[set[int]] = []
    allowed: list[set[int]] = []
    for n, row in enumerate(lab.layout.rows):
        supervised = {p for p in range(row.length) if mask[n, p]}
        allowed.append(supervised)
        keep = set(supervised)
        if "last B positions" in exclusions:
            keep = {p for p in keep if p < lab.layout.seq_len - b}
        if "next token unsupervised" in exclusions:
            keep = {p for p in keep if p + 1 < row.length and mask[n, p + 1]}
        eligible.append(keep)
    smallest = min(len(e) for e in eligible)
    num = max(2, smallest // 2)
    counts = [dict.fromkeys(sorted(e), 0) for e in eligible]
    problems: list[str] = []
    for draw in range(SAMPLER_DRAWS):
        torch.manual_seed(lab.seed + 500 + draw)
        anchors, valid = sampler(batch, num)
        anchors, valid = anchors.reshape(-1, anchors.shape[-1]), valid.reshape(-1, valid.shape[-1]).bool()
        for n in range(min(lab.rows, anchors.shape[0])):
            picked = anchors[n][valid[n]].tolist()
            if len(picked) != len(set(picked)):
                problems.append(f"duplicate anchors in one draw (row {n}: {sorted(picked)[:10]})")
            if picked != sorted(picked):
                problems.append(f"anchors not sorted (row {n}: {picked[:10]})")
            if len(picked) != min(num, len(eligible[n])):
                problems.append(f"{len(picked)} valid anchors drawn where {min(num, len(eligible[n]))} were asked for "
                                f"and eligible (row {n})")
            outside = [p for p in picked if p not in allowed[n]]
            if outside:
                problems.append(f"anchors at unsupervised positions {outside[:6]} (row {n}; ranks among the eligible "
                                "positions returned as positions, or the mask ignored)")
            excluded = [p for p in picked if p in allowed[n] and p not in eligible[n]]
            if excluded:
                problems.append(f"anchors at positions the rule excludes ({', '.join(exclusions)}): {excluded[:6]} (row {n})")
            for p in picked:
                if p in counts[n]:
                    counts[n][p] += 1
        if problems:
            break
    never = [(n, p) for n, c in enumerate(counts) for p, k in c.items() if k == 0]
    skew = []
    for n, c in enumerate(counts):
        ordered = list(c.values())
        half = len(ordered) // 2
        low, high = sum(ordered[:half]), sum(ordered[len(ordered) - half :])
        if abs(low - high) > 5 * math.sqrt(max(low + high, 1)) / 2 + 2:
            skew.append((n, low, high))
    # More anchors asked for than one row has but fewer than another: each row gets what it can hold.
    sizes = sorted(len(e) for e in eligible)
    if len(sizes) > 1 and sizes[0] < sizes[-1] and not problems:
        between = (sizes[0] + sizes[-1]) // 2
        torch.manual_seed(lab.seed + 998)
        _anchors, some_valid = sampler(batch, between)
        some_valid = some_valid.reshape(-1, some_valid.shape[-1]).bool()
        got = [int(some_valid[n].sum()) for n in range(min(lab.rows, some_valid.shape[0]))]
        want = [min(between, len(e)) for e in eligible][: len(got)]
        if got != want:
            problems.append(f"asked for {between} anchors, rows with {[len(e) for e in eligible]} eligible positions got "
                            f"{got} valid anchors (expected {want}): one row's count limits another's")
    # Fewer eligible positions than anchors asked for: the extra slots must be flagged invalid.
    sparse = mask.clone() * 0
    for n, row in enumerate(lab.layout.rows):
        sparse[n, 8:11] = 1
    torch.manual_seed(lab.seed + 999)
    few_anchors, few_valid = sampler(batch.replace(loss_mask=sparse), 6)
    few_valid = few_valid.reshape(-1, few_valid.shape[-1]).bool()
    flagged = [int(few_valid[n].sum()) for n in range(min(lab.rows, few_valid.shape[0]))]
    few_expected = []
    for n, row in enumerate(lab.layout.rows):
        keep = {8, 9, 10}
        if "next token unsupervised" in exclusions:
            keep = {p for p in keep if sparse[n, p + 1]}
        few_expected.append(min(6, len(keep)))
    verdict.measured = {"never_drawn": never[:20], "skew": skew, "sparse_valid": flagged}
    verdict.measurement = (f"{SAMPLER_DRAWS} draws of {num} anchors over {[len(e) for e in eligible]} eligible positions: "
                           f"{len(never)} eligible positions never drawn; halves "
                           + ", ".join(f"{lo}/{hi}" for _, lo, hi in skew) + f"; with 3 supervised positions and 6 "
                           f"asked, valid flags {flagged}")
    if flagged != few_expected[: len(flagged)]:
        problems.append(f"with fewer eligible positions than anchors, {flagged} slots are flagged valid "
                        f"(expected {few_expected}): padded slots are not kept invalid")
    if problems:
        verdict.status, verdict.observed = "mismatch", problems[0]
        verdict.fix = ("Draw anchors with randperm over the eligible positions (loss mask 1, the documented "
                       "exclusions), keep the first max_anchors, sort them, flag the rest invalid.")
    elif never:
        verdict.status = "mismatch"
        verdict.observed = (f"{len(never)} eligible positions are never drawn in {SAMPLER_DRAWS} draws (e.g. row "
                            f"{never[0][0]}, position {never[0][1]}): not uniform over the eligible positions")
    elif skew:
        verdict.status = "mismatch"
        verdict.observed = f"draws favour one half of the eligible positions ({skew[0][1]} vs {skew[0][2]})"
    else:
        verdict.status = "match"
        verdict.observed = "uniform over the eligible positions, sorted, without replacement, padded slots invalid"
        if not exclusions:
            verdict.not_exercised.append("the implementation's documented exclusions (the subject states none; "
                                         "anchors in the last B positions could not be judged)")
    return [verdict.gated()]


# --- what one optimizer step changes ---------------------------------------------------------------------------


def probe_frozen(lab: Lab) -> list[Verdict]:
    target = lab.target
    verdict = Verdict(
        invariant="dflash.frozen_embed_head",
        experiment="optimizer-step",
        hypothesis="one optimizer step leaves the embeddings and lm_head (the target's) unchanged",
        perturbed="nothing: one training step with the implementation's own optimizer",
        measurement="",
        threshold="any changed element counts",
        expected="embeddings and lm_head unchanged",
        status="unknown",
        coverage=lab.coverage(tensors_observed=["every parameter before and after one step"]),
    )
    params = lab.subject.parameters()
    roles = {name: role for name, param in params.items()
             for role, ref in (("embeddings", target.embed_weight), ("lm_head", target.lm_head_weight))
             if _same(param, ref)}
    before = {name: param.detach().clone() for name, param in params.items()}
    shared_before = (target.embed_weight.clone(), target.lm_head_weight.clone())
    lab.subject.train_step(lab.batch)
    changed = [name for name, param in params.items() if not torch.equal(before[name], param.detach())]
    shared_changed = [role for role, old, new in (("embeddings", shared_before[0], target.embed_weight),
                                                  ("lm_head", shared_before[1], target.lm_head_weight))
                      if not torch.equal(old, new)]
    moved = sorted({roles[n] for n in changed if n in roles} | set(shared_changed))
    verdict.measured = {"changed": changed, "roles": roles}
    verdict.measurement = (f"{len(changed)} of {len(params)} parameter tensors changed; the target's embeddings / "
                           f"lm_head found as {sorted(roles) or 'no parameter (used directly)'}")
    if moved:
        verdict.status = "mismatch"
        names = [n for n in changed if n in roles]
        verdict.observed = f"{' and '.join(moved)} trained ({', '.join(names) or 'the target tensors themselves'} changed)"
        verdict.fix = "Freeze the embeddings and lm_head (requires_grad False, and keep them out of the optimizer)."
    elif not [n for n in changed if n not in roles]:
        verdict.reason = "the optimizer step changed no parameter at all"
    else:
        verdict.status = "match"
        verdict.observed = "embeddings and lm_head unchanged; the drafter's weights changed"
    return [verdict.gated()]


def run_experiments(lab: Lab, decides: dict[str, tuple[str, ...]]) -> tuple[list[Verdict], dict[str, float]]:
    """Every experiment on one lab; one that raises gives `unknown` verdicts with the error."""
    import time

    verdicts: list[Verdict] = []
    seconds: dict[str, float] = {}
    for name, experiment in EXPERIMENTS.items():
        start = time.perf_counter()
        try:
            found = experiment(lab)
        except Exception as exc:
            text = str(exc).strip().splitlines()
            reason = f"the experiment failed: {type(exc).__name__}" + (f": {text[0]}" if text else "")
            found = [Verdict(invariant=i, status="unknown", experiment=name, hypothesis="", perturbed="",
                             measurement="", threshold="", reason=reason) for i in decides[name]]
        seconds[name] = round(time.perf_counter() - start, 3)
        for verdict in found:
            verdict.seconds = seconds[name]
        verdicts += found
    return verdicts, seconds


def probe_variants(subject: Any, verdicts: list[Verdict], expectations: Expectations, seed: int,
                   decides: dict[str, tuple[str, ...]]) -> list[Verdict]:
    """The main verdicts, each joined with the same experiment on the subject's variants (`variants()`:
    the other paths the same code takes under other settings, exercised when no run config fixes the path,
    e.g. speculators' fixed-exponential weighting beside its D-PACE default). A variant's mismatch is the
    verdict's (it is a defect of the code, on a path other runs take); otherwise the main verdict stands, and
    its coverage lists what each variant said."""
    from sleuth.probes.target import make_target

    found = getattr(subject, "variants", None)
    variants = found() if callable(found) else {}
    by_invariant = {v.invariant: v for v in verdicts}
    for label, variant in (variants or {}).items():
        try:
            info = dict(variant.describe())
            target = make_target(int(info["num_target_layers"]), seed)
            torch.manual_seed(seed)
            variant.build(target)
            randomize_drafter(variant, target, seed + 7)
            other, _ = run_experiments(Lab(variant, info, target, expectations, seed), decides)
        except Exception as exc:  # a variant that does not build leaves the main verdicts as they are
            for verdict in verdicts:
                verdict.coverage.setdefault("variants", {})[label] = f"not built: {type(exc).__name__}"
            continue
        for extra in other:
            main = by_invariant.get(extra.invariant)
            if main is None:
                continue
            main.coverage.setdefault("variants", {})[label] = extra.status
            if extra.status == "mismatch" and main.status != "mismatch":
                main.status, main.reason = "mismatch", ""
                main.observed = f"with {label}: {extra.observed}"
                main.measurement = f"{main.measurement}; with {label}: {extra.measurement}"
                main.fix = extra.fix
                main.config_bound = []
    return verdicts


EXPERIMENTS: dict[str, Callable[[Lab], list[Verdict]]] = {
    "layers-read": probe_layers_read,
    "attention": probe_attention,
    "context-per-layer": probe_kv_injection,
    "rotary-positions": probe_positions,
    "block-inputs": probe_block_inputs,  # before loss-gradient: it leaves slot 0's tokens in lab.facts
    "loss-gradient": probe_loss,  # before anchor-sampling: it leaves whether padded anchors are trained
    "anchor-sampling": probe_anchor_sampling,
    "optimizer-step": probe_frozen,  # last: it changes the weights
}
