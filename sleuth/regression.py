"""Did this run regress? Align its metric trajectories with an earlier comparable run's and measure the gap.

Runs log at different intervals and every curve is noisy, so a gap is only called a regression when it is
bigger than the noise says it could be by chance:

1. each series is smoothed with a centred rolling median (robust to spikes; the window grows with the
   number of points) and its noise is estimated from the median absolute deviation of second
   differences (they cancel a smooth trend, not white noise);
2. both smoothed series are linearly interpolated onto the union of their logged steps inside the range
   both cover, so a run logged every 10 steps compares with one logged every 25;
3. the verdict uses the median gap over the last third of that range: a regression when it exceeds
   `NOISE_K` times the noise of that gap (each series' noise over the points it averages), with a small
   relative floor so that noiseless synthetic curves do not flag a rounding error;
4. "how much slower": the first step at which the smoothed baseline reached the run's final smoothed
   value (for loss: came down to it), against the step the run itself first got there.

Only comparable runs are compared: same target (fingerprint), same data (fingerprint), same block size.
Without an explicit baseline, the candidates are the comparable runs created before this one, and the
baseline is the one furthest ahead of the run over the last third of their matched steps.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, Field

from sleuth.runs import RunInfo

METRICS = ("acc", "streak", "tau", "loss", "val_acc", "val_loss")
LOWER_IS_BETTER = frozenset({"loss", "val_loss"})  # val_*: the `split: val` rows (held-out data)
# Loss scales with the loss weighting (gamma, CE vs KL), which comparable runs may legitimately differ in;
# the acceptance metrics do not, so they decide the verdict and loss only decides when none is available.
DECIDING_METRICS = ("acc", "streak", "tau", "val_acc")
MIN_POINTS = 3
_EDGE_FIT_POINTS = 7
# Fewer second differences than this give a noise estimate too rough to trust alone.
_RELIABLE_NOISE_DOF = 10
NOISE_K = 3.0
RELATIVE_FLOOR = 0.02
# Efficiency of the median against the mean for Gaussian noise: a median of w points has the noise of a
# mean of w / 1.57 points.
_MEDIAN_NOISE_FACTOR = math.sqrt(math.pi / 2)

MetricVerdict = Literal["regression", "improvement", "no_regression", "unknown"]


class RegressionRefused(Exception):
    """An explicitly requested baseline cannot be compared with the run; the message says why."""


class MatchedGap(BaseModel):
    step: int
    run: float = Field(description="the run's smoothed value at this step")
    baseline: float = Field(description="the baseline's smoothed value, interpolated to this step")
    gap: float = Field(description="how much worse the run is (positive: worse; for loss: higher)")


class MetricComparison(BaseModel):
    metric: str
    higher_is_better: bool
    verdict: MetricVerdict
    reason: str | None = None
    run_points: int = 0
    baseline_points: int = 0
    common_range: tuple[int, int] | None = None
    gaps: list[MatchedGap] = Field(default_factory=list, description="at a few steps, the run's last included")
    tail_gap: float | None = Field(None, description="median gap over the last third of the common range")
    noise: float | None = Field(None, description="noise of the difference of the two smoothed series")
    threshold: float | None = None
    run_final_step: int | None = None
    run_final: float | None = Field(None, description="the run's smoothed value at its last logged step")
    baseline_reached_step: int | None = Field(
        None, description="first step at which the smoothed baseline reached the run's final value"
    )
    run_reached_step: int | None = Field(None, description="first step at which the run reached it itself")
    speedup: float | None = Field(None, description="run_reached_step / baseline_reached_step")
    sentence: str = ""


class Candidate(BaseModel):
    name: str
    path: str
    comparable: bool
    reason: str | None = Field(None, description="why it is not comparable, or not usable")
    score: float | None = Field(
        None, description="median lead over the run at matched steps on the ranking metric (higher: better)"
    )
    chosen: bool = False


class Regression(BaseModel):
    run: str
    baseline: str | None = None
    baseline_path: str | None = None
    baseline_source: Literal["explicit", "auto"] | None = None
    verdict: MetricVerdict
    reason: str | None = None
    metrics: list[MetricComparison] = Field(default_factory=list)
    candidates: list[Candidate] = Field(default_factory=list)
    summary: str = ""


# --- comparability -------------------------------------------------------------------------------------


def comparability_problem(run: RunInfo, other: RunInfo) -> str | None:
    """Why `other` cannot be compared with `run` (other target, data or block size), or None."""
    checks = (
        ("target", run.target_fingerprint, other.target_fingerprint, "run.json target.fingerprint"),
        ("data", run.data_fingerprint, other.data_fingerprint, "run.json data.fingerprint"),
        ("block size", run.block_size, other.block_size, "config.json block_size"),
    )
    for what, mine, theirs, source in checks:
        if mine is None:
            return f"cannot tell: {run.name} has no {source}"
        if theirs is None:
            return f"cannot tell: {other.name} has no {source}"
        if mine != theirs:
            if what == "block size":
                return f"other block size ({theirs} vs {mine})"
            return f"other {what} ({_short(theirs)} vs {_short(mine)})"
    return None


# --- the comparison ------------------------------------------------------------------------------------


def compare_metric(
    metric: str,
    run_series: tuple[list[int], list[float]],
    baseline_series: tuple[list[int], list[float]],
    *,
    run_name: str = "run",
    baseline_name: str = "baseline",
) -> MetricComparison:
    """Compare one metric's trajectory against the baseline's; see the module docstring for the method."""
    higher = metric not in LOWER_IS_BETTER
    result = MetricComparison(metric=metric, higher_is_better=higher, verdict="unknown")
    run_steps, run_values = [float(s) for s in run_series[0]], [float(v) for v in run_series[1]]
    base_steps, base_values = [float(s) for s in baseline_series[0]], [float(v) for v in baseline_series[1]]
    result.run_points, result.baseline_points = len(run_steps), len(base_steps)
    if len(run_steps) < MIN_POINTS or len(base_steps) < MIN_POINTS:
        who, count = (run_name, len(run_steps)) if len(run_steps) < MIN_POINTS else (baseline_name, len(base_steps))
        result.reason = f"too few points: {who} logged {metric} {count} time(s) (need {MIN_POINTS})"
        result.sentence = f"{metric}: not compared, {result.reason}"
        return result

    run_smooth, run_window = rolling_median(run_steps, run_values)
    base_smooth, base_window = rolling_median(base_steps, base_values)
    sign = 1.0 if higher else -1.0

    # What the run reached, and when each run first got there (on the whole baseline, not only the overlap).
    result.run_final_step, result.run_final = int(run_steps[-1]), run_smooth[-1]
    result.run_reached_step = _first_reaching(run_steps, run_smooth, run_values, result.run_final, higher)
    result.baseline_reached_step = _first_reaching(base_steps, base_smooth, base_values, result.run_final, higher)
    if result.baseline_reached_step and result.run_reached_step:
        result.speedup = round(result.run_reached_step / result.baseline_reached_step, 2)

    start, end = max(run_steps[0], base_steps[0]), min(run_steps[-1], base_steps[-1])
    grid = sorted({s for s in run_steps + base_steps if start <= s <= end})
    if len(grid) < MIN_POINTS:
        result.reason = (
            f"too few matched steps: {run_name} covers steps {int(run_steps[0])}-{int(run_steps[-1])}, "
            f"{baseline_name} {int(base_steps[0])}-{int(base_steps[-1])}"
        )
        result.sentence = f"{metric}: not compared, {result.reason}"
        return result
    result.common_range = (int(start), int(end))

    def gap_at(step: float) -> tuple[float, float, float]:
        run_value = interpolate(step, run_steps, run_smooth)
        base_value = interpolate(step, base_steps, base_smooth)
        return run_value, base_value, sign * (base_value - run_value)

    tail_start = end - (end - start) / 3.0
    result.tail_gap = median([gap_at(step)[2] for step in grid if step >= tail_start])
    # The tail gap averages each series over its points in the tail (and each point over its smoothing
    # window): its noise shrinks with the square root of however many raw points that is.
    run_tail_points = sum(1 for s in run_steps if tail_start <= s <= end)
    base_tail_points = sum(1 for s in base_steps if tail_start <= s <= end)
    run_sigma, base_sigma = _pooled_noise(run_values, base_values)
    run_noise = run_sigma * _MEDIAN_NOISE_FACTOR / math.sqrt(max(run_window, run_tail_points))
    base_noise = base_sigma * _MEDIAN_NOISE_FACTOR / math.sqrt(max(base_window, base_tail_points))
    result.noise = math.hypot(run_noise, base_noise)
    scale = max(median([abs(v) for v in run_values]), median([abs(v) for v in base_values]))
    result.threshold = max(NOISE_K * result.noise, RELATIVE_FLOOR * scale, 1e-12)
    if result.tail_gap > result.threshold:
        result.verdict = "regression"
    elif result.tail_gap < -result.threshold:
        result.verdict = "improvement"
    else:
        result.verdict = "no_regression"

    # Report the gap at a few of the run's own steps inside the common range, ending with its last one.
    own = [s for s in run_steps if start <= s <= end]
    picks = sorted({own[min(len(own) - 1, int(q * (len(own) - 1) + 0.5))] for q in (0.25, 0.5, 0.75, 1.0)})
    for step in picks:
        run_value, base_value, gap = gap_at(step)
        result.gaps.append(MatchedGap(step=int(step), run=run_value, baseline=base_value, gap=gap))
    result.sentence = _metric_sentence(result, run_name, baseline_name, int(base_steps[-1]))
    return result


def compare_runs(run: RunInfo, baseline: RunInfo) -> list[MetricComparison]:
    """Every metric both runs logged; a metric neither logged is left out, one only one logged is unknown."""
    comparisons = []
    for metric in METRICS:
        run_series, base_series = run.series(metric), baseline.series(metric)
        if not run_series[0] and not base_series[0]:
            continue
        comparisons.append(
            compare_metric(metric, run_series, base_series, run_name=run.name, baseline_name=baseline.name)
        )
    return comparisons


def find_regression(run: RunInfo, others: list[RunInfo], baseline: RunInfo | None = None, *,
                    skipped: Sequence[Candidate] = ()) -> Regression:
    """Compare `run` with `baseline`, or with the best comparable earlier run among `others`.

    `skipped`: candidates that could not be read at all (a damaged sibling run), listed with their reason.
    Raises RegressionRefused when an explicit `baseline` is not comparable.
    """
    if baseline is not None:
        problem = comparability_problem(run, baseline)
        if problem:
            raise RegressionRefused(f"baseline {baseline.name} cannot be compared with {run.name}: {problem}")
        candidate = Candidate(name=baseline.name, path=str(baseline.path), comparable=True, chosen=True)
        return _verdict(run, baseline, compare_runs(run, baseline), [candidate], "explicit")

    if not any(run.series(metric)[0] for metric in METRICS):
        reason = f"{run.name} logged no acc, streak, tau or loss to compare"
        return Regression(run=run.name, verdict="unknown", reason=reason, summary=reason)
    candidates: list[Candidate] = list(skipped)
    scored: list[tuple[float, RunInfo, list[MetricComparison], Candidate]] = []
    run_created = run.created
    for other in others:
        if other.path.resolve() == run.path.resolve():
            continue
        candidate = Candidate(name=other.name, path=str(other.path), comparable=False)
        candidates.append(candidate)
        other_created = other.created
        if run_created is None or other_created is None:
            who = run.name if run_created is None else other.name
            candidate.reason = f"cannot tell which is earlier: {who} has no creation time in run.json"
            continue
        if other_created >= run_created:
            candidate.reason = "created after this run"
            continue
        problem = comparability_problem(run, other)
        if problem:
            candidate.reason = problem
            continue
        candidate.comparable = True
        comparisons = compare_runs(run, other)
        score = _ranking_score(comparisons)
        if score is None:
            candidate.reason = "comparable, but no metric with enough matched steps"
            continue
        candidate.score = score
        scored.append((score, other, comparisons, candidate))

    if not scored:
        reason = "no comparable earlier run"
        if candidates:
            reason += ": " + "; ".join(f"{c.name}: {c.reason}" for c in candidates)
        else:
            reason += " in the runs directory"
        return Regression(run=run.name, verdict="unknown", reason=reason, candidates=candidates, summary=reason)
    _, best, comparisons, chosen = max(scored, key=lambda item: item[0])
    chosen.chosen = True
    return _verdict(run, best, comparisons, candidates, "auto")


# --- numerics ------------------------------------------------------------------------------------------


def smoothing_window(n: int) -> int:
    """An odd window that grows with the number of points: 3 for short series, at most 11."""
    if n < 3:
        return 1
    window = max(3, min(11, int(round(n / 10))))
    return window if window % 2 else window - 1


def rolling_median(steps: Sequence[float], values: Sequence[float]) -> tuple[list[float], int]:
    """Centred rolling median; returns (smoothed values, window).

    A centred window does not fit at the ends, and cutting it short there would bias a trending curve
    (the last point's median would lag behind the trend, understating the run's final value). The first
    and last half-windows are instead read off a Theil-Sen line (median of pairwise slopes: robust to a
    spike) through the first / last few points.
    """
    n = len(values)
    window = smoothing_window(n)
    values = [float(v) for v in values]
    if window == 1:
        return list(values), 1
    half = window // 2
    smoothed = [median(values[i - half : i + half + 1]) if half <= i < n - half else 0.0 for i in range(n)]
    steps = [float(s) for s in steps]
    # Theil-Sen over 3 points breaks on one spike; 7 points tolerate one or two.
    width = min(n, max(window, _EDGE_FIT_POINTS))
    for edge, fit in ((range(0, half), slice(0, width)), (range(n - half, n), slice(n - width, n))):
        slope, intercept = _theil_sen(steps[fit], values[fit])
        for i in edge:
            smoothed[i] = intercept + slope * steps[i]
    return smoothed, window


def _theil_sen(x: list[float], y: list[float]) -> tuple[float, float]:
    slopes = [
        (y[j] - y[i]) / (x[j] - x[i]) for i in range(len(x)) for j in range(i + 1, len(x)) if x[j] != x[i]
    ]
    slope = median(slopes) if slopes else 0.0
    return slope, median([yi - slope * xi for xi, yi in zip(x, y)])


def noise_level(values: Sequence[float]) -> float:
    """Robust per-point noise from the MAD of second differences.

    A learning curve is smooth, so x[i+1] - 2 x[i] + x[i-1] cancels its trend (exactly for a straight
    line, nearly for a gentle curve) and leaves noise with 6 times the variance of one point. The MAD
    ignores the few large differences where the curve bends sharply (the first steps of training).
    """
    if len(values) < 4:
        return 0.0
    second = [values[i + 1] - 2 * values[i] + values[i - 1] for i in range(1, len(values) - 1)]
    centre = median(second)
    mad = median([abs(d - centre) for d in second])
    return 1.4826 * mad / math.sqrt(6)


def _pooled_noise(run_values: Sequence[float], base_values: Sequence[float]) -> tuple[float, float]:
    """Each series' noise; a short series' own estimate is unreliable, so it is raised to the pooled one.

    Both runs come from comparable setups, so their metrics' noise is alike; a few second differences
    (a run logged 6 times) can badly underestimate it, which would make any gap look significant.
    """
    sigmas = [noise_level(v) for v in (run_values, base_values)]
    dofs = [max(0, len(v) - 2) for v in (run_values, base_values)]
    if sum(dofs) == 0:
        return sigmas[0], sigmas[1]
    pooled = math.sqrt(sum(d * s * s for d, s in zip(dofs, sigmas)) / sum(dofs))
    run_sigma, base_sigma = (s if d >= _RELIABLE_NOISE_DOF else max(s, pooled) for s, d in zip(sigmas, dofs))
    return run_sigma, base_sigma


def interpolate(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear y at x through (xs, ys), xs increasing; held constant outside (as numpy.interp)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    right = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _first_reaching(
    steps: Sequence[float], smoothed: Sequence[float], logged: Sequence[float], target: float, higher: bool
) -> int | None:
    """The first step where both the logged value and the smoothed curve reach `target`.

    The logged value keeps the claim to what was observed (at the ends the smoothed curve is a fitted
    line, which can run ahead of a saturating curve); the smoothed one keeps a lone noisy spike from
    counting as reached.
    """
    tolerance = 1e-9 * max(1.0, abs(target))  # equal up to float rounding counts as reached

    def reaches(value: float) -> bool:
        return value >= target - tolerance if higher else value <= target + tolerance

    for step, smooth, value in zip(steps, smoothed, logged):
        if reaches(smooth) and reaches(value):
            return int(step)
    return None


def _ranking_score(comparisons: list[MetricComparison]) -> float | None:
    """The baseline's median lead over the run at matched steps, on the first deciding metric compared."""
    by_metric = {c.metric: c for c in comparisons if c.verdict != "unknown"}
    for metric in (*DECIDING_METRICS, "loss"):
        if metric in by_metric:
            gaps = [g.gap for g in by_metric[metric].gaps]
            tail = by_metric[metric].tail_gap
            return float(tail if tail is not None else sorted(gaps)[len(gaps) // 2])
    return None


def _verdict(
    run: RunInfo,
    baseline: RunInfo,
    comparisons: list[MetricComparison],
    candidates: list[Candidate],
    source: Literal["explicit", "auto"],
) -> Regression:
    result = Regression(
        run=run.name,
        baseline=baseline.name,
        baseline_path=str(baseline.path),
        baseline_source=source,
        verdict="unknown",
        metrics=comparisons,
        candidates=candidates,
    )
    compared = [c for c in comparisons if c.verdict != "unknown"]
    deciding = [c for c in compared if c.metric in DECIDING_METRICS] or compared
    if not deciding:
        reasons = "; ".join(c.reason or "" for c in comparisons) or "neither run logged acc, streak, tau or loss"
        result.reason = f"nothing to compare with {baseline.name}: {reasons}"
        result.summary = result.reason
        return result
    verdicts = {c.verdict for c in deciding}
    if "regression" in verdicts:
        result.verdict = "regression"
    elif "improvement" in verdicts:
        result.verdict = "improvement"
    else:
        result.verdict = "no_regression"
    result.summary = _summary(result, deciding, run.name, baseline.name)
    return result


# --- words ---------------------------------------------------------------------------------------------


def fmt(value: float | None) -> str:
    """Numbers as people write them in a report: 0.41, 3.2, 5.12, 1.2e-05."""
    if value is None:
        return "?"
    return f"{value:.3g}"


def _metric_sentence(c: MetricComparison, run_name: str, baseline_name: str, baseline_last: int) -> str:
    last = c.gaps[-1]
    words = {"regression": "worse", "improvement": "better", "no_regression": "within noise"}[c.verdict]
    sentence = (
        f"at step {last.step} {c.metric} {fmt(last.run)} vs {baseline_name} {fmt(last.baseline)} "
        f"({words}; noise threshold {fmt(c.threshold)})"
    )
    if c.run_final_step is not None and c.run_final_step > last.step:
        sentence += f"; {baseline_name} stops at step {baseline_last}"
    if c.baseline_reached_step is None:
        sentence += (
            f"; {baseline_name} never reached {run_name}'s final {c.metric} {fmt(c.run_final)} "
            f"by its step {baseline_last}"
        )
    else:
        sentence += (
            f"; {baseline_name} reached {run_name}'s final {c.metric} {fmt(c.run_final)} "
            f"at step {c.baseline_reached_step}, {run_name} needed {c.run_reached_step}"
        )
        if c.speedup is not None:
            sentence += f": {c.speedup:.1f}x"
    return sentence


def _summary(result: Regression, deciding: list[MetricComparison], run_name: str, baseline_name: str) -> str:
    head = {
        "regression": f"{run_name} regressed against {baseline_name}",
        "improvement": f"{run_name} improved on {baseline_name}",
        "no_regression": f"{run_name} matches {baseline_name} within noise",
    }[result.verdict]
    agreeing = [c for c in deciding if c.verdict == result.verdict] or deciding
    summary = f"{head}: {agreeing[0].sentence}"
    others = [c.metric for c in result.metrics if c.verdict == agreeing[0].verdict and c is not agreeing[0]]
    if others:
        word = {"regression": "worse", "improvement": "better"}.get(agreeing[0].verdict, "within noise")
        summary += f"; {', '.join(others)} also {word}"
    return summary


def _short(value: object) -> str:
    text = str(value)
    return text[:12] if len(text) > 16 else text
