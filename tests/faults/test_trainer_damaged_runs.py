"""Damaged run directories, generated from a real run: every file the trainer reads is truncated, emptied,
given the wrong type, made non-UTF-8 or replaced by a link leading out of the run, and every command that
reads run directories (resume, eval, export, runs) is run on each. The contract, for every case:
no traceback; a command that reads the damaged file fails with one line naming it and exit code 2 (or,
for `trainer runs`, lists the run as damaged with that line); a command that does not read it succeeds;
and a failing command changes nothing in the run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_faults import (
    DAMAGES,
    READS,
    RUN_FILES,
    TOLERATED,
    assert_one_line_error,
    command_args,
    copy_base_run,
    damage,
    damaged_cases,
    invoke,
    no_traceback,
    snapshot,
)

# The full cross product is slow-marked (eval and export load the target for every case that must
# succeed); resume and runs fail before any model loads, so they run on every push.
FAST_COMMANDS = ("resume", "runs")
CASES = [
    pytest.param(command, relative, how, id=f"{command}-{relative.rsplit('/', 1)[-1]}-{how}",
                 marks=() if command in FAST_COMMANDS else pytest.mark.slow)
    for command in READS
    for relative, how in damaged_cases()
]


def check_command_on_damage(tmp_path: Path, command: str, relative: str, how: str) -> None:
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    damage(run_dir, relative, how, tmp_path / "outside")
    before = snapshot(run_dir)
    result = invoke(*command_args(command, runs, tmp_path / "export"))
    no_traceback(result.output)
    must_report = relative in READS[command] and (relative, how) not in TOLERATED.get(command, set())
    file_name = relative.rsplit("/", 1)[-1]
    if command == "runs":
        assert result.exit_code == 0, result.output
        (row,) = json.loads(result.stdout)
        if must_report:
            assert row["status"] == "damaged"
            assert_one_line_error(result.stderr, 0, naming=file_name, code=0)
        else:
            assert row["status"] == "completed" and result.stderr == ""
        assert snapshot(run_dir) == before
    elif must_report:
        assert_one_line_error(result.stderr, result.exit_code, naming=file_name)
        assert snapshot(run_dir) == before  # nothing lost, nothing half-written
    else:
        assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("command", "relative", "how"), CASES)
def test_every_command_on_every_damaged_file(tmp_path, command, relative, how):
    check_command_on_damage(tmp_path, command, relative, how)


def test_the_generator_covers_every_file_and_damage():
    cases = set(damaged_cases())
    assert len(cases) == len(RUN_FILES) * len(DAMAGES) == 45
    assert all(command in READS for command in ("resume", "eval", "export", "runs"))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"step": 4}, None),  # the control: a valid state.json resumes
        ({"world_size": 1}, "has no integer step"),
        ({"step": "4"}, "has no integer step"),
        ({"step": 4.0}, "has no integer step"),
        ({"step": True}, "has no integer step"),
        ({"step": 2}, "says step 2 in checkpoint step-00000004"),
    ],
)
def test_state_json_without_a_usable_step(tmp_path, content, message):
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    (run_dir / "checkpoints/step-00000004/state.json").write_text(json.dumps(content))
    before = snapshot(run_dir)
    result = invoke("run", "r", "--resume", "--runs-dir", str(runs), "--quiet")
    if message is None:
        assert result.exit_code == 0, result.output
        return
    assert message in assert_one_line_error(result.stderr, result.exit_code, naming="state.json")
    assert snapshot(run_dir) == before


def test_a_torn_row_after_the_checkpoint_is_dropped_and_the_run_resumes(tmp_path):
    """What a kill in the middle of appending a row leaves: resume drops the torn row, keeps the rest."""
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    rows = (run_dir / "metrics.jsonl").read_text()
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 5, "loss": 0.')
    result = invoke("run", "r", "--resume", "--steps", "4", "--runs-dir", str(runs), "--quiet")
    assert result.exit_code == 0, result.output
    assert (run_dir / "metrics.jsonl").read_text() == rows


def test_metrics_cut_at_a_line_boundary_are_refused_on_resume(tmp_path):
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(lines[:2]))
    result = invoke("run", "r", "--resume", "--runs-dir", str(runs), "--quiet")
    assert "has no row for step 4" in assert_one_line_error(result.stderr, result.exit_code, naming="metrics.jsonl")


def test_latest_naming_a_pruned_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    (run_dir / "checkpoints/latest").write_text("step-00000001\n")
    for command in ("resume", "eval", "export"):
        result = invoke(*command_args(command, runs, tmp_path / "out"))
        assert "is missing (deleted or pruned)" in assert_one_line_error(result.stderr, result.exit_code)


def test_a_checkpoint_whose_shapes_disagree_with_the_config(tmp_path):
    """The weights are a valid safetensors file of another drafter (config.json says 2 layers, hidden 64...):
    resume, eval and export all say which tensor differs, in one line."""
    import torch
    from safetensors.torch import load_file, save_file

    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    weights_file = run_dir / "checkpoints/step-00000004/drafter.safetensors"
    weights = load_file(weights_file)
    weights["fc.weight"] = torch.zeros(weights["fc.weight"].shape[0], weights["fc.weight"].shape[1] + 8)
    save_file(weights, weights_file)
    before = snapshot(run_dir)
    for command in ("resume", "eval", "export"):
        result = invoke(*command_args(command, runs, tmp_path / "out"))
        line = assert_one_line_error(result.stderr, result.exit_code, naming="drafter.safetensors")
        assert "fc.weight" in line and "does not match the run's config" in line
    assert snapshot(run_dir) == before


def test_optimizer_state_of_another_shape(tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    optimizer_file = run_dir / "checkpoints/step-00000004/optimizer.safetensors"
    with safe_open(str(optimizer_file), "pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    tensors["state.0.exp_avg"] = torch.zeros(3, 3)
    save_file(tensors, optimizer_file, metadata=metadata)
    result = invoke(*command_args("resume", runs, tmp_path / "out"))
    line = assert_one_line_error(result.stderr, result.exit_code, naming="optimizer.safetensors")
    assert "state.0.exp_avg" in line


def test_runs_lists_every_run_when_records_hold_odd_values(tmp_path):
    """`trainer runs` with a numeric `created`, a list status, a string step count: listed, never a crash;
    a run recorded as running whose process is gone (killed) is shown as stopped."""
    runs = tmp_path / "runs"
    odd = (("a", {"created": 12345}), ("b", {"status": ["x"], "steps_done": "4"}), ("c", {"status": "running"}))
    for name, changes in odd:
        run_dir = copy_base_run(runs, name)
        info = json.loads((run_dir / "run.json").read_text())
        (run_dir / "run.json").write_text(json.dumps({**info, **changes}))
    for args in (["runs", "--runs-dir", str(runs)], ["runs", "--runs-dir", str(runs), "--json"]):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        no_traceback(result.output)
    rows = json.loads(result.stdout)
    assert sorted(row["name"] for row in rows) == ["a", "b", "c"]
    statuses = {row["name"]: row["status"] for row in rows}
    assert statuses["b"] is None
    assert statuses["c"] == "stopped"  # the record says running, but no process holds the run


@pytest.mark.parametrize("how", DAMAGES)
def test_fixed_from_a_run_whose_config_is_damaged(tmp_path, how):
    """`trainer run --fixed --from r` reads r's config.json: damaged, it is one line and no vN is made."""
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    (run_dir / "diagnosis").mkdir()
    (run_dir / "diagnosis" / "fix.yaml").write_text("config_patch: {loss_decay_gamma: 4.0}\ncode_changes: []\n")
    damage(run_dir, "config.json", how, tmp_path / "outside")
    before = snapshot(run_dir)
    result = invoke("run", "--fixed", "--from", "r", "--runs-dir", str(runs), "--quiet")
    assert_one_line_error(result.stderr, result.exit_code, naming="config.json")
    assert sorted(p.name for p in runs.iterdir()) == ["r"] and snapshot(run_dir) == before
