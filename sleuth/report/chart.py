"""The regression chart: acc, streak and tau (and loss) against step, for the run and its baseline(s).

matplotlib costs about half a second to import, more than the rest of a diagnosis together, so it is
imported only here and only when the chart must be drawn: the PNG carries a key (a hash of the plotted
series) in a text chunk, and an existing chart with the same key is kept as it is.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import struct
from pathlib import Path

CHART_VERSION = 1
CHART_METRICS = ("acc", "streak", "tau", "loss")
_KEY_NAME = "sleuth-chart-key"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_MAX_PLOTTABLE = 1e15

# label -> metric -> (steps, values)
Series = dict[str, dict[str, tuple[list[int], list[float]]]]


def chart_key(series: Series) -> str:
    blob = json.dumps({"version": CHART_VERSION, "series": series}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def plottable(series: Series) -> Series:
    """Only points matplotlib can place: finite values and steps within ±1e15. Past that, axis limits
    overflow (1e308 - -1e308 is inf) and the drawing fails; such values are damage, not measurements."""
    def ok(x: float) -> bool:
        try:
            return math.isfinite(float(x)) and abs(float(x)) <= _MAX_PLOTTABLE
        except (TypeError, ValueError, OverflowError):
            return False

    clean: Series = {}
    for label, runs in series.items():
        clean[label] = {}
        for metric, (steps, values) in runs.items():
            points = [(s, v) for s, v in zip(steps, values) if ok(s) and ok(v)]
            clean[label][metric] = ([s for s, _ in points], [float(v) for _, v in points])
    return clean


def write_chart(path: Path, series: Series, *, main_label: str) -> str:
    """Draw the chart at `path` unless an up-to-date one is there; returns 'drawn', 'cached' or 'empty'."""
    series = plottable(series)
    metrics = [m for m in CHART_METRICS if any(len(runs.get(m, ([], []))[0]) for runs in series.values())]
    if not metrics:
        return "empty"
    key = chart_key(series)
    if png_text(path).get(_KEY_NAME) == key:
        return "cached"
    _draw(path, series, metrics, main_label, key)
    return "drawn"


def _draw(path: Path, series: Series, metrics: list[str], main_label: str, key: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from sleuth.artifacts import write_atomic
    from sleuth.escape import terminal
    from sleuth.regression import rolling_median

    # Fixed margins rather than constrained layout: the layout solver doubles the drawing time.
    figure = Figure(figsize=(3.4 * len(metrics), 3.2), dpi=90)
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(metrics), squeeze=False)[0]
    for ax, metric in zip(axes, metrics):
        for label, runs in series.items():
            steps, values = runs.get(metric, ([], []))
            if not steps:
                continue
            is_main = label == main_label
            shown = values
            if len(steps) > 12:
                # Raw points faintly, the smoothed curve the verdict used on top.
                line = ax.plot(steps, values, linewidth=0.6, alpha=0.3, zorder=1)[0]
                shown = rolling_median(steps, values)[0]
                color = {"color": line.get_color()}
            else:
                color = {}
            ax.plot(
                steps,
                shown,
                **color,
                # a run's name: escaped (a non-UTF-8 name's bytes as \xNN: matplotlib refuses surrogates), and
                # "$" made literal (matplotlib reads $...$ as mathtext: a stray one fails the drawing)
                label=terminal(label, limit=80).replace("$", r"\$"),
                linewidth=2.0 if is_main else 1.2,
                linestyle="-" if is_main else "--",
                marker="o" if len(steps) <= 12 else None,
                markersize=3,
                zorder=3 if is_main else 2,
            )
        ax.set_title(metric + (" (lower is better)" if metric == "loss" else ""))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    figure.subplots_adjust(left=0.25 / len(metrics), right=0.98, bottom=0.16, top=0.9, wspace=0.3)
    # Rendered in memory, then written aside and renamed (sleuth.artifacts.write_atomic): a report viewer
    # never shows half a chart, and a chart.png that is a link or a FIFO is replaced, not written through.
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={_KEY_NAME: key})
    write_atomic(path, buffer.getvalue())


def png_text(path: Path) -> dict[str, str]:
    """The tEXt chunks of a PNG (empty when the file is missing, not a regular file, or not a PNG)."""
    from sleuth.artifacts import ArtifactError, read_bytes

    try:
        data = read_bytes(path, max_bytes=64 * 1024 * 1024)
    except (OSError, ArtifactError):
        return {}
    if not data.startswith(_PNG_SIGNATURE):
        return {}
    texts: dict[str, str] = {}
    offset = len(_PNG_SIGNATURE)
    while offset + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[offset : offset + 8])
        body = data[offset + 8 : offset + 8 + length]
        if kind == b"tEXt" and b"\x00" in body:
            name, _, text = body.partition(b"\x00")
            texts[name.decode("latin-1")] = text.decode("latin-1")
        if kind == b"IEND":
            break
        offset += 12 + length
    return texts
