"""The regression chart: a real PNG, drawn once per set of series, redrawn when the metrics change."""

from __future__ import annotations

from pathlib import Path

from sleuth.report.chart import chart_key, png_text, write_chart

SERIES = {
    "v5": {"acc": ([10, 20, 30], [0.1, 0.2, 0.3]), "tau": ([100, 200, 300], [1.5, 1.8, 2.0])},
    "v3": {"acc": ([10, 20, 30, 40], [0.2, 0.3, 0.4, 0.45])},
}


def test_draws_a_png_carrying_its_key_then_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "chart.png"
    assert write_chart(path, SERIES, main_label="v5") == "drawn"
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
    assert png_text(path)["sleuth-chart-key"] == chart_key(SERIES)
    assert write_chart(path, SERIES, main_label="v5") == "cached"
    assert path.read_bytes() == data


def test_changed_metrics_redraw_the_chart(tmp_path: Path) -> None:
    path = tmp_path / "chart.png"
    write_chart(path, SERIES, main_label="v5")
    changed = {**SERIES, "v5": {**SERIES["v5"], "acc": ([10, 20, 30, 40], [0.1, 0.2, 0.3, 0.35])}}
    assert chart_key(changed) != chart_key(SERIES)
    assert write_chart(path, changed, main_label="v5") == "drawn"
    assert png_text(path)["sleuth-chart-key"] == chart_key(changed)


def test_nothing_to_plot_draws_nothing(tmp_path: Path) -> None:
    path = tmp_path / "chart.png"
    assert write_chart(path, {"v5": {}}, main_label="v5") == "empty"
    assert not path.exists()


def test_png_text_of_a_non_png_is_empty(tmp_path: Path) -> None:
    (tmp_path / "x.png").write_bytes(b"not a png")
    assert png_text(tmp_path / "x.png") == {}
    assert png_text(tmp_path / "missing.png") == {}
