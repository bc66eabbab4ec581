"""sleuth's own inputs, damaged or hostile: SLEUTH_CONFIG_FILE and --config (alias bombs, recursive
aliases, non-UTF-8, wrong shapes), reference names that try to walk out of playbooks/references/, and run
directories with non-UTF-8 files, metrics of 1e308 / inf / nan / 400-digit integers, a `latest` pointing
outside. Each gives one line and exit 2, or a report that names the damage; never a traceback or a hang.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from sleuth_helpers import assert_one_line_error, invoke, isolate, write_run

BILLION_LAUGHS = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"{b}: &{b} [{', '.join(['*' + a] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi")]
) + "\nreferences: {speculators: {path: *i}}\n"


@pytest.fixture(autouse=True)
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate(tmp_path, monkeypatch, url=(tmp_path / "no-upstream.git").as_uri(), allowed_hosts=[])


def code_file(tmp_path: Path) -> Path:
    path = tmp_path / "drafter.py"
    path.write_text("BLOCK_SIZE = 8\n")
    return path


BAD_YAML = {
    "alias bomb": (BILLION_LAUGHS.encode(), "alias bomb"),
    "recursive alias": (b"references: &r {speculators: *r}\n", "recursive alias"),
    "non-UTF-8": (b"references:\n  speculators: {path: /tmp/\xff\xfe}\n", "is not UTF-8 text"),
    "deep nesting": (b"[" * 5_000 + b"]" * 5_000, "nested too deeply"),
    "not YAML": (b"references: [unclosed\n", "is not valid YAML"),
    "references a list": (b"references: [1, 2]\n", "`references` must map"),
}


@pytest.mark.parametrize("case", list(BAD_YAML), ids=list(BAD_YAML))
def test_a_bad_sleuth_config_file_is_one_line_and_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      case: str) -> None:
    content, expected = BAD_YAML[case]
    config = tmp_path / "config.yaml"
    config.write_bytes(content)
    monkeypatch.setenv("SLEUTH_CONFIG_FILE", str(config))
    for args in (["fetch-reference", "speculators", "--offline"],
                 ["diagnose", "--code", str(code_file(tmp_path)), "--offline", "--out", str(tmp_path / "out")]):
        start = time.perf_counter()
        code, out, err, exc = invoke(args)
        elapsed = time.perf_counter() - start
        assert exc is None, (args, exc)
        line = assert_one_line_error(err, code)
        assert expected in line and str(config) in line
        # A hang guard, not a speed test: an unbounded expansion never finishes.
        assert elapsed < 60, f"{args[0]} took {elapsed:.1f} s on the {case}"


@pytest.mark.parametrize("case", ["alias bomb", "recursive alias", "non-UTF-8", "deep nesting"])
def test_a_bad_diagnose_config_is_one_line(tmp_path: Path, case: str) -> None:
    content, expected = BAD_YAML[case]
    config = tmp_path / "run-config.yaml"
    config.write_bytes(content)
    code, out, err, exc = invoke(["diagnose", "--code", str(code_file(tmp_path)), "--config", str(config),
                                  "--offline", "--out", str(tmp_path / "out")])
    assert exc is None
    assert expected in assert_one_line_error(err, code)


@pytest.mark.parametrize("text", ["[" * 100_000, '{"block_size": 1' + "0" * 5000 + "}"], ids=["deep", "5000 digits"])
def test_a_hostile_json_config_is_one_line(tmp_path: Path, text: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(text)
    code, out, err, exc = invoke(["diagnose", "--code", str(code_file(tmp_path)), "--config", str(config),
                                  "--offline", "--out", str(tmp_path / "out")])
    assert exc is None
    assert "does not parse" in assert_one_line_error(err, code)


# --- reference names -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../evil", "../../playbooks/evil", "references/../../evil", "a/b", "..", "x\\y",
                                  "/abs/evil", ".hidden", ""])
def test_a_reference_name_is_a_name_not_a_path(tmp_path: Path, name: str) -> None:
    # A definition outside playbooks/references/ that a path-walking name would reach.
    (tmp_path / "playbooks" / "evil.yaml").write_text("repository: evil/evil\nurl: https://evil.example.test/e.git\n"
                                                      "files: [x.py]\nallowed_hosts: [evil.example.test]\n")
    (tmp_path / "evil.yaml").write_text((tmp_path / "playbooks" / "evil.yaml").read_text())
    before = sorted(p for p in tmp_path.rglob("*"))
    commands = [["fetch-reference", name]]
    if name:  # `diagnose --reference ""` means "the playbook's reference", as if the option were not given
        commands.append(["diagnose", "--code", str(code_file(tmp_path)), "--reference", name, "--offline",
                         "--out", str(tmp_path / "out")])
    for args in commands:
        code, out, err, exc = invoke(args)
        assert exc is None
        line = assert_one_line_error(err, code)
        assert "reference" in line
        assert "evil/evil" not in out + err
    after = {p for p in tmp_path.rglob("*")} - {tmp_path / "drafter.py"}
    created = sorted(after - set(before))
    assert all(p == tmp_path / "cache" or tmp_path / "cache" in p.parents for p in created), created


# --- run directories -------------------------------------------------------------------------------------

def diagnose_run(tmp_path: Path, run: Path) -> tuple[int, str, str, dict]:
    out = tmp_path / "out"
    code, stdout, stderr, exc = invoke(["diagnose", "--run", str(run), "--offline", "--out", str(out),
                                        "--format", "json"])
    assert exc is None and "Traceback" not in stdout + stderr and "internal error" not in stderr, stderr
    assert code in (0, 1), stderr
    return code, stdout, stderr, json.loads((out / "report.json").read_text())


def test_metrics_of_1e308_inf_nan_and_400_digit_ints_do_not_break_the_chart(tmp_path: Path) -> None:
    steps = range(10, 301, 10)
    rows = [{"step": s, "loss": 1e308 if s % 20 else -1e308, "acc": 0.001 * s, "tau": float("inf"),
             "streak": float("nan")} for s in steps]
    run = write_run(tmp_path / "runs", "huge", rows=rows)
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 310, "acc": 1' + "0" * 400 + ', "loss": 2.0}\n')
        handle.write('{"step": 1' + "0" * 30 + ', "acc": 0.5}\n')
    write_run(tmp_path / "runs", "base", created="2026-10-01T10:00:00+00:00")

    code, stdout, stderr, report = diagnose_run(tmp_path, run)

    problems = " ".join(report["run"]["problems"])
    assert "ignored" in problems and "not finite numbers" in problems and "loss at line 1" in problems
    assert (tmp_path / "out" / "chart.png").is_file()


def test_non_utf8_run_json_and_metrics_lines_are_named_not_fatal(tmp_path: Path) -> None:
    run = write_run(tmp_path / "runs", "latin")
    (run / "run.json").write_bytes(b'{"name": "caf\xe9"}')
    with (run / "metrics.jsonl").open("ab") as handle:
        handle.write(b'{"step": 310, "acc": 0.5, "note": "\xff"}\n')

    code, stdout, stderr, report = diagnose_run(tmp_path, run)

    problems = " ".join(report["run"]["problems"])
    assert "run.json is not UTF-8 text" in problems
    assert "skipped 1 truncated or garbled line(s) (line 31)" in problems


def test_latest_that_points_outside_checkpoints_is_not_followed(tmp_path: Path) -> None:
    run = write_run(tmp_path / "runs", "escape")
    outside = tmp_path / "elsewhere"
    (outside / "step-999").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("../../../elsewhere/step-999\n")

    code, stdout, stderr, report = diagnose_run(tmp_path, run)

    assert report["run"]["checkpoint"] == str(run / "checkpoints" / "step-300" / "drafter.safetensors")
    assert any("checkpoints/latest names" in p for p in report["run"]["problems"])


# --- metrics.jsonl, streamed under bounds (issue 22, F12) ----------------------------------------------------

def _read_run_in_a_fresh_process(run: Path) -> dict:
    """sleuth.runs.read_run of `run` in a child process: its peak RSS (KiB), problems and rows kept."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    script = ("import json, pathlib, resource, sys\nfrom sleuth.runs import read_run\n"
              "info = read_run(pathlib.Path(sys.argv[1]))\n"
              "print(json.dumps({'peak_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
              "'problems': info.problems, 'steps': [row['step'] for row in info.metrics]}))\n")
    done = subprocess.run([sys.executable, "-c", script, str(run)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_sparse_400_mib_metrics_file_is_streamed_not_held(tmp_path: Path) -> None:
    """30 real rows, then 400 MiB of NUL bytes with no newline (sparse: no disk used). Streamed, the long line
    is read and dropped, never held: peak RSS as for the intact run (measured: 69 MiB either way with the CLI;
    837 MiB on main, which read the file whole), the 30 rows kept, one problem line naming what was skipped."""
    intact = _read_run_in_a_fresh_process(write_run(tmp_path / "a", "intact"))
    run = write_run(tmp_path / "b", "sparse")
    with (run / "metrics.jsonl").open("r+b") as handle:
        handle.truncate(400 * 1024 * 1024)
    sparse = _read_run_in_a_fresh_process(run)
    assert sparse["peak_kib"] < intact["peak_kib"] + 64 * 1024, (sparse["peak_kib"] >> 10, intact["peak_kib"] >> 10)
    assert sparse["steps"] == intact["steps"] == list(range(10, 301, 10))
    lines = [p for p in sparse["problems"] if p.startswith("metrics.jsonl")]
    assert len(lines) == 1 and "skipped 1 line(s) longer than 1024 KiB, not read (line 31)" in lines[0], lines


def test_metrics_past_the_byte_bound_are_read_up_to_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A metrics file over the total bound keeps the rows before it (on main the whole file was refused: no
    metrics at all), and says so in the same one line."""
    import sleuth.runs
    from sleuth.runs import read_run

    run = write_run(tmp_path / "runs", "long")
    size = (run / "metrics.jsonl").stat().st_size
    monkeypatch.setattr(sleuth.runs, "_MAX_METRICS_FILE", size // 2)
    info = read_run(run)
    whole_rows = [json.loads(line) for line in (run / "metrics.jsonl").read_bytes()[: size // 2].splitlines()[:-1]]
    assert [row["step"] for row in info.metrics] == [row["step"] for row in whole_rows]
    lines = [p for p in info.problems if p.startswith("metrics.jsonl")]
    assert len(lines) == 1 and "read only the first" in lines[0] and f"of {size} bytes" in lines[0], lines


def test_metrics_past_the_row_bound_are_thinned_evenly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """More rows than the bound: every 2nd, 4th, ... row is kept, over the whole run (first and last stretch
    alike), never only the head; the problem line says how many were read and 1 in how many kept."""
    import sleuth.runs
    from sleuth.runs import read_run

    monkeypatch.setattr(sleuth.runs, "_MAX_METRICS_ROWS", 100)
    rows = [{"step": step, "loss": 5.0 - step / 1000} for step in range(1, 351)]
    run = write_run(tmp_path / "runs", "thin", rows=rows)
    info = read_run(run)
    steps = [row["step"] for row in info.metrics]
    assert steps == list(range(1, 351, 4))  # 350 rows, bound 100: 1 in 2 (175 > 100), then 1 in 4: 88 rows
    lines = [p for p in info.problems if p.startswith("metrics.jsonl")]
    assert len(lines) == 1 and "kept 1 row in 4 of 350" in lines[0], lines
