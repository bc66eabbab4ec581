"""What one optimizer step changes: the embeddings and lm_head must stay the target's."""

from __future__ import annotations


import torch

from sleuth.probes.experiments.lab import Lab, _same
from sleuth.probes.verdict import Verdict


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
