"""End to end through the real CLI: a tiny CPU run learns, a run killed at any moment resumes to exactly
the metrics of an uninterrupted one, user mistakes are one line with exit code 2, and
`trainer run --fixed --from v5` turns sleuth's diagnosis into a run that sleuth then finds clean."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.timing import scaled_timeout

REPO = Path(__file__).resolve().parents[2]

# Tiny sizes for 2 CPU cores; every DFlash switch keeps its reference default unless a preset sets it.
TINY = {
    "seq_len": 64,
    "batch_size": 4,
    "block_size": 4,
    "max_anchors": 6,
    "draft_layers": 5,
    "lr": 3e-3,
    "warmup_steps": 2,
    "log_every": 1,
    "eval_every": None,
    # every run ends with eval.json, eval_every or not: keep that final eval tiny
    "eval_prompts": 2,
    "eval_max_new_tokens": 8,
    "checkpoint_every": 3,
}


@pytest.fixture(scope="module")
def small_target(embedded_small_target) -> Path:
    # The session's one build (tests/conftest.py): the modules importing this fixture each rebuilt it before.
    return embedded_small_target


def trainer_cli(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """`timeout`: what the command may take on an idle machine, scaled by the load when it starts."""
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args],
        cwd=REPO,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=scaled_timeout(timeout),
    )


def sleuth_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        # sleuth diagnose probes a run's code in a child process by default: allow for that on a loaded machine.
        [sys.executable, "-m", "sleuth.cli", *args], cwd=REPO, env=_env(), capture_output=True, text=True,
        timeout=scaled_timeout(300),
    )


def _env(extra: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(extra or {})}
    return env


def write_config(path: Path, target: Path, **changes) -> Path:
    path.write_text(json.dumps({**TINY, "target": str(target), **changes}))
    return path


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def comparable(rows: list[dict]) -> list[tuple]:
    # Wall-clock fields differ between two runs; everything the model computed must not.
    return [(r["step"], r["loss"], r["acc"], r["position_acc"], r["streak"], r["eal"], r["lr"]) for r in rows]


def test_tiny_run_loss_falls_and_writes_the_contract(small_target, tmp_path):
    config = write_config(tmp_path / "c.json", small_target, steps=30, eval_every=30, eval_prompts=2,
                          eval_max_new_tokens=8)
    result = trainer_cli("run", "tiny", "--config", str(config), "--runs-dir", str(tmp_path / "runs"))
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / "tiny"
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == list(range(1, 31))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-3:]) / 3
    assert last < 0.6 * first, (first, last)
    assert sum(r["acc"] for r in rows[-3:]) > sum(r["acc"] for r in rows[:3])
    assert "tau" in rows[-1] and rows[-1]["tau"] >= 1.0

    saved = json.loads((run / "config.json").read_text())
    assert saved["target_layer_ids"] == [1, 2, 3, 4, 5] and saved["target_logits_source"] == "final"
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "completed" and info["steps_done"] == 30
    assert info["target"]["num_layers"] == 8 and len(info["target"]["fingerprint"]) == 64
    assert (run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip() / "drafter.safetensors").is_file()
    assert json.loads((run / "eval.json").read_text())["lossless"] is True
    fingerprint = json.loads((run / "fingerprint.json").read_text())
    assert "trainer/model/attention_mask.py" in fingerprint["files"]
    assert (run / "code" / "trainer" / "model" / "attention_mask.py").is_file()
    env = json.loads((run / "env.json").read_text())
    assert env["device"] == "cpu" and env["torch"]


def test_kill_at_any_moment_then_resume_equals_an_uninterrupted_run(small_target, tmp_path):
    config = write_config(tmp_path / "c.json", small_target, steps=12)
    runs = tmp_path / "runs"
    reference = trainer_cli("run", "straight", "--config", str(config), "--runs-dir", str(runs), "--quiet")
    assert reference.returncode == 0, reference.stderr

    process = subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", "run", "killed", "--config", str(config), "--runs-dir", str(runs)],
        cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    killed = runs / "killed"
    deadline = time.monotonic() + 180
    # Kill after the first checkpoint but before the end, mid-way between checkpoints if we can.
    while time.monotonic() < deadline and process.poll() is None:
        rows = (killed / "metrics.jsonl").read_text().count("\n") if (killed / "metrics.jsonl").exists() else 0
        if (killed / "checkpoints" / "latest").exists() and rows >= 5:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert json.loads((killed / "run.json").read_text())["status"] == "running"
    with open(killed / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 99, "loss": 0.1')  # a torn row, as a kill mid-write leaves

    resumed = trainer_cli("run", "killed", "--resume", "--runs-dir", str(runs), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(metric_rows(killed)) == comparable(metric_rows(runs / "straight"))
    assert json.loads((killed / "run.json").read_text())["status"] == "completed"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "x", "--set", "gama=4"], "unknown config key 'gama'"),
        (["run", "x", "--set", "block_size=0"], "block_size"),
        (["run", "--preset", "v9"], "unknown preset 'v9'"),
        (["run", "nothing-here", "--resume"], "nothing to resume"),
        (["run", "x", "--set", "target=/no/such/model"], "/no/such/model"),
        (["run", "x", "--set", "data=/no/such/data.jsonl", "--set", "target=TARGET"], "/no/such/data.jsonl"),
        (["run", "x", "--config", "/no/such/config.yaml"], "cannot read config file"),
        (["run", "--fixed", "--from", "ghost"], "has no diagnosis"),
        (["run", "..", "--set", "target=TARGET"], "run name '..'"),
        (["run", "a/b", "--set", "target=TARGET"], "run name 'a/b'"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(args, message, small_target, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from trainer.cli import app

    monkeypatch.setenv("COLUMNS", "400")  # one line stays one line in rich's output
    args = [a.replace("TARGET", str(small_target)) for a in args]
    result = CliRunner().invoke(app, [*args, "--runs-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback
    assert len(result.stderr.strip().splitlines()) == 1


def test_existing_run_is_never_overwritten(small_target, tmp_path):
    from typer.testing import CliRunner

    from trainer.cli import app

    config = write_config(tmp_path / "c.json", small_target, steps=2)
    args = ["run", "a", "--config", str(config), "--runs-dir", str(tmp_path), "--quiet"]
    assert CliRunner().invoke(app, args).exit_code == 0
    before = (tmp_path / "a" / "metrics.jsonl").read_text()
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "already exists" in again.stderr
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == before


def test_fixed_from_v5_applies_sleuths_patch_and_the_new_run_is_clean(small_target, tmp_path):
    runs = tmp_path / "runs"
    tiny = ["--set", f"target={small_target}", "--set", "checkpoint_every=4"]
    tiny += [f"--set={key}={json.dumps(value)}" for key, value in TINY.items() if key != "checkpoint_every"]
    for preset in ("v3", "v5"):
        result = trainer_cli("run", "--preset", preset, "--steps", "4", "--runs-dir", str(runs), "--quiet", *tiny)
        assert result.returncode == 0, result.stderr

    # The probes are checked on the fixed run below (and in tests/probes); once is enough for this test's time.
    diagnosis = sleuth_cli("diagnose", "--run", "v5", "--runs-dir", str(runs), "--offline", "--no-probe",
                           "--format", "json")
    assert diagnosis.returncode == 1, diagnosis.stderr
    report = json.loads(diagnosis.stdout)
    mismatches = {f["id"] for f in report["findings"] if f["status"] == "mismatch"}
    assert mismatches == {"dflash.fc_input_layers", "dflash.target_logits_source", "dflash.loss_decay_gamma"}

    fixed = trainer_cli("run", "--fixed", "--from", "v5", "--runs-dir", str(runs), "--quiet")
    assert fixed.returncode == 0, fixed.stderr
    assert "applying the fix" in fixed.stderr
    new_config = json.loads((runs / "v6" / "config.json").read_text())  # v3, v5 -> the next free vN is v6
    assert new_config["fc_layers"] is None
    assert new_config["target_logits_source"] == "final"
    assert new_config["loss_decay_gamma"] == 4.0
    assert new_config["seq_len"] == TINY["seq_len"]  # everything else is v5's

    clean = sleuth_cli("diagnose", "--run", "v6", "--runs-dir", str(runs), "--offline", "--format", "json")
    assert clean.returncode == 0, clean.stdout[-2000:] + clean.stderr
    assert not [f["id"] for f in json.loads(clean.stdout)["findings"] if f["status"] == "mismatch"]


def test_resume_extends_the_saved_config_and_refuses_other_data(small_target, tmp_path):
    from typer.testing import CliRunner

    from trainer.cli import app

    data = tmp_path / "data.txt"
    data.write_text("\n\n".join(f"line {i} " + " ".join(str(j) for j in range(i, i + 30)) for i in range(40)))
    config = write_config(tmp_path / "c.json", small_target, steps=2, data=str(data), eval_every=None)
    runs = ["--runs-dir", str(tmp_path / "runs"), "--quiet"]
    assert CliRunner().invoke(app, ["run", "r", "--config", str(config), *runs]).exit_code == 0

    extended = CliRunner().invoke(app, ["run", "r", "--resume", "--steps", "3", *runs])
    assert extended.exit_code == 0, extended.output
    run = tmp_path / "runs" / "r"
    assert json.loads((run / "config.json").read_text())["steps"] == 3  # what the run now trains to
    assert json.loads((run / "run.json").read_text())["steps_done"] == 3
    assert [r["step"] for r in metric_rows(run)] == [1, 2, 3]

    data.write_text(data.read_text() + "\n\nsomething new entirely")
    refused = CliRunner().invoke(app, ["run", "r", "--resume", "--steps", "4", *runs])
    assert refused.exit_code == 2
    assert "started on another data" in refused.stderr
    assert [r["step"] for r in metric_rows(run)] == [1, 2, 3]  # nothing was touched
