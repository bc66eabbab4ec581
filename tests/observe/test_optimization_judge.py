"""The optimizer and schedule rules (torch-free): configured values read from the command, horizons judged only
where the run names them, a malformed observation never a crash."""

from __future__ import annotations

import json
import math
from pathlib import Path

from sleuth.observe.optimization_judge import (
    GROUPS,
    HORIZON,
    OPTIMIZATION_INVARIANTS,
    SCHEDULE,
    horizon_hint,
    judge_optimization,
    run_configuration,
)


def cosine(total: int, warmup: int, *, period: int | None = None, peak: float = 1e-3, length: int = 400) -> dict:
    """A warmup then a cosine over `period` steps (the steps after warmup by default), clamped at 0 from then on."""
    period = period if period is not None else total - warmup
    path = []
    for step in range(length):
        if step < warmup:
            path.append(peak * step / warmup)
        else:
            progress = min(1.0, (step - warmup) / period)
            path.append(peak * 0.5 * (1 + math.cos(math.pi * progress)))
    top = max(path)
    first = next(i for i, v in enumerate(path) if v >= top * (1 - 1e-9))
    floor = min(path[first:])
    floor_first = first + next(i for i, v in enumerate(path[first:]) if v <= floor + 1e-12)
    return {"points": [[i, v] for i, v in enumerate(path)], "length": length, "peak": top, "peak_first": first,
            "floor": floor, "floor_first": floor_first}


def scheduler(trajectory: dict, *, before: int = 0, after: int = 1, attributes: dict | None = None,
              backward: int = 1) -> dict:
    """A scheduler stepped `before` times ahead of the first optimizer step (over `backward` backward calls) and
    `after` times after it."""
    return {"class": "LambdaLR", "site": "train.py:9", "birth_epoch": 0, "baseline_epoch": 0,
            "finish_epoch": before + after, "positions": [{"when": "pre", "step": 0, "epoch": before,
                                                           "backward_calls": backward},
                                                          {"when": "post", "step": 1, "epoch": before}],
            "attributes": attributes or {"class": "LambdaLR"}, "trajectory": trajectory}


def observation(schedulers: list[dict], configured: dict, groups: list[dict] | None = None) -> dict:
    groups = groups or [{"built": {"lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8},
                         "kinds": {"matrices": {"tensors": 2, "examples": ["fc.weight"]}}}]
    return {"optimization": {"optimizers": [{"class": "AdamW", "class_lr_default": 1e-3, "groups": groups, "steps": 1,
                                             "backward_per_step": [1]}],
                             "schedulers": schedulers, "clips": [], "loads": []},
            "configured": configured}


def said(value: float, key: str) -> dict:
    return {"value": value, "key": key, "source": "run.json (named by the command)"}


def by_id(obs: dict) -> dict:
    return {v.invariant: v for v in judge_optimization(obs)}


def test_the_configuration_comes_from_the_arguments_and_the_files_they_name(tmp_path: Path) -> None:
    (tmp_path / "cfg.json").write_text(json.dumps({"optim": {"lr": 2e-4, "muon_lr": 2e-3, "min_lr": 1e-6,
                                                             "weight_decay": 0.1},
                                                   "schedule": {"warmup_ratio": 0.1}, "num_epochs": 3, "steps": 9,
                                                   "max_steps": 500}))
    found = run_configuration(["python", "train.py", "--config", "cfg.json", "--learning-rate=3e-4"], tmp_path)
    assert [(r["key"], r["value"]) for r in found["lr"]] == [("learning_rate", 3e-4)]  # the arguments win
    assert found["total"]["value"] == 500  # `steps` beside an epoch count may be per epoch: max_steps is the total
    assert found["weight_decay"][0]["value"] == 0.1
    assert horizon_hint(found) == "500,50"
    rates = run_configuration(["python", "train.py", "cfg.json"], tmp_path)["lr"]
    assert sorted(r["key"] for r in rates) == ["lr", "muon_lr"]  # min_lr is a floor, not a group's rate
    assert run_configuration(["python", "train.py"], tmp_path) == {}
    assert horizon_hint({}) == ","


def test_a_cosine_over_the_steps_after_warmup_matches_and_the_wrong_periods_do_not() -> None:
    configured = {"total": said(100, "max_steps"), "warmup": said(10, "warmup_steps")}
    right = by_id(observation([scheduler(cosine(100, 10))], configured))[HORIZON]
    assert right.status == "match" and "floor 0 is reached at the last step (100)" in right.observed
    whole = by_id(observation([scheduler(cosine(100, 10, period=100))], configured))[HORIZON]
    assert whole.status == "mismatch" and "comes only at optimizer step 110" in whole.observed
    short = by_id(observation([scheduler(cosine(100, 10, period=60))], configured))[HORIZON]
    assert short.status == "mismatch" and "floor 0 at optimizer step 70, before the run's last step 100" in short.observed
    late = by_id(observation([scheduler(cosine(100, 20, period=80))], configured))[HORIZON]
    assert late.status == "mismatch" and "peak 0.001 at optimizer step 20, not at the end of the configured warmup" in late.observed


def test_a_horizon_sleuth_would_guess_is_unknown_and_the_schedulers_own_total_is_gated() -> None:
    bare = by_id(observation([scheduler(cosine(100, 10))], {}))[HORIZON]
    assert bare.status == "unknown" and "the horizon would be a guess" in bare.reason
    own = {"class": "LambdaLR", "lr_lambda0": {"num_warmup_steps": 10, "num_training_steps": 100}}
    stated = by_id(observation([scheduler(cosine(100, 10), attributes=own)], {}))[HORIZON]
    assert stated.status == "unknown" and "whether 100 steps is the run's" in stated.reason
    assert "the exercised part agrees" in stated.reason
    # the scheduler's own total still finds a schedule that contradicts it
    off = by_id(observation([scheduler(cosine(100, 10, period=100), attributes=own)], {}))[HORIZON]
    assert off.status == "mismatch"
    # no warmup named: what the run does after its peak is checked, the warmup's length is not claimed
    partial = by_id(observation([scheduler(cosine(100, 10))], {"total": said(100, "max_steps")}))[HORIZON]
    assert partial.status == "unknown" and "the warmup length" in partial.reason


def test_scheduler_steps_per_optimizer_step() -> None:
    configured = {"total": said(100, "max_steps"), "warmup": said(10, "warmup_steps")}
    twice = by_id(observation([scheduler(cosine(100, 10), after=2)], configured))[HORIZON]
    assert twice.status == "mismatch" and "advances 2 steps per optimizer step" in twice.observed
    # once before and once after the first step with one backward: the order or a double step, not told apart
    ambiguous = by_id(observation([scheduler(cosine(100, 10), before=1, after=1)], configured))[HORIZON]
    assert ambiguous.status == "unknown" and "--observe-steps 2" in ambiguous.reason
    never = by_id(observation([scheduler(cosine(100, 10), after=0)], configured))[HORIZON]
    assert never.status == "unknown" and "not stepped" in never.reason
    # stepped with each of 4 micro-batches: the schedule runs 4 times too fast...
    micro = by_id(observation([scheduler(cosine(100, 10, length=700), before=3, after=1, backward=4)],
                              configured))[HORIZON]
    assert micro.status == "mismatch" and "advances 4 steps" in micro.observed
    # ...unless it was built over the micro-batches (4 x the steps): it still follows the run's horizon
    scaled = by_id(observation([scheduler(cosine(400, 40, length=700), before=3, after=1, backward=4)],
                               configured))[HORIZON]
    assert scaled.status == "match" and "its lengths scaled to match" in scaled.observed


def test_groups_against_the_configured_values() -> None:
    configured = {"lr": [said(5e-4, "lr")], "weight_decay": [said(0.01, "weight_decay")]}
    matrices = {"matrices": {"tensors": 2, "examples": ["fc.weight"]}}
    vectors = {"vectors": {"tensors": 2, "examples": ["norm.weight"]}}
    clean = [{"built": {"lr": 5e-4, "weight_decay": 0.01}, "kinds": matrices},
             {"built": {"lr": 5e-4, "weight_decay": 0.0}, "kinds": vectors},
             {"built": {"lr": 0.0, "weight_decay": 0.0}, "kinds": {"frozen": {"tensors": 3, "examples": ["embed"]}}}]
    assert by_id(observation([], configured, clean))[GROUPS].status == "match"
    default = [{"built": {"lr": 1e-3, "weight_decay": 0.01}, "kinds": matrices}]
    found = by_id(observation([], configured, default))[GROUPS]
    assert found.status == "mismatch" and "the optimizer class's own default" in found.observed
    undecayed = [{"built": {"lr": 5e-4, "weight_decay": 0.0}, "kinds": matrices}]
    assert "holds matrices" in by_id(observation([], configured, undecayed))[GROUPS].observed
    # decay on the norms too (speculators' AdamW does the same): no alarm
    decayed = [{"built": {"lr": 5e-4, "weight_decay": 0.01}, "kinds": {**matrices, **vectors}}]
    assert by_id(observation([], configured, decayed))[GROUPS].status == "match"
    assert by_id(observation([], {}, clean))[GROUPS].status == "unknown"


def test_a_malformed_observation_is_unknown_never_a_crash() -> None:
    for broken in ({}, {"optimization": 3}, {"optimization": {"optimizers": "x", "schedulers": [{"trajectory": 5}]}},
                   {"optimization": {"optimizers": [{"groups": [{"built": "x", "kinds": 4}]}],
                                     "schedulers": [{"positions": "x", "trajectory": {"points": 3}}],
                                     "loads": [{"after_steps": 0, "kind": "optimizer", "state_step": "x"}]},
                    "configured": {"lr": [{"value": "a"}], "total": {"value": []}}}):
        verdicts = judge_optimization(broken)
        assert [v.invariant for v in verdicts] == list(OPTIMIZATION_INVARIANTS)
        assert not any(v.status == "match" for v in verdicts)
    assert by_id({"optimization": {"error": "boom"}})[SCHEDULE].status == "unknown"


def test_each_optimizers_scheduler_follows_the_horizon_and_a_resumed_build_counts_from_its_step() -> None:
    configured = {"total": said(100, "max_steps"), "warmup": said(10, "warmup_steps")}
    both = by_id(observation([scheduler(cosine(100, 10)), scheduler(cosine(100, 10))], configured))[HORIZON]
    assert both.status == "match"
    one_off = by_id(observation([scheduler(cosine(100, 10)), scheduler(cosine(100, 10, period=100))], configured))
    assert one_off[HORIZON].status == "mismatch"
    # built with last_epoch=29 on resume: the copy starts at step 30 of the schedule, the warmup is not seen
    path = cosine(100, 10)
    tail = {"points": [[i - 30, v] for i, v in path["points"][30:]], "length": path["length"] - 30,
            "peak": path["points"][30][1], "peak_first": 0, "floor": 0.0, "floor_first": 70}
    resumed = {**scheduler(tail), "birth_epoch": 30}
    found = by_id(observation([resumed], configured))[HORIZON]
    assert found.status == "unknown" and "built resumed at its step 30" in found.reason
    assert "floor 0 is reached at the last step (100)" in found.reason


def test_a_resume_restores_both_the_optimizer_and_the_schedule() -> None:
    def resumed(loads: list[dict], first_epoch: int) -> dict:
        obs = observation([scheduler(cosine(100, 10), before=first_epoch)], {})
        obs["optimization"]["loads"] = loads
        obs["optimization"]["schedulers"][0]["baseline_epoch"] = first_epoch
        return by_id(obs)[SCHEDULE]

    optimizer = {"kind": "optimizer", "after_steps": 0, "state_step": 30.0}
    schedule = {"kind": "scheduler", "after_steps": 0, "last_epoch": 30}
    both = resumed([optimizer, schedule], 30)
    assert both.status == "unknown" and "resumed: optimizer state at step 30, LambdaLR at step 30" in both.reason
    restarted = resumed([optimizer], 0)
    assert restarted.status == "mismatch" and "starts the first step at its own step 0" in restarted.observed
    fresh = resumed([schedule], 30)
    assert fresh.status == "mismatch" and "its moments start fresh" in fresh.observed


def test_decay_on_the_vectors_and_none_on_the_matrices_is_swapped_whatever_is_configured() -> None:
    """No recipe decays norms and biases while sparing the 2-D weights: a mismatch even where the decay itself is a
    default in code; the usual split (decay on the weights, none on the vectors) is no alarm."""
    def groups(matrices_decay: float, vectors_decay: float) -> list[dict]:
        return [{"built": {"lr": 1e-3, "weight_decay": vectors_decay}, "kinds": {"vectors": {"tensors": 4}}},
                {"built": {"lr": 1e-3, "weight_decay": matrices_decay}, "kinds": {"matrices": {"tensors": 6}}}]

    swapped = by_id(observation([], {}, groups(0.0, 0.01)))["dflash.optimizer_groups"]
    assert swapped.status == "mismatch" and "the groups are swapped" in swapped.observed
    usual = by_id(observation([], {}, groups(0.01, 0.0)))["dflash.optimizer_groups"]
    assert usual.status == "unknown"
