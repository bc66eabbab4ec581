"""Whether a norm follows fc, whether every norm of the drafter is one the loss trains, and with which epsilon.

Three measurements, because each alone can pass broken code:
  * scale: fc's output multiplied by a constant. With an RMSNorm after fc (DFlash's `hidden_norm`) the drafter's
    logits do not move (a norm is scale invariant, its eps aside); without one they move by O(1).
  * use: d loss / d every trainable norm weight. A norm of the drafter whose gradient is exactly zero is not in
    the computation: another norm plays its role (the output normalised with `hidden_norm` instead of the final
    `norm`, a layer's MLP fed through its `input_layernorm` instead of `post_attention_layernorm`), so one is
    trained for two jobs and the exported one keeps its initial value. The scale test cannot see that: every
    consumer of fc's output is still normalised.
  * eps: each norm module called on one input and on the same input scaled by c = 1e-3, whose mean square (1e-6)
    is of the order of eps. An RMSNorm gives y(cx) / y(x) = c sqrt(1 + eps) / sqrt(c^2 + eps), whatever its gain
    (w or 1 + w), so eps is read off the ratio and compared with the eps the drafter's config records (the one a
    server builds its norms with). A kernel factory that drops the config's eps for its class default (SpecForge
    round 7) changes every norm; the probe target's eps (3e-6) is no library's default, so any constant shows.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from sleuth.probes.experiments.lab import Lab, influence
from sleuth.probes.protocol import ProbeHooks
from sleuth.probes.verdict import Verdict

SCALES = (4.0, 0.5)
# eps of the norm (1e-6 against a mean square of O(1) at these scales) and float32 rounding stay below this ...
SCALE_FREE = 1e-4
# ... and a projection whose scale reaches the logits moves them by far more than this
SCALE_SEEN = 1e-2
EPS_INPUT_SCALE = 1e-3  # the second input's rms: its mean square is of the order of a norm's eps
EPS_TOLERANCE = 0.05  # relative: float32 reads eps to ~1e-3 at this scale; class defaults differ by 3x or more


def _is_norm_weight(name: str, param: Tensor) -> bool:
    """A norm's weight anywhere in the drafter: fc's norm, the final norm, its layers' input / post-attention /
    q / k norms (a norm module's 1-D `weight`, by the module's name)."""
    parts = name.split(".")
    return param.dim() == 1 and len(parts) >= 2 and "norm" in parts[-2].lower()


def probe_fc_norm(lab: Lab) -> list[Verdict]:
    verdict = Verdict(
        invariant="dflash.fc_norm",
        experiment="fc-norm",
        hypothesis="an RMSNorm follows fc (scaling fc's output leaves the drafter's logits unchanged), and every norm "
                   "of the drafter is part of what the loss trains (none is left unused by another norm taking its place)",
        perturbed=f"fc's output scaled by {' and by '.join(f'{s:g}' for s in SCALES)} (a forward hook on the feature "
                  "projection); then d loss / d every trainable parameter on the probe's batch",
        measurement="",
        threshold=f"logits change <= {SCALE_FREE:g}: normalised; >= {SCALE_SEEN:g}: not; a drafter norm whose gradient is "
                  "exactly zero is unused",
        expected="fc's output normalised; every drafter norm trained",
        status="unknown",
        measured={},
        coverage=lab.coverage(tensors_observed=["drafter logits with fc's output scaled", "d loss / d parameters"]),
    )
    parts: list[str] = []
    scale_free = _scale_free(lab, verdict, parts)
    unused = _unused_norms(lab, verdict, parts)
    off_eps = _norms_off_eps(lab, verdict, parts)
    verdict.measurement = "; ".join(parts)
    if scale_free is False:
        verdict.status = "mismatch"
        verdict.observed = "fc's output scale reaches the drafter's logits: no norm follows fc"
        verdict.fix = "Apply an RMSNorm (hidden_norm) to fc's output before the layers project it."
    elif unused:
        verdict.status = "mismatch"
        verdict.observed = (f"the drafter's {', '.join(unused)} gets no gradient from the loss: the norm is not used "
                            "(another norm takes its place), so it keeps its initial value in the checkpoint")
        verdict.fix = "Normalise fc's output with hidden_norm and the drafter's output with its final norm, each once."
    elif off_eps:
        want = verdict.measured["eps_expected"]
        verdict.status = "mismatch"
        verdict.observed = (f"{len(off_eps)} of the drafter's norms use eps {_eps_text(off_eps)} where its config "
                            f"records {want:g} (what a server builds): {', '.join(list(off_eps)[:4])}")
        verdict.expected = f"eps {want:g} in every norm"
        verdict.fix = "Build every norm with the config's rms_norm_eps, not a class default."
    elif scale_free and unused is not None and off_eps is not None:
        verdict.status = "match"
        verdict.observed = "fc's output is normalised; every drafter norm is trained" + (
            " and uses the eps its config records" if "eps_expected" in verdict.measured else "")
    elif scale_free is None and not verdict.reason:
        verdict.reason = "the change of the logits under fc's scaling is between the thresholds"
    return [verdict.gated()]


def _scale_free(lab: Lab, verdict: Verdict, parts: list[str]) -> bool | None:
    projection = getattr(lab.subject, "feature_projection", None)
    module = projection() if callable(projection) else None
    if module is None:
        verdict.not_exercised.append("fc's output scale (the subject exposes no feature_projection)")
        return None
    changes = []
    for factor in SCALES:
        handle = module.register_forward_hook(lambda _m, _a, out, f=factor: out * f)
        try:
            changes.append(influence(lab.baseline, lab.logits()))
        finally:
            handle.remove()
    worst = max(changes)
    parts.append("logits change with fc's output scaled: " + ", ".join(
        f"x{f:g}: {c:.2g}" for f, c in zip(SCALES, changes)))
    verdict.measured["scale_change"] = worst
    if worst <= SCALE_FREE:
        return True
    if worst >= SCALE_SEEN:
        return False
    return None


def _unused_norms(lab: Lab, verdict: Verdict, parts: list[str]) -> list[str] | None:
    """The drafter's norms with exactly zero gradient; None when it could not be read."""
    try:
        params = lab.subject.parameters()
    except Exception as exc:  # noqa: BLE001 - the scale half still stands
        verdict.not_exercised.append(f"which norms are trained (parameters() failed: {type(exc).__name__})")
        return None
    norms = {n: p for n, p in params.items() if isinstance(p, Tensor) and p.requires_grad and _is_norm_weight(n, p)}
    if not norms:
        verdict.not_exercised.append("which norms are trained (no trainable norm weight was found among the subject's "
                                     "parameters)")
        return None
    try:
        loss = lab.subject.loss(lab.batch, ProbeHooks())
    except Exception as exc:  # noqa: BLE001 - e.g. an entry without loss(): the scale half still stands
        verdict.not_exercised.append(f"which norms are trained (loss() failed: {type(exc).__name__})")
        return None
    if not isinstance(loss, Tensor) or not loss.requires_grad:
        verdict.not_exercised.append("which norms are trained (the loss has no gradient)")
        return None
    grads = torch.autograd.grad(loss, list(norms.values()), allow_unused=True)
    sizes = {n: (0.0 if g is None else g.abs().max().item()) for n, g in zip(norms, grads)}
    if not any(sizes.values()):
        verdict.not_exercised.append("which norms are trained (no drafter norm gets any gradient: nothing to compare)")
        return None
    smallest = sorted(sizes.items(), key=lambda kv: kv[1])[:3]
    parts.append(f"largest |d loss / d weight| of each of the drafter's {len(sizes)} norm weights; the smallest: "
                 + ", ".join(f"{n}: {v:.2g}" for n, v in smallest))
    verdict.measured["norm_gradients"] = sizes
    verdict.coverage["norms_checked"] = sorted(norms)
    return [n for n, v in sizes.items() if v == 0.0]


def _eps_text(off: dict[str, float]) -> str:
    values = sorted({float(f"{v:.2g}") for v in off.values()})
    return " / ".join(f"{v:g}" for v in values)


def _drafter_norms(lab: Lab) -> dict[str, nn.Module]:
    """The drafter's norm modules, by name: leaves with a 1-D weight, no bias, and "norm" in their class or attribute
    name. From the subject's whole model where it has one (fc's norm and the final norm are outside the layers), else
    from its layers."""
    root = getattr(lab.subject, "model", None)
    if isinstance(root, nn.Module):
        named = list(root.named_modules())
    else:
        named = [(f"layers.{i}.{n}", m) for i, layer in enumerate(lab.subject.draft_layers())
                 for n, m in layer.named_modules()]
    norms = {}
    for name, module in named:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, Tensor) or getattr(module, "bias", None) is not None:
            continue
        if any(True for _ in module.children()):  # a leaf: a norm holds no modules
            continue
        # the module whose weight the gradient half counts as a norm's, or one whose class says it is a norm
        if _is_norm_weight(f"{name}.weight", weight) or (weight.dim() == 1 and "norm" in type(module).__name__.lower()):
            norms[name] = module
    return norms


def _recorded_eps(lab: Lab, root: Any) -> tuple[float | None, str]:
    """The eps the drafter's config records (what a server builds its norms with); None where it records none.
    The target's eps is no substitute: a hand-written drafter with a constant eps equal to its real target's is
    right for its run, and the probe's target has an eps no real one has."""
    value = lab.info.get("rms_norm_eps")
    if isinstance(value, (int, float)):
        return float(value), "the subject's description"
    # the model's own config, or the first submodule's that has one (SpecForge's training wrapper holds the drafter,
    # whose config is the one saved)
    for module in root.modules() if isinstance(root, nn.Module) else ():
        config = getattr(module, "config", None)
        for holder in (config, getattr(config, "transformer_layer_config", None)):
            value = getattr(holder, "rms_norm_eps", None)
            if isinstance(value, (int, float)):
                return float(value), "the drafter's config"
    return None, "the drafter records no eps"


def _measured_eps(module: nn.Module) -> float | None:
    """eps from y(cx) / y(x) on a zero-mean input of mean square 1 (so an RMSNorm and a LayerNorm read alike);
    None where the module is not a scale-free norm of its input (not a norm, or it failed)."""
    size = module.weight.shape[0]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 4, size, generator=g)
    x = x - x.mean(-1, keepdim=True)
    x = (x / x.pow(2).mean(-1, keepdim=True).sqrt()).to(module.weight.dtype)
    try:
        with torch.no_grad():
            y, y_twice, y_small = (module(x * f).float() for f in (1.0, 2.0, EPS_INPUT_SCALE))
    except Exception:  # noqa: BLE001 - a module that cannot be called alone is not measured
        return None
    energy = (y * y).sum()
    if not torch.isfinite(energy) or energy.item() == 0.0 or influence(y, y_twice) > SCALE_FREE:
        return None
    r2 = ((y_small * y).sum() / energy).item() ** 2
    c2 = EPS_INPUT_SCALE ** 2
    if not math.isfinite(r2) or r2 <= c2:
        return None
    return c2 * (1.0 - r2) / (r2 - c2)


def _norms_off_eps(lab: Lab, verdict: Verdict, parts: list[str]) -> dict[str, float] | None:
    """The drafter's norms whose measured eps is not the recorded one; None when none could be measured."""
    try:
        norms = _drafter_norms(lab)
    except Exception as exc:  # noqa: BLE001 - the other halves still stand
        verdict.not_exercised.append(f"the norms' eps (the drafter's modules could not be listed: {type(exc).__name__})")
        return None
    want, source = _recorded_eps(lab, getattr(lab.subject, "model", None))
    measured = {n: e for n, m in norms.items() if (e := _measured_eps(m)) is not None}
    if not measured:
        verdict.not_exercised.append("the norms' eps (no norm module of the drafter could be called alone)")
        return None
    verdict.measured["eps_measured"] = measured
    verdict.coverage["eps_norms"] = sorted(measured)
    if want is None:
        # informational: what the drafter computes, with nothing recorded to hold it to
        verdict.coverage["eps_compared"] = "no: the drafter records no eps for a server to build"
        parts.append(f"eps of {len(measured)} norm modules from y(1e-3 x) / y(x): {_eps_text(measured)} "
                     "(the drafter records none to compare with)")
        return {}
    verdict.measured["eps_expected"] = want
    off = {n: e for n, e in measured.items() if abs(e - want) > EPS_TOLERANCE * want}
    parts.append(f"eps of {len(measured)} norm modules from y(1e-3 x) / y(x): "
                 + (f"{len(off)} at {_eps_text(off)}, " if off else "")
                 + f"{len(measured) - len(off)} at {want:g} ({source})")
    return off
