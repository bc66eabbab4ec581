"""Regression: trajectories aligned by step, smoothed, compared against a noise-aware threshold.

Synthetic trajectories with known answers: straight lines (every number can be worked out by hand),
saturating curves with Gaussian noise at different logging intervals, spikes, too few points, and runs
that must not be compared.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from test_runs import metrics_rows, write_run

from sleuth.regression import (
    RegressionRefused,
    compare_metric,
    comparability_problem,
    find_regression,
    noise_level,
    rolling_median,
)
from sleuth.runs import read_run

STEPS_EVERY_10 = list(range(10, 301, 10))
STEPS_EVERY_25 = list(range(25, 301, 25))


def saturating(steps: list[int], top: float, rng: np.random.Generator, noise: float = 0.02) -> list[float]:
    """A learning curve top * (1 - exp(-step / 80)) plus Gaussian noise."""
    return [top * (1 - math.exp(-s / 80)) + float(rng.normal(0, noise)) for s in steps]


# --- numerics against hand-worked answers --------------------------------------------------------------


def test_straight_lines_give_the_hand_worked_gap_and_reach_step() -> None:
    # Run: acc = 0.001 * step; baseline: twice as fast. At step 300 the run has 0.3 and the baseline 0.6;
    # the baseline had 0.3 at step 150, the run needed 300 steps: 2.0x.
    run = (STEPS_EVERY_10, [0.001 * s for s in STEPS_EVERY_10])
    base = (STEPS_EVERY_10, [0.002 * s for s in STEPS_EVERY_10])
    c = compare_metric("acc", run, base, run_name="v5", baseline_name="v3")
    assert c.verdict == "regression"
    assert c.gaps[-1].step == 300
    assert c.gaps[-1].run == pytest.approx(0.3)
    assert c.gaps[-1].baseline == pytest.approx(0.6)
    assert c.gaps[-1].gap == pytest.approx(0.3)
    assert c.run_final == pytest.approx(0.3)
    assert c.baseline_reached_step == 150
    assert c.run_reached_step == 300
    assert c.speedup == pytest.approx(2.0)
    assert "at step 300 acc 0.3 vs v3 0.6" in c.sentence
    assert "v3 reached v5's final acc 0.3 at step 150, v5 needed 300: 2.0x" in c.sentence


def test_gaps_are_reported_at_a_few_steps_ending_with_the_runs_last() -> None:
    run = (STEPS_EVERY_10, [0.001 * s for s in STEPS_EVERY_10])
    base = (STEPS_EVERY_25, [0.002 * s for s in STEPS_EVERY_25])
    c = compare_metric("acc", run, base)
    steps = [g.step for g in c.gaps]
    assert 3 <= len(steps) <= 4 and steps == sorted(steps) and steps[-1] == 300
    for gap in c.gaps:  # interpolation of a straight line is exact: gap = 0.001 * step
        assert gap.gap == pytest.approx(0.001 * gap.step)


def test_loss_is_lower_is_better() -> None:
    # Run loss 5 - 0.005 s, baseline 5 - 0.01 s: the run is worse; the baseline reached the run's final
    # loss 3.5 at step 150.
    run = (STEPS_EVERY_10, [5 - 0.005 * s for s in STEPS_EVERY_10])
    base = (STEPS_EVERY_10, [5 - 0.01 * s for s in STEPS_EVERY_10])
    c = compare_metric("loss", run, base)
    assert not c.higher_is_better
    assert c.verdict == "regression"
    assert c.gaps[-1].gap == pytest.approx(1.5)
    assert c.baseline_reached_step == 150


def test_a_baseline_that_never_got_there_is_said_so() -> None:
    run = (STEPS_EVERY_10, [0.002 * s for s in STEPS_EVERY_10])
    base = (STEPS_EVERY_10, [0.001 * s for s in STEPS_EVERY_10])
    c = compare_metric("acc", run, base, run_name="v6", baseline_name="v3")
    assert c.verdict == "improvement"
    assert c.baseline_reached_step is None and c.speedup is None
    assert "v3 never reached v6's final acc 0.6" in c.sentence


def test_rolling_median_keeps_a_straight_line_and_removes_a_spike() -> None:
    steps = np.arange(10, 310, 10, dtype=float)
    line = 0.001 * steps
    smoothed, window = rolling_median(steps, line)
    assert window >= 3
    np.testing.assert_allclose(smoothed, line, atol=1e-12)
    spiked = line.copy()
    spiked[15] = 5.0
    spiked[-1] = -5.0  # a spike at the very end must not become the run's "final value"
    smoothed, _ = rolling_median(steps, spiked)
    # A median replaces a spike by a neighbour's value: off the line by at most one logging step's rise.
    np.testing.assert_allclose(smoothed, line, atol=0.01 + 1e-12)


def test_noise_level_recovers_the_noise_of_a_noisy_curve() -> None:
    rng = np.random.default_rng(1)
    steps = list(range(1, 401))
    values = np.array(saturating(steps, 0.5, rng, noise=0.03))
    assert noise_level(values) == pytest.approx(0.03, rel=0.2)
    assert noise_level(np.array([1.0, 2.0, 3.0])) == 0.0  # too short to tell noise from trend


# --- verdicts on noisy trajectories at different logging intervals ---------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_same_curve_at_different_intervals_with_noise_is_no_regression(seed: int) -> None:
    rng = np.random.default_rng(seed)
    run = (STEPS_EVERY_10, saturating(STEPS_EVERY_10, 0.5, rng))
    base = (STEPS_EVERY_25, saturating(STEPS_EVERY_25, 0.5, rng))
    c = compare_metric("acc", run, base)
    assert c.verdict == "no_regression", c.sentence
    assert c.threshold is not None and c.threshold > abs(c.tail_gap or 0)


@pytest.mark.parametrize("seed", range(10))
def test_a_true_regression_is_found_through_the_noise(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    run = (STEPS_EVERY_10, saturating(STEPS_EVERY_10, 0.40, rng))
    base = (STEPS_EVERY_25, saturating(STEPS_EVERY_25, 0.50, rng))
    c = compare_metric("acc", run, base)
    assert c.verdict == "regression", c.sentence
    # The true gap at step 300 is 0.1 * (1 - exp(-300/80)) = 0.098; smoothing keeps it within about
    # two standard deviations of the smoothed difference (noise 0.02 per point).
    true_gap = 0.1 * (1 - math.exp(-300 / 80))
    assert c.gaps[-1].gap == pytest.approx(true_gap, abs=0.05)
    assert c.tail_gap == pytest.approx(true_gap, abs=0.03)


def test_a_single_spike_does_not_make_a_regression() -> None:
    rng = np.random.default_rng(7)
    run_values = saturating(STEPS_EVERY_10, 0.5, rng)
    run_values[-3] = 0.0  # one bad logging step near the end
    c = compare_metric("acc", (STEPS_EVERY_10, run_values), (STEPS_EVERY_25, saturating(STEPS_EVERY_25, 0.5, rng)))
    assert c.verdict == "no_regression", c.sentence


def test_too_few_points_is_unknown_with_the_reason() -> None:
    c = compare_metric("tau", ([100, 200], [1.5, 2.0]), ([100, 200, 300], [1.5, 2.0, 2.5]), run_name="v5")
    assert c.verdict == "unknown"
    assert c.reason == "too few points: v5 logged tau 2 time(s) (need 3)"


def test_no_overlap_is_unknown_with_the_ranges() -> None:
    c = compare_metric("acc", ([10, 20, 30], [0.1, 0.2, 0.3]), ([100, 200, 300], [0.1, 0.2, 0.3]))
    assert c.verdict == "unknown"
    assert "too few matched steps" in (c.reason or "")


# --- runs: comparability, baseline choice, the overall verdict --------------------------------------------


def _runs(tmp_path: Path, **tops: tuple[float, str]) -> dict[str, Path]:
    """Runs with acc saturating at `top`, created at the given hour, all on the same target and data."""
    rng = np.random.default_rng(0)
    made = {}
    for name, (top, hour) in tops.items():
        rows = metrics_rows(STEPS_EVERY_10, acc=saturating(STEPS_EVERY_10, top, rng),
                            loss=[4 - 2 * top * (1 - math.exp(-s / 80)) for s in STEPS_EVERY_10])
        made[name] = write_run(tmp_path, name, rows=rows, created=f"2026-11-01T{hour}:00:00+00:00")
    return made


def test_picks_the_best_comparable_earlier_run_as_baseline(tmp_path: Path) -> None:
    paths = _runs(tmp_path, v2=(0.45, "08"), v3=(0.55, "09"), v5=(0.40, "10"), v6=(0.70, "11"))
    run = read_run(paths["v5"])
    others = [read_run(p) for name, p in paths.items() if name != "v5"]
    result = find_regression(run, others)
    assert result.baseline == "v3" and result.baseline_source == "auto"
    assert result.verdict == "regression"
    by_name = {c.name: c for c in result.candidates}
    assert by_name["v3"].chosen and not by_name["v2"].chosen
    assert by_name["v2"].comparable and by_name["v2"].score is not None
    assert by_name["v6"].reason == "created after this run"  # better, but later: not a baseline
    assert result.summary.startswith("v5 regressed against v3: at step 300 acc")


def test_incomparable_runs_are_listed_with_the_reason(tmp_path: Path) -> None:
    write_run(tmp_path, "other-target", target_fp="zzzz", created="2026-11-01T08:00:00+00:00")
    write_run(tmp_path, "other-data", data_fp="yyyy", created="2026-11-01T08:00:00+00:00")
    write_run(tmp_path, "other-block", config={"block_size": 16}, created="2026-11-01T08:00:00+00:00")
    run = read_run(write_run(tmp_path, "v5"))
    others = [read_run(tmp_path / n) for n in ("other-target", "other-data", "other-block")]
    result = find_regression(run, others)
    assert result.verdict == "unknown" and result.baseline is None
    reasons = {c.name: c.reason for c in result.candidates}
    assert reasons["other-target"] == "other target (zzzz vs target-sha-aaaa)"
    assert reasons["other-data"] == "other data (yyyy vs data-sha-bbbb)"
    assert reasons["other-block"] == "other block size (16 vs 8)"
    assert "no comparable earlier run" in (result.reason or "")


def test_an_explicit_incomparable_baseline_is_refused(tmp_path: Path) -> None:
    base = read_run(write_run(tmp_path, "b16", config={"block_size": 16}))
    run = read_run(write_run(tmp_path, "v5"))
    refusal = r"baseline b16 cannot be compared with v5: other block size \(16 vs 8\)"
    with pytest.raises(RegressionRefused, match=refusal):
        find_regression(run, [], base)


def test_a_run_without_run_json_cannot_be_compared(tmp_path: Path) -> None:
    run = read_run(write_run(tmp_path, "v5", run_json=False))
    base = read_run(write_run(tmp_path, "v3"))
    assert comparability_problem(run, base) == "cannot tell: v5 has no run.json target.fingerprint"


def test_an_explicit_baseline_may_be_later(tmp_path: Path) -> None:
    paths = _runs(tmp_path, v5=(0.40, "08"), v6=(0.55, "09"))
    result = find_regression(read_run(paths["v5"]), [], read_run(paths["v6"]))
    assert result.baseline == "v6" and result.baseline_source == "explicit"
    assert result.verdict == "regression"


def test_loss_does_not_decide_when_acc_is_there(tmp_path: Path) -> None:
    # Same acc, but the baseline's loss is far lower (e.g. another gamma weights the loss differently).
    rows_run = metrics_rows(STEPS_EVERY_10, acc=[0.001 * s for s in STEPS_EVERY_10], loss=[3.0] * 30)
    rows_base = metrics_rows(STEPS_EVERY_10, acc=[0.001 * s for s in STEPS_EVERY_10], loss=[1.0] * 30)
    run = read_run(write_run(tmp_path, "v5", rows=rows_run))
    base = read_run(write_run(tmp_path, "v3", rows=rows_base))
    result = find_regression(run, [], base)
    verdicts = {c.metric: c.verdict for c in result.metrics}
    assert verdicts == {"acc": "no_regression", "loss": "regression"}
    assert result.verdict == "no_regression"


def test_tau_only_on_eval_rows_is_compared(tmp_path: Path) -> None:
    tau_run = [1.0 + 0.005 * s if s % 100 == 0 else None for s in STEPS_EVERY_10]
    tau_base = [1.0 + 0.01 * s if s % 100 == 0 else None for s in STEPS_EVERY_10]
    acc = [0.001 * s for s in STEPS_EVERY_10]
    run = read_run(write_run(tmp_path, "v5", rows=metrics_rows(STEPS_EVERY_10, acc=acc, tau=tau_run)))
    base = read_run(write_run(tmp_path, "v3", rows=metrics_rows(STEPS_EVERY_10, acc=acc, tau=tau_base)))
    tau = next(c for c in find_regression(run, [], base).metrics if c.metric == "tau")
    assert (tau.run_points, tau.baseline_points) == (3, 3)
    assert tau.verdict == "regression"
    assert tau.gaps[-1].run == pytest.approx(2.5) and tau.gaps[-1].baseline == pytest.approx(4.0)


def test_a_run_without_metrics_is_unknown_with_the_reason(tmp_path: Path) -> None:
    path = write_run(tmp_path, "v5")
    (path / "metrics.jsonl").unlink()
    base = read_run(write_run(tmp_path, "v3", created="2026-10-01T10:00:00+00:00"))
    result = find_regression(read_run(path), [base])
    assert result.verdict == "unknown"
    assert result.reason == "v5 logged no acc, streak, tau or loss to compare"


def test_reached_step_is_an_observed_step_not_an_extrapolated_edge() -> None:
    # A saturating baseline (tau of v3 in the demo): the smoothed curve's leading edge is a fitted line that
    # runs ahead of the first logged values. "Reached 2.27" must be where a logged value got there.
    steps = list(range(25, 325, 25))
    base = (steps, [1.56, 2.57, 4.63, 5.39, 5.64, 5.72, 5.57, 5.47, 5.57, 5.47, 5.69, 5.63])
    run = (steps, [1.20, 1.59, 2.10, 2.16, 2.27, 2.27, 2.27, 2.27, 2.28, 2.27, 2.27, 2.27])
    c = compare_metric("tau", run, base, run_name="v5", baseline_name="v3")
    assert c.baseline_reached_step == 50  # logged 1.56 at step 25 is below 2.27, whatever the fit says
    assert c.run_reached_step == 125
    assert c.speedup == 2.5
