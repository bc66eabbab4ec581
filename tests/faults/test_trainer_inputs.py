"""Bad input to the trainer's CLI: bounds in the config model, YAML that expands without end, files that are
not text, sleuth's fix.yaml in the wrong shape, a seq_len the machine cannot hold, a run that diverges.
Each is one line on stderr and exit code 2, fast, and leaves no run marked `running`."""

from __future__ import annotations

import json
import time

import pytest
from trainer_faults import assert_one_line_error, copy_base_run, invoke, no_traceback, tiny_config

ALIAS_BOMB = "\n".join(
    ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    + [f"{chr(ord('a') + i)}: &{chr(ord('a') + i)} [{', '.join(['*' + chr(ord('a') + i - 1)] * 9)}]"
       for i in range(1, 9)]
    + ["seed: 1"]
)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("lr=.inf", "lr: Input should be a finite number"),
        ("lr=.nan", "lr: Input should be a finite number"),
        ("lr=-1", "lr: Input should be greater than 0"),
        ("seed=9223372036854775808", "seed: Input should be less than 9223372036854775808"),
        ("seed=-1", "seed: Input should be greater than or equal to 0"),
        ("betas=[0.9, 1.5]", "each beta must be in [0, 1)"),
        ("seq_len=100000000", "seq_len: Input should be less than or equal to 1048576"),
        ("grad_clip=.inf", "grad_clip: Input should be a finite number"),
        ("eval_max_new_tokens=100000000", "eval_max_new_tokens"),
    ],
)
def test_numeric_bounds_are_one_line(tmp_path, override, message):
    result = invoke("run", "x", "--set", f"target={tiny_config()['target']}", "--set", override,
                    "--runs-dir", str(tmp_path))
    assert message in assert_one_line_error(result.stderr, result.exit_code)
    assert not (tmp_path / "x").exists()


def test_the_largest_seed_trains(tmp_path):
    """seed 2**63 - 1 is in range, so it must work end to end (every derived seed stays in 64 bits)."""
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tiny_config(steps=1, seed=2**63 - 1)))
    result = invoke("run", "s", "--config", str(config), "--runs-dir", str(tmp_path / "runs"), "--quiet")
    assert result.exit_code == 0, result.output


def test_a_yaml_alias_bomb_fails_fast(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(ALIAS_BOMB)
    started = time.perf_counter()
    result = invoke("run", "x", "--config", str(bomb), "--runs-dir", str(tmp_path))
    elapsed = time.perf_counter() - started
    assert "alias" in assert_one_line_error(result.stderr, result.exit_code, naming="bomb.yaml")
    assert elapsed < 60, elapsed  # a hang guard, not a speed test: an unbounded expansion never finishes


def test_an_alias_bomb_in_set_is_refused_too(tmp_path):
    result = invoke("run", "x", "--set", "target_layer_ids=" + ALIAS_BOMB.replace("\n", "\n"),
                    "--runs-dir", str(tmp_path))
    assert_one_line_error(result.stderr, result.exit_code)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("c.yaml", b"\xff\xfeseed: 1\n", "is not UTF-8"),
        ("c.json", b"[1, 2]", "must hold a mapping"),
        ("c.yaml", b"- 1\n- 2\n", "must hold a mapping"),
        ("c.json", b'{"seed": 1', "does not parse"),
        ("c.yaml", b"[" * 50_000, "nests too deeply"),
        ("c.yaml", b"seed: [1, 2]\n", "seed"),
        ("c.yaml", b"a: &a [*a]\n", "refers to itself"),
    ],
)
def test_a_config_file_that_is_not_a_config(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    result = invoke("run", "x", "--config", str(path), "--runs-dir", str(tmp_path / "runs"))
    assert message in assert_one_line_error(result.stderr, result.exit_code)


@pytest.mark.parametrize(
    ("fix", "message"),
    [
        ("- a\n- list\n", "must hold a mapping"),
        ("config_patch: [1, 2]\n", "config_patch must be a mapping"),
        ("config_patch: {}\ncode_changes: do this\n", "code_changes must be a list"),
        ("diagnosed_run: v5\nconfig_patch: {gama: 4}\n", "unknown config key 'gama'"),
        (b"\xff\xfe", "is not UTF-8"),
        (ALIAS_BOMB, "alias"),
    ],
)
def test_a_fix_yaml_in_the_wrong_shape(tmp_path, fix, message):
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs, "v5")
    (run_dir / "diagnosis").mkdir()
    fix_file = run_dir / "diagnosis" / "fix.yaml"
    fix_file.write_bytes(fix if isinstance(fix, bytes) else fix.encode())
    result = invoke("run", "--fixed", "--from", "v5", "--runs-dir", str(runs), "--quiet")
    assert message in assert_one_line_error(result.stderr, result.exit_code)
    assert sorted(p.name for p in runs.iterdir()) == ["v5"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "100000"], "--block-size must be at most 64"),
        (["--max-new-tokens", "10000000"], "--max-new-tokens must be at most"),
        (["--prompts", "10000000"], "--prompts must be at most"),
        (["--temperature", "nan"], "--temperature must be a finite number"),
    ],
)
def test_eval_bounds_fail_at_once(tmp_path, args, message):
    runs = tmp_path / "runs"
    copy_base_run(runs)
    started = time.perf_counter()
    result = invoke("eval", "r", "--runs-dir", str(runs), *args)
    assert message in assert_one_line_error(result.stderr, result.exit_code)
    assert time.perf_counter() - started < 5


def test_a_seq_len_too_large_for_memory_is_one_line_and_writes_no_run(tmp_path):
    runs = tmp_path / "runs"
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tiny_config(seq_len=2**20, batch_size=64)))
    result = invoke("run", "big", "--config", str(config), "--runs-dir", str(runs), "--quiet")
    line = assert_one_line_error(result.stderr, result.exit_code)
    assert "seq_len 1048576 with batch_size 64 needs at least" in line and "lower seq_len" in line
    assert not (runs / "big").exists()


def test_out_of_memory_mid_run_is_one_line_and_the_run_is_marked_failed(tmp_path, monkeypatch):
    import trainer.run.loop as loop

    real_step = loop.training_step

    def step_that_runs_out_of_memory(*args, **kwargs):
        if step_that_runs_out_of_memory.calls == 1:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")
        step_that_runs_out_of_memory.calls += 1
        return real_step(*args, **kwargs)

    step_that_runs_out_of_memory.calls = 0
    monkeypatch.setattr(loop, "training_step", step_that_runs_out_of_memory)
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tiny_config()))
    result = invoke("run", "oom", "--config", str(config), "--runs-dir", str(tmp_path), "--quiet")
    assert "out of memory" in assert_one_line_error(result.stderr, result.exit_code)
    info = json.loads((tmp_path / "oom" / "run.json").read_text())
    assert info["status"] == "failed" and "out of memory" in info["error"]


def test_a_diverging_run_stops_as_failed_instead_of_completing(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tiny_config(lr=1e30, grad_clip=None, warmup_steps=0)))
    result = invoke("run", "nan", "--config", str(config), "--runs-dir", str(tmp_path), "--quiet")
    line = assert_one_line_error(result.stderr, result.exit_code)
    assert "the run diverged" in line
    assert json.loads((tmp_path / "nan" / "run.json").read_text())["status"] == "failed"


def test_trainer_runs_on_a_runs_dir_that_is_a_file(tmp_path):
    (tmp_path / "runs").write_text("not a directory")
    result = invoke("runs", "--runs-dir", str(tmp_path / "runs"))
    assert result.exit_code == 0 and "no runs" in result.stderr
    no_traceback(result.output)


def test_resuming_a_failed_run_continues_it(tmp_path):
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    info = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**info, "status": "failed", "error": "disk full"}))
    result = invoke("run", "r", "--resume", "--steps", "5", "--runs-dir", str(runs), "--quiet")
    assert result.exit_code == 0, result.output
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"


def test_ctrl_c_mid_run_exits_130_marks_the_run_interrupted_and_it_resumes(tmp_path, monkeypatch):
    import trainer.run.loop as loop

    real_step = loop.training_step
    calls = {"n": 0}

    def step_interrupted_at_the_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "training_step", step_interrupted_at_the_third)
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tiny_config()))
    runs = tmp_path / "runs"
    result = invoke("run", "i", "--config", str(config), "--runs-dir", str(runs), "--quiet")
    assert "interrupted" in assert_one_line_error(result.stderr, result.exit_code, code=130)
    info = json.loads((runs / "i" / "run.json").read_text())
    assert info["status"] == "interrupted" and info.get("error") is None
    monkeypatch.undo()
    resumed = invoke("run", "i", "--resume", "--runs-dir", str(runs), "--quiet")
    assert resumed.exit_code == 0, resumed.output
    info = json.loads((runs / "i" / "run.json").read_text())
    assert info["status"] == "completed" and "stopped" not in info and "error" not in info
