"""Reading run directories per the contract, built by hand here (sleuth never imports the trainer).

`write_run` is also the run-directory builder the regression, report and diagnose tests use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sleuth.runs import RunError, list_run_dirs, read_run, resolve_run_dir, safetensors_header_problem

HIDDEN = 8
TARGET_FP = "target-sha-aaaa"
DATA_FP = "data-sha-bbbb"


def metrics_rows(steps: list[int], **series: list[float]) -> list[dict[str, Any]]:
    """Metrics rows as the trainer logs them: one per logged step; a series may skip steps (None)."""
    rows = []
    for i, step in enumerate(steps):
        row: dict[str, Any] = {"step": step, "lr": 1e-3, "tokens_per_s": 100.0, "elapsed_s": float(step)}
        for name, values in series.items():
            if values[i] is not None:
                row[name] = values[i]
        rows.append(row)
    return rows


def write_run(
    root: Path,
    name: str,
    *,
    created: str = "2026-11-01T10:00:00+00:00",
    rows: list[dict[str, Any]] | None = None,
    config: dict[str, Any] | None = None,
    target_fp: str = TARGET_FP,
    data_fp: str = DATA_FP,
    checkpoint_step: int | None = 300,
    fc_inputs: int = 5,
    code: dict[str, str] | None = None,
    run_json: bool = True,
) -> Path:
    """A run directory following the contract; each part can be left out to test its absence."""
    run = root / name
    run.mkdir(parents=True)
    config = {"block_size": 8, "draft_layers": 5, "target_layer_ids": [1, 3, 5, 7, 9], "loss_decay_gamma": 4.0,
              "steps": 300, **(config or {})}
    (run / "config.json").write_text(json.dumps(config))
    if run_json:
        (run / "run.json").write_text(
            json.dumps(
                {
                    "name": name,
                    "preset": "fixed",
                    "created": created,
                    "status": "completed",
                    "steps_done": 300,
                    "target": {"path": "embedded", "fingerprint": target_fp, "num_layers": 12,
                               "hidden_size": HIDDEN, "vocab_size": 64},
                    "data": {"source": "embedded", "fingerprint": data_fp},
                }
            )
        )
    if rows is None:
        steps = list(range(10, 301, 10))
        rows = metrics_rows(steps, acc=[0.001 * s for s in steps], loss=[5.0 - 0.01 * s for s in steps])
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if checkpoint_step is not None:
        from safetensors.numpy import save_file

        step_dir = run / "checkpoints" / f"step-{checkpoint_step:08d}"
        step_dir.mkdir(parents=True)
        save_file(
            {"fc.weight": np.zeros((HIDDEN, fc_inputs * HIDDEN), dtype=np.float32),
             "hidden_norm.weight": np.ones(HIDDEN, dtype=np.float32)},
            str(step_dir / "drafter.safetensors"),
        )
        (step_dir / "state.json").write_text(json.dumps({"step": checkpoint_step}))
        (run / "checkpoints" / "latest").write_text(step_dir.name + "\n")
    sources = code if code is not None else {"trainer/model/loss.py": "def loss():\n    return 0\n"}
    for relative, text in sources.items():
        target = run / "code" / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return run


def test_reads_every_part_of_a_complete_run(tmp_path: Path) -> None:
    run = read_run(write_run(tmp_path, "v3"))
    assert run.name == "v3"
    assert run.problems == []
    assert run.config is not None and run.block_size == 8
    assert run.target_fingerprint == TARGET_FP and run.data_fingerprint == DATA_FP
    assert len(run.metrics) == 30
    assert run.checkpoint == tmp_path / "v3" / "checkpoints" / "step-00000300" / "drafter.safetensors"
    assert run.checkpoint_step == 300
    assert run.code_dir == tmp_path / "v3" / "code"
    steps, acc = run.series("acc")
    assert steps[:3] == [10, 20, 30] and acc[:3] == pytest.approx([0.01, 0.02, 0.03])


def test_truncated_metrics_line_is_skipped_and_reported(tmp_path: Path) -> None:
    path = write_run(tmp_path, "v5")
    text = (path / "metrics.jsonl").read_text()
    # A run killed mid-write leaves half a JSON object as its last line.
    (path / "metrics.jsonl").write_text(text + '{"step": 310, "loss": 1.2, "ac')
    run = read_run(path)
    assert len(run.metrics) == 30
    assert any("skipped 1 truncated or garbled line(s) (line 31)" in p for p in run.problems)


def test_garbled_lines_in_the_middle_are_skipped_with_their_line_numbers(tmp_path: Path) -> None:
    path = write_run(tmp_path, "v5")
    lines = (path / "metrics.jsonl").read_text().splitlines()
    lines[4] = "\x00\x00garbage"
    lines[9] = '["not", "a", "row"]'
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run = read_run(path)
    assert len(run.metrics) == 28
    assert any("line 5, 10" in p for p in run.problems)


def test_a_step_logged_twice_keeps_the_later_row(tmp_path: Path) -> None:
    rows = metrics_rows([10, 20, 30], acc=[0.1, 0.2, 0.3]) + metrics_rows([20, 30], acc=[0.25, 0.35])
    run = read_run(write_run(tmp_path, "resumed", rows=rows))
    assert run.series("acc") == ([10, 20, 30], [0.1, 0.25, 0.35])


def test_non_finite_and_missing_values_are_left_out_of_a_series(tmp_path: Path) -> None:
    rows = metrics_rows([10, 20, 30, 40], acc=[0.1, float("nan"), None, 0.4], tau=[None, 1.5, None, 2.0])
    run = read_run(write_run(tmp_path, "r", rows=rows))
    assert run.series("acc") == ([10, 40], [0.1, 0.4])
    assert run.series("tau") == ([20, 40], [1.5, 2.0])


def test_missing_files_become_problems_not_errors(tmp_path: Path) -> None:
    path = write_run(tmp_path, "bare", checkpoint_step=None, code={}, run_json=False)
    (path / "config.json").unlink()
    run = read_run(path)
    assert run.config is None and run.run_json is None and run.checkpoint is None and run.code_dir is None
    assert "run.json is missing" in run.problems
    assert "config.json is missing" in run.problems
    assert any("no checkpoints/" in p for p in run.problems)
    assert any("no code/" in p for p in run.problems)
    assert run.target_fingerprint is None and run.block_size is None


def test_garbled_config_is_a_problem_with_the_parse_error(tmp_path: Path) -> None:
    path = write_run(tmp_path, "r")
    (path / "config.json").write_text('{"block_size": 8,')
    run = read_run(path)
    assert run.config is None
    assert any(p.startswith("config.json is not valid JSON") for p in run.problems)


def test_corrupt_checkpoint_is_found_but_reported(tmp_path: Path) -> None:
    path = write_run(tmp_path, "r")
    weights = path / "checkpoints" / "step-00000300" / "drafter.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])
    run = read_run(path)
    assert run.checkpoint == weights
    assert any("drafter.safetensors is corrupt" in p for p in run.problems)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"abc", "shorter than a safetensors header"),
        ((10**12).to_bytes(8, "little") + b"{}", "header length field is impossible"),
        ((5).to_bytes(8, "little") + b"{nope", "header is not valid JSON"),
        ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
    ],
)
def test_safetensors_header_problems_are_named(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(content)
    problem = safetensors_header_problem(path)
    assert problem is not None and expected in problem


def test_stale_latest_pointer_falls_back_to_the_newest_step(tmp_path: Path) -> None:
    path = write_run(tmp_path, "r")
    (path / "checkpoints" / "latest").write_text("step-00000999\n")
    run = read_run(path)
    assert run.checkpoint is not None and run.checkpoint.parent.name == "step-00000300"
    assert any("step-00000999" in p for p in run.problems)


def test_resolve_run_by_name_or_path_and_explain_a_miss(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    write_run(runs, "v3")
    write_run(runs, "v5")
    assert resolve_run_dir("v5", runs) == runs / "v5"
    assert resolve_run_dir(str(runs / "v3")) == runs / "v3"
    with pytest.raises(RunError, match=r"no run 'v9'.*runs there: v3, v5"):
        resolve_run_dir("v9", runs)
    assert [p.name for p in list_run_dirs(runs)] == ["v3", "v5"]


def test_a_directory_that_is_not_a_run_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunError, match="is not a run directory"):
        read_run(tmp_path / "empty")


def test_a_bare_name_prefers_the_run_over_a_folder_in_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    runs = tmp_path / "runs"
    write_run(runs, "v5")
    (tmp_path / "v5").mkdir()  # e.g. an unrelated folder where the user happens to stand
    monkeypatch.chdir(tmp_path)
    assert resolve_run_dir("v5", runs) == runs / "v5"
    assert resolve_run_dir("./v5", runs) == Path("v5")


def test_validation_rows_are_their_own_series_and_never_overwrite_training(tmp_path: Path) -> None:
    rows = metrics_rows([1, 2], acc=[0.2, 0.3], loss=[2.0, 1.5])
    rows.insert(2, {"step": 2, "split": "val", "acc": 0.25, "loss": 1.9})
    info = read_run(write_run(tmp_path, "r", rows=rows))
    assert info.series("acc") == ([1, 2], [0.2, 0.3])
    assert info.series("val_acc") == ([2], [0.25])
    assert info.series("val_loss") == ([2], [1.9])
