"""The context reaches every draft layer directly, the loss's gradient reaches its projection, and each layer
attends at the softmax temperature of its head size."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from sleuth.probes.experiments.lab import EFFECT, Lab, NO_EFFECT, influence, seen
from sleuth.probes.protocol import NotProvided, ProbeHooks
from sleuth.probes.target import perturb_positions
from sleuth.probes.verdict import Verdict


# Softmax temperature: the scale each attention call applies, read where the kernel receives it.
SCALE_RTOL = 1e-3


@contextlib.contextmanager
def _recording_attention_scales(found: list[tuple[int, float]]) -> Iterator[None]:
    """Every call of torch's scaled_dot_product_attention (transformers' SDPA path and hand-written drafters
    alike): (head size, the scale it applies; None given means 1/sqrt(head size))."""
    original = F.scaled_dot_product_attention

    def recording(query, key, value, *args, **kwargs):
        scale = kwargs.get("scale", args[3] if len(args) > 3 else None)
        size = int(query.shape[-1])
        found.append((size, float(scale) if scale is not None else size ** -0.5))
        return original(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = recording
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _attention_scale(lab: Lab) -> tuple[str | None, str]:
    """(what is wrong, or None; what was read). The drafter's layers must scale scores by 1/sqrt(head_dim): a
    scale from another size (hidden / heads, which equals head_dim only when heads x head_dim = hidden) trains a
    softmax temperature the serving engine does not use."""
    found: list[tuple[int, float]] = []
    with _recording_attention_scales(found):
        lab.logits()
    if not found:
        return None, "attention scale not observed (the drafter does not call scaled_dot_product_attention)"
    wrong = sorted({(size, scale) for size, scale in found if abs(scale * size ** 0.5 - 1.0) > SCALE_RTOL})
    read = f"attention scale over {len(found)} kernel calls: " + ", ".join(
        sorted({f"{scale:.4g} at head size {size}" for size, scale in found}))
    if not wrong:
        return None, read
    size, scale = wrong[0]
    return (f"attention scores are scaled by {scale:.4g} = 1/sqrt({scale ** -2:.4g}) where the head size is {size} "
            f"(1/sqrt({size}) = {size ** -0.5:.4g})"), read


def probe_kv_injection(lab: Lab) -> list[Verdict]:
    verdict = Verdict(
        invariant="dflash.kv_injection",
        experiment="context-per-layer",
        hypothesis="every drafter layer takes the context directly (its own K/V projection of it) and attends over "
        "it with scores scaled by 1/sqrt(head_dim)",
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
        changes = [influence(before[i], outputs[i]) for i in range(len(layers))]
        # Each layer's own projection of the context: with every layer's input held, another layer's weights
        # must not move it. A layer that takes its context K/V from layer 0's k_proj/v_proj (projected once,
        # reused) still changes with the context above, so only this tells it apart.
        borrowed = _borrowed_parameters(lab, layers, before, outputs)
    finally:
        for handle in handles:
            handle.remove()
    verdict.measured = changes
    wrong_scale, scale_read = _attention_scale(lab)
    verdict.coverage["attention_scale"] = scale_read
    if wrong_scale:
        verdict.status = "mismatch"
        verdict.observed = f"{wrong_scale}: the softmax temperature trained is not the one served"
        verdict.measurement = scale_read
        verdict.fix = "Scale attention scores by head_dim ** -0.5 (the head size of q and k), not by another size."
        return [verdict]
    untrained = _context_path_untrained(lab)
    if untrained:
        verdict.status = "mismatch"
        verdict.observed = (f"the loss's gradient does not reach the context projection ({untrained}): the context "
                            "is detached on its way into the layers, so fc and its norm never train")
        verdict.measurement = "change of each layer's output: " + ", ".join(f"{i}: {c:.2g}" for i, c in enumerate(changes))
        verdict.fix = "Do not detach the fused context before the layers' k/v projections."
        return [verdict]
    verdict.measurement = "change of each layer's output: " + ", ".join(f"{i}: {c:.2g}" for i, c in enumerate(changes))
    if borrowed["seen"]:
        (owner, user), change = borrowed["seen"][0]
        verdict.status = "mismatch"
        verdict.observed = (f"layer {user}'s output changes with layer {owner}'s weights, its own input held "
                            f"(change {change:.2g}): the layers share a projection of the context instead of each "
                            "projecting it with its own k_proj/v_proj")
        verdict.measurement += f"; with layer inputs held, change of a layer by another layer's weights: {change:.2g}"
        verdict.fix = "Project the fused context with every layer's own k_proj/v_proj and prepend it to that layer's K/V."
        return [verdict]
    if borrowed["ambiguous"]:
        verdict.reason = "a layer's change under another layer's weights is between the thresholds"
    elif any(seen(c) is None for c in changes):
        verdict.reason = "a layer's change is between the thresholds"
    elif all(seen(c) for c in changes):
        verdict.status, verdict.observed = "match", f"all {len(layers)} layers take the context directly"
    else:
        missing = [i for i, c in enumerate(changes) if not seen(c)]
        verdict.status = "mismatch"
        verdict.observed = f"context does not reach layers {missing} of {len(layers)} directly"
        verdict.fix = "Project the fused context with every layer's own k_proj/v_proj and prepend it to that layer's K/V."
    return [verdict.gated()]


def _borrowed_parameters(lab: Lab, layers: list, before: dict[int, Tensor], outputs: dict[int, Tensor]) -> dict:
    """With every layer's block-token input held (the hooks above), perturb one layer's weights at a time and
    measure the other layers' outputs: {"seen": [((owner, user), change), ...], "ambiguous": [...]}."""
    found: dict[str, list] = {"seen": [], "ambiguous": []}
    if len(layers) < 2:
        return found
    generator = torch.Generator().manual_seed(307)
    for owner, layer in enumerate(layers):
        params = [p for p in layer.parameters() if p.is_floating_point()]
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=generator).to(p.dtype) * (p.float().std().nan_to_num(0.0) + 0.05))
        try:
            lab.logits()
        finally:
            with torch.no_grad():
                for p, value in zip(params, saved):
                    p.copy_(value)
        for user in range(len(layers)):
            if user == owner:
                continue
            change = influence(before[user], outputs[user])
            if seen(change):
                found["seen"].append(((owner, user), change))
            elif seen(change) is None:
                found["ambiguous"].append(((owner, user), change))
    return found


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
    try:
        loss = lab.subject.loss(lab.batch, ProbeHooks())
    except NotProvided:  # an entry without loss(): the forward's reach is still measured, the gradient is not
        return None
    if not isinstance(loss, Tensor) or not loss.requires_grad:
        return None
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    dead = [i for i, g in enumerate(grads) if g is None or g.abs().max().item() == 0.0]
    return f"{len(dead)} of {len(params)} fc tensors get no gradient" if len(dead) == len(params) else None
