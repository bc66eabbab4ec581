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

Layout: lab.py (the Lab, thresholds, influence), one module per experiment family (layers, attention,
context, positions, norms, inputs, loss, sampling, optimizer), and here the registry and the runs over a subject
and its variants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sleuth.probes.experiments.attention import probe_attention
from sleuth.probes.experiments.context import probe_kv_injection
from sleuth.probes.experiments.inputs import probe_block_inputs
from sleuth.probes.experiments.lab import EFFECT, NO_EFFECT, Lab, influence, randomize_drafter, seen
from sleuth.probes.experiments.layers import probe_layers_read, reference_layer_ids
from sleuth.probes.experiments.loss import probe_loss
from sleuth.probes.experiments.norms import probe_fc_norm
from sleuth.probes.experiments.optimizer import probe_frozen
from sleuth.probes.experiments.positions import probe_positions
from sleuth.probes.experiments.sampling import probe_anchor_sampling
from sleuth.probes.verdict import PATH_CHECK_INVARIANTS, Expectations, Verdict


def run_experiments(lab: Lab, decides: dict[str, tuple[str, ...]],
                    absent: dict[str, Any] | None = None) -> tuple[list[Verdict], dict[str, float]]:
    """Every experiment on one lab; one that raises gives `unknown` verdicts with the error, and one that
    needs a protocol method the subject does not offer (`absent`: method -> NotProvided, filled in as
    experiments find more) gives `unknown` with "not provided by the entry: ...", the others still run."""
    import time

    from sleuth.probes.protocol import PROBE_NEEDS, NotProvided

    absent = {} if absent is None else absent
    verdicts: list[Verdict] = []
    seconds: dict[str, float] = {}
    # First, while the weights are the built ones (the optimizer step comes last): the subject's own checks of
    # the paths its run takes that the experiments bypass (`path_checks(lab)`, optional).
    start = time.perf_counter()
    checks = _path_checks(lab)
    if checks is not None:
        seconds["path-checks"] = round(time.perf_counter() - start, 3)
    for name, experiment in EXPERIMENTS.items():
        start = time.perf_counter()
        lacking = [absent[m] for m in PROBE_NEEDS.get(name, ()) if m in absent]
        try:
            if lacking:
                raise lacking[0]
            found = experiment(lab)
        except Exception as exc:
            if isinstance(exc, NotProvided):
                absent.setdefault(exc.method, exc)
                reason = exc.reason
            else:
                text = str(exc).strip().splitlines()
                reason = f"the experiment failed: {type(exc).__name__}" + (f": {text[0]}" if text else "") \
                    + _raised_at(exc)
            found = [Verdict(invariant=i, status="unknown", experiment=name, hypothesis="", perturbed="",
                             measurement="", threshold="", reason=reason) for i in decides[name]]
        seconds[name] = round(time.perf_counter() - start, 3)
        for verdict in found:
            verdict.seconds = seconds[name]
        verdicts += found
    return _merge_path_checks(verdicts, checks or []), seconds


def _path_checks(lab: Lab) -> list[Verdict] | None:
    """The subject's `path_checks(lab)`: verdicts on code its run takes that the experiments cannot drive
    (SpecForge's chunked objective, its capture-layer rule), or None when it offers none."""
    found = getattr(lab.subject, "path_checks", None)
    if not callable(found):
        return None
    try:
        return list(found(lab) or [])
    except NotImplementedError:
        return None
    except Exception as exc:  # a check that cannot run leaves the experiments' verdicts as they are
        return [Verdict(invariant="", status="unknown", experiment="path-checks", hypothesis="", perturbed="",
                        measurement="", threshold="", reason=f"the path checks failed: {type(exc).__name__}: {exc}")]


def _merge_path_checks(verdicts: list[Verdict], checks: list[Verdict]) -> list[Verdict]:
    """Each path check joins the verdict on its invariant, as a variant does: its mismatch is the verdict's
    (a defect on the path the run takes); otherwise its result goes into the coverage of every verdict of that
    experiment."""
    by_invariant = {v.invariant: v for v in verdicts}
    for check in checks:
        main = by_invariant.get(check.invariant)
        if main is None:
            # No experiment spoke to it (an invariant only path checks decide, or a failed experiment's): the
            # check alone does, a `match` only as far as its own coverage reaches (its not_exercised gates it).
            if check.invariant and (check.status == "mismatch" or check.invariant in PATH_CHECK_INVARIANTS):
                verdicts.append(check.gated())
                by_invariant[check.invariant] = check
            continue
        said = check.status + (f" ({check.observed or check.reason})" if check.observed or check.reason else "")
        for verdict in verdicts:
            if verdict.experiment == main.experiment:
                verdict.coverage = dict(verdict.coverage)  # one experiment's verdicts may share a coverage dict
                verdict.coverage.setdefault("path_checks", {})[check.experiment] = said
        if check.status == "mismatch" and main.status != "mismatch":
            main.status, main.reason, main.observed = "mismatch", "", check.observed
            main.measurement = f"{main.measurement}; {check.experiment}: {check.measurement}"
            main.expected, main.fix, main.config_bound = check.expected, check.fix, []
            main.coverage[check.experiment] = check.coverage
    return verdicts


def _raised_at(exc: BaseException) -> str:
    """Where it was raised (file name and line): the entry's code or an experiment's, for whoever fixes it."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return f" (raised at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno})" if frames else ""


def probe_variants(subject: Any, verdicts: list[Verdict], expectations: Expectations, seed: int,
                   decides: dict[str, tuple[str, ...]]) -> list[Verdict]:
    """The main verdicts, each joined with the same experiment on the subject's variants (`variants()`:
    the other paths the same code takes under other settings, exercised when no run config fixes the path,
    e.g. speculators' fixed-exponential weighting beside its D-PACE default). A variant's mismatch is the
    verdict's (it is a defect of the code, on a path other runs take); otherwise the main verdict stands, and
    its coverage lists what each variant said."""
    from sleuth.probes.protocol import NotProvided, PartialSubject
    from sleuth.probes.target import make_target

    found = getattr(subject, "variants", None)
    try:
        variants = found() if callable(found) else {}
    except NotImplementedError:  # a scaffold's TODO: no variants, the main verdicts stand
        variants = {}
    by_invariant = {v.invariant: v for v in verdicts}
    for verdict in verdicts:  # one experiment's verdicts may share a coverage dict: each gets its own variants
        verdict.coverage = dict(verdict.coverage)
    for label, variant in (variants or {}).items():
        try:
            variant = PartialSubject(variant)  # a variant is probed as its subject is: only what it offers
            info = dict(variant.describe())
            target = make_target(int(info["num_target_layers"]), seed)
            torch.manual_seed(seed)
            variant.build(target)
            randomize_drafter(variant, target, seed + 7)
            absent = {method: NotProvided(method) for method in variant.missing()}
            other, _ = run_experiments(Lab(variant, info, target, expectations, seed), decides, absent)
        except Exception as exc:  # a variant that does not build leaves the main verdicts as they are
            for verdict in verdicts:
                verdict.coverage.setdefault("variants", {})[label] = f"not built: {type(exc).__name__}"
            continue
        for extra in other:
            main = by_invariant.get(extra.invariant)
            if main is None:
                continue
            main.coverage.setdefault("variants", {})[label] = extra.status + (
                f" ({extra.reason[:200]})" if extra.status == "unknown" and extra.reason else "")
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
    "fc-norm": probe_fc_norm,
    "block-inputs": probe_block_inputs,  # before loss-gradient: it leaves slot 0's tokens in lab.facts
    "loss-gradient": probe_loss,  # before anchor-sampling: it leaves whether padded anchors are trained
    "anchor-sampling": probe_anchor_sampling,
    "optimizer-step": probe_frozen,  # last: it changes the weights
}

__all__ = ["EFFECT", "EXPERIMENTS", "NO_EFFECT", "Lab", "influence", "probe_variants", "randomize_drafter",
           "reference_layer_ids", "run_experiments", "seen"]
