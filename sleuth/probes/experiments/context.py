"""The context reaches every draft layer directly, and the loss's gradient reaches its projection."""

from __future__ import annotations


import torch
from torch import Tensor

from sleuth.probes.experiments.lab import EFFECT, Lab, NO_EFFECT, influence, seen
from sleuth.probes.protocol import NotProvided, ProbeHooks
from sleuth.probes.target import perturb_positions
from sleuth.probes.verdict import Verdict


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
    try:
        loss = lab.subject.loss(lab.batch, ProbeHooks())
    except NotProvided:  # an entry without loss(): the forward's reach is still measured, the gradient is not
        return None
    if not isinstance(loss, Tensor) or not loss.requires_grad:
        return None
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    dead = [i for i, g in enumerate(grads) if g is None or g.abs().max().item() == 0.0]
    return f"{len(dead)} of {len(params)} fc tensors get no gradient" if len(dead) == len(params) else None
