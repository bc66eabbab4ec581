"""CLI manners (issue 13, item 5): a rate-limited progress line when stderr is not a terminal, boolean
options shown as flags, and a note when warmup covers the whole run."""

from __future__ import annotations

import json
import re

import pytest
from trainer_faults import invoke, no_traceback, tiny_config

PROGRESS_LINE = re.compile(r"^p: step (\d+)/(\d+) loss [\d.]+ acc [\d.]+ streak [\d.]+ \([\d.]+ steps/s( eta \d+s)?\)$")


def test_piped_output_gets_progress_lines_and_the_warmup_note(tmp_path, monkeypatch):
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tiny_config(steps=3, warmup_steps=20)))
    monkeypatch.setenv("TRAINER_PROGRESS_EVERY_S", "0")  # every logged row
    result = invoke("run", "p", "--config", str(config), "--runs-dir", str(tmp_path / "runs"))
    assert result.exit_code == 0, result.output
    note, *lines = result.stderr.strip().splitlines()
    assert note.startswith("note: warmup_steps 20 >= steps 3: the whole run is warmup")
    assert [PROGRESS_LINE.match(line).group(1) for line in lines] == ["1", "2", "3"], lines


def test_progress_lines_are_rate_limited_and_the_last_is_always_shown(tmp_path, monkeypatch):
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tiny_config(steps=3, warmup_steps=0)))
    monkeypatch.setenv("TRAINER_PROGRESS_EVERY_S", "3600")
    result = invoke("run", "p", "--config", str(config), "--runs-dir", str(tmp_path / "runs"))
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and PROGRESS_LINE.match(lines[0]).group(1) == "3"
    quiet = invoke("run", "p", "--resume", "--steps", "4", "--runs-dir", str(tmp_path / "runs"), "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == ""


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        (["run"], ["--resume", "--fixed", "--quiet"]),
        (["runs"], ["--json"]),
        (["eval"], ["--json"]),
        (["export"], ["--force"]),
        (["target", "build"], ["--force"]),
    ],
)
def test_boolean_options_are_shown_as_flags(command, flags):
    result = invoke(*command, "--help")
    assert result.exit_code == 0
    no_traceback(result.output)
    assert "<bool>" not in result.output
    for flag in flags:
        assert re.search(rf"{flag}\s", result.output), flag


def test_a_flag_given_a_value_is_a_usage_error(tmp_path):
    result = invoke("run", "x", "--resume", "true", "--runs-dir", str(tmp_path))
    assert result.exit_code == 2
    no_traceback(result.output)
