"""The trainer's own artifacts under faults: what `--force` may replace, stop signals, a full disk and damaged
manifests during hidden-state generation, and a fix.yaml applied to the run it was written for only.

Each case is the real command (in this process, so the small embedded target and the base run are built once)
on real files: a real run, a real Hugging Face model directory, real signals sent to this process, a real
ENOSPC from the kernel (/dev/full), a fix.yaml written by the real `sleuth diagnose`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from trainer_faults import assert_one_line_error, copy_base_run, invoke, small_target, snapshot, tiny_config


# --- trainer export --force ----------------------------------------------------------------------------------

@pytest.mark.parametrize("out_is", ["the run itself", "a Hugging Face model", "another run"])
def test_export_force_replaces_only_an_export_of_ours(tmp_path: Path, out_is: str) -> None:
    runs = tmp_path / "runs"
    copy_base_run(runs, "r")
    if out_is == "the run itself":
        out = runs / "r"
    elif out_is == "a Hugging Face model":
        out = tmp_path / "model"
        shutil.copytree(small_target(), out)  # save_pretrained's config.json + model.safetensors
    else:
        out = copy_base_run(runs, "other")
    before = snapshot(out)
    result = invoke("export", "r", "--runs-dir", str(runs), "--out", str(out), "--force")
    line = assert_one_line_error(result.stderr, result.exit_code)
    assert "--force only replaces an earlier `trainer export` output" in line, line
    assert snapshot(out) == before  # the run's config.json (or the model's weights) untouched


def test_export_force_replaces_an_earlier_export_and_nothing_it_cannot_prove_is_one(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    copy_base_run(runs, "r")
    out = tmp_path / "served"
    assert invoke("export", "r", "--runs-dir", str(runs), "--out", str(out)).exit_code == 0
    forced = invoke("export", "r", "--runs-dir", str(runs), "--out", str(out), "--force", "--format", "speculators")
    assert forced.exit_code == 0, forced.output
    assert "aux_hidden_state_layer_ids" in json.loads((out / "config.json").read_text())
    (out / "model.safetensors").write_bytes(b"torn")  # no longer provably ours: not replaced blindly
    refused = invoke("export", "r", "--runs-dir", str(runs), "--out", str(out), "--force")
    assert "not readable as an export of ours" in assert_one_line_error(refused.stderr, refused.exit_code)


# --- SIGTERM / SIGHUP ------------------------------------------------------------------------------------------

class _NotHandled(Exception):
    pass


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_marks_the_run_interrupted_and_it_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                signum: int) -> None:
    """The signal is really sent to this process at the third training step. A trainer that installed no
    handler of its own would meet the test's fallback one (a trainer process would die with run.json still
    `running`)."""
    import trainer.run.loop as loop

    real_step, calls = loop.training_step, {"n": 0}

    def step_then_signal(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signum)
        return real_step(*args, **kwargs)

    def fallback(received: int, frame: object) -> None:
        raise _NotHandled(f"signal {received} reached the test's handler: the trainer does not handle it")

    monkeypatch.setattr(loop, "training_step", step_then_signal)
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tiny_config()))
    runs = tmp_path / "runs"
    previous = signal.signal(signum, fallback)
    try:
        result = invoke("run", "s", "--config", str(config), "--runs-dir", str(runs), "--quiet")
    finally:
        signal.signal(signum, previous)
    name = signal.Signals(signum).name
    line = assert_one_line_error(result.stderr, result.exit_code, code=128 + signum)
    assert f"stopped by {name}" in line and "--resume" in line, line
    info = json.loads((runs / "s" / "run.json").read_text())
    assert info["status"] == "interrupted" and info.get("error") is None, info
    monkeypatch.undo()
    resumed = invoke("run", "s", "--resume", "--runs-dir", str(runs), "--quiet")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((runs / "s" / "run.json").read_text())["status"] == "completed"


# --- trainer hidden-states generate -----------------------------------------------------------------------------

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _generate(tmp_path: Path, out: Path):  # noqa: ANN202 - typer's Result
    """`trainer hidden-states generate` on 40 short documents: three shards of 64 packed rows, ~3 MB each."""
    data = tmp_path / "docs.txt"
    if not data.exists():
        data.write_text("\n\n".join(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(60)) for i in range(40)) + "\n")
    config = tmp_path / "hs.json"
    config.write_text(json.dumps(tiny_config(data=str(data))))
    return invoke("hidden-states", "generate", "--out", str(out), "--config", str(config), "--rows-per-shard", "64",
                  "--device", "cpu")


def _one_error_line(result) -> str:  # noqa: ANN001 - typer's Result
    """Progress lines (`shard 1/3 (64 rows)`) may precede it: exactly one error line, exit 2, no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("shard ")]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    return lines[0]


def test_a_full_disk_during_generation_is_one_line_and_the_same_command_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second shard's write fails as safetensors fails on ENOSPC: its own error type, carrying the OS
    error (`No space left on device (os error 28)`), which is not an OSError."""
    from safetensors import SafetensorError

    import trainer.hidden_states.generate as generate
    import trainer.run.checkpoint as checkpoint

    real_save, calls = checkpoint.save_file, {"n": 0}

    def second_write_fails(tensors, filename, metadata=None):  # noqa: ANN001 - safetensors' signature
        calls["n"] += 1
        if calls["n"] == 2:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", second_write_fails)
    monkeypatch.setattr(generate, "save_file", second_write_fails, raising=False)  # where it was imported before
    out = tmp_path / "hs"
    full = _generate(tmp_path, out)
    line = _one_error_line(full)
    assert line.startswith("error: disk full writing") and "rerun the same" in line, line
    assert [p.name for p in sorted(out.iterdir())] == ["manifest.json", "shard-00000.safetensors"]  # no torn shard
    monkeypatch.undo()
    resumed = _generate(tmp_path, out)
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((out / "manifest.json").read_text())["complete"]


@pytest.mark.slow
def test_a_real_full_disk_during_generation(tmp_path: Path) -> None:
    """A 5 MB tmpfs (where this machine lets a test mount one): the first 3 MB shard fits, the second does not."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a real full disk needs a tmpfs mount: not root here")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or mounted.returncode})")
    try:
        full = _generate(tmp_path, disk / "hs")
        line = _one_error_line(full)
        assert line.startswith("error: disk full writing"), line
        shutil.copytree(disk / "hs", tmp_path / "hs")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert not [p for p in (tmp_path / "hs").iterdir() if p.name.startswith(".")]  # no staged shard left
    resumed = _generate(tmp_path, tmp_path / "hs")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((tmp_path / "hs" / "manifest.json").read_text())["complete"]


# Each a field of a real manifest: a generation resuming into the cache, and a run training from it, read it.
MANIFEST_DAMAGES = {
    "logits_check a list": ("logits_check", []),
    "shards a string": ("shards", "3"),
    "layers of strings": ("layers", ["1", "5", "7"]),
    "target.fingerprint a number": ("target.fingerprint", 7),
}


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hidden-states")
    made = _generate(root, root / "hs")
    assert made.exit_code == 0, made.output
    return root / "hs"


@pytest.mark.parametrize("damage", list(MANIFEST_DAMAGES))
def test_a_damaged_hidden_state_manifest_is_one_line(real_cache: Path, tmp_path: Path, damage: str) -> None:
    out = tmp_path / "hs"
    shutil.copytree(real_cache, out)
    manifest = json.loads((out / "manifest.json").read_text())
    dotted, value = MANIFEST_DAMAGES[damage]
    *parents, last = dotted.split(".")
    node = manifest
    for part in parents:
        node = node[part]
    node[last] = value
    (out / "manifest.json").write_text(json.dumps(manifest))
    resumed = _generate(real_cache.parent, out)  # the same inputs as the cache's: only the damage differs
    line = _one_error_line(resumed)
    assert "manifest.json" in line and "damaged" in line, line
    config = tmp_path / "run.json"
    config.write_text(json.dumps(tiny_config(data=str(real_cache.parent / "docs.txt"), hidden_states=str(out))))
    training = invoke("run", "h", "--config", str(config), "--runs-dir", str(tmp_path / "runs"), "--quiet")
    assert "manifest.json" in assert_one_line_error(training.stderr, training.exit_code)


# --- fix.yaml provenance ----------------------------------------------------------------------------------------

def test_a_fix_yaml_written_for_another_run_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sleuth diagnoses v5 and (with --out) leaves its fix.yaml in v3's diagnosis/: `--fixed --from v3` must not
    patch v3's config with a fix computed for v5's."""
    from typer.testing import CliRunner

    from sleuth.cli import app as sleuth_app

    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "sleuth-cache"))
    monkeypatch.setenv("SLEUTH_CONFIG_FILE", str(tmp_path / "no-config.yaml"))
    runs = tmp_path / "runs"
    for name in ("v5", "v3"):
        run = copy_base_run(runs, name)
        info = json.loads((run / "run.json").read_text())
        (run / "run.json").write_text(json.dumps({**info, "name": name}))
    v3 = runs / "v3"
    config = json.loads((v3 / "config.json").read_text())
    (v3 / "config.json").write_text(json.dumps({**config, "loss_decay_gamma": 7.0}))
    diagnosed = CliRunner().invoke(sleuth_app, ["diagnose", "--run", str(runs / "v5"), "--offline", "--no-probe",
                                                "--out", str(v3 / "diagnosis")])
    assert diagnosed.exit_code in (0, 1), diagnosed.output
    before = snapshot(runs)
    result = invoke("run", "--fixed", "--from", "v3", "--runs-dir", str(runs), "--quiet")
    line = assert_one_line_error(result.stderr, result.exit_code, naming="fix.yaml")
    assert "written for run 'v5'" in line and "not for v3" in line, line
    assert snapshot(runs) == before  # no vN made, nothing changed


def test_a_fix_yaml_that_names_no_run_is_refused(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run = copy_base_run(runs, "v5")
    (run / "diagnosis").mkdir()
    (run / "diagnosis" / "fix.yaml").write_text("config_patch: {loss_decay_gamma: 4.0}\ncode_changes: []\n")
    result = invoke("run", "--fixed", "--from", "v5", "--runs-dir", str(runs), "--quiet")
    assert "does not say which run" in assert_one_line_error(result.stderr, result.exit_code)
    assert sorted(p.name for p in runs.iterdir()) == ["v5"]


# --- --fixed without --from: only a run's own diagnosis (issue 22, F15) -----------------------------------------

def _diagnose(run: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, out: Path | None = None) -> None:
    """The real `sleuth diagnose` (in this process): a fix.yaml with the provenance it records."""
    from typer.testing import CliRunner

    from sleuth.cli import app as sleuth_app

    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "sleuth-cache"))
    monkeypatch.setenv("SLEUTH_CONFIG_FILE", str(tmp_path / "no-config.yaml"))
    args = ["diagnose", "--run", str(run), "--offline", "--no-probe"] + (["--out", str(out)] if out else [])
    diagnosed = CliRunner().invoke(sleuth_app, args)
    assert diagnosed.exit_code in (0, 1), diagnosed.output


def _named_run(runs: Path, name: str, **config: object) -> Path:
    run = copy_base_run(runs, name)
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "name": name}))
    if config:
        values = json.loads((run / "config.json").read_text())
        (run / "config.json").write_text(json.dumps({**values, **config}))
    return run


def test_fixed_refuses_a_foreign_fix_yaml_dated_in_the_future(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's v3 is diagnosed; a run dropped into runs/ ships a hand-written fix.yaml dated 2030. On main
    `trainer run --fixed` trained the dropped run's config with its patch (lr 0.5), saying only a path."""
    runs = tmp_path / "runs"
    _diagnose(_named_run(runs, "v3", loss_decay_gamma=7.0), monkeypatch, tmp_path)
    colleague = _named_run(runs, "colleague")
    (colleague / "diagnosis").mkdir()
    fix = colleague / "diagnosis" / "fix.yaml"
    fix.write_text("diagnosed_run: colleague\nconfig_patch: {loss_decay_gamma: 7.0, lr: 0.5}\ncode_changes: []\n")
    os.utime(fix, (1_893_456_000, 1_893_456_000))  # 2030-01-01
    before = snapshot(runs)
    result = invoke("run", "--fixed", "--runs-dir", str(runs), "--quiet")
    line = assert_one_line_error(result.stderr, result.exit_code, naming="colleague/diagnosis/fix.yaml")
    assert "not sleuth's diagnosis of the run it sits in" in line and "--from" in line, line
    assert snapshot(runs) == before  # no vN made


def test_fixed_applies_the_newest_own_diagnosis_and_says_which(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Own diagnoses are recognised by their recorded path and config hash: the newest applies, named in the
    note. A fix.yaml copied in from a run diagnosed elsewhere (its recorded path is not where it sits) and
    older than the own one is passed over; two own ones equally new are ambiguous and refused."""
    from trainer.commands.run import _fixed_config
    from trainer.errors import UsageError

    runs = tmp_path / "runs"
    v3 = _named_run(runs, "v3", loss_decay_gamma=7.0)
    v5 = _named_run(runs, "v5", loss_decay_gamma=9.0)
    elsewhere = _named_run(tmp_path / "elsewhere", "shared", loss_decay_gamma=11.0)
    for run in (v3, v5, elsewhere):
        _diagnose(run, monkeypatch, tmp_path)
    shutil.copytree(elsewhere, runs / "shared")  # a colleague's run, diagnosed there, then copied here
    os.utime(runs / "shared" / "diagnosis" / "fix.yaml", (1_000_000_000, 1_000_000_000))  # older than v3/v5
    os.utime(v3 / "diagnosis" / "fix.yaml", (1_700_000_000, 1_700_000_000))
    os.utime(v5 / "diagnosis" / "fix.yaml", (1_700_000_100, 1_700_000_100))

    values, preset, notes = _fixed_config(runs, None)
    assert preset is None and "v5/diagnosis/fix.yaml" in notes[0] and "run v5" in notes[0], notes
    assert values["loss_decay_gamma"] == 4.0 and values["lr"] == json.loads((v5 / "config.json").read_text())["lr"]

    os.utime(v3 / "diagnosis" / "fix.yaml", (1_700_000_100, 1_700_000_100))
    with pytest.raises(UsageError, match="equally new"):
        _fixed_config(runs, None)

    # the copied run's diagnosis, newest of all: refused, though it is a genuine sleuth fix.yaml
    os.utime(runs / "shared" / "diagnosis" / "fix.yaml", (1_800_000_000, 1_800_000_000))
    with pytest.raises(UsageError, match="it was written for .*elsewhere/shared"):
        _fixed_config(runs, None)
