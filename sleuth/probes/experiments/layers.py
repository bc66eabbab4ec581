"""Which target layers the drafter reads: fc's inputs, their layout, and the layer-id rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from sleuth.probes.experiments.lab import (
    EFFECT,
    Lab,
    NO_EFFECT,
    REFERENCE_DEPTHS,
    RULE_COUNTS,
    from_run_config,
    influence,
    seen,
)
from sleuth.oracle import speculators_default_layer_ids as speculators_default
from sleuth.oracle import target_layer_ids
from sleuth.probes.target import perturb_layer
from sleuth.probes.verdict import Verdict


def reference_layer_ids(num_layers: int, k: int) -> list[int]:
    """z-lab's rule (sleuth/oracle.py; DFLASH.md `dflash.target_layer_ids`)."""
    return target_layer_ids(num_layers, k)


def speculators_default_layer_ids(num_layers: int, k: int) -> list[int] | None:
    """speculators' documented default when no ids are given (sleuth/oracle.py); it names three layers."""
    return speculators_default(num_layers) if k == 3 else None


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
