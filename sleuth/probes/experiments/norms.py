"""Whether a norm follows fc, and whether every norm of the drafter is one the loss trains.

Two measurements, because each alone can pass broken code:
  * scale: fc's output multiplied by a constant. With an RMSNorm after fc (DFlash's `hidden_norm`) the drafter's
    logits do not move (a norm is scale invariant, its eps aside); without one they move by O(1).
  * use: d loss / d every trainable norm weight. A norm of the drafter whose gradient is exactly zero is not in
    the computation: another norm plays its role (the output normalised with `hidden_norm` instead of the final
    `norm`, a layer's MLP fed through its `input_layernorm` instead of `post_attention_layernorm`), so one is
    trained for two jobs and the exported one keeps its initial value. The scale test cannot see that: every
    consumer of fc's output is still normalised.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sleuth.probes.experiments.lab import Lab, influence
from sleuth.probes.protocol import ProbeHooks
from sleuth.probes.verdict import Verdict

SCALES = (4.0, 0.5)
# eps of the norm (1e-6 against a mean square of O(1) at these scales) and float32 rounding stay below this ...
SCALE_FREE = 1e-4
# ... and a projection whose scale reaches the logits moves them by far more than this
SCALE_SEEN = 1e-2


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
    elif scale_free and unused is not None:
        verdict.status, verdict.observed = "match", "fc's output is normalised; every drafter norm is trained"
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
