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
