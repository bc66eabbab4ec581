"""Our own trainer through the observer, with no entry of its own: a real tiny v5 run on the embedded target,
observed through the command it recorded (`--observe-recorded`), and the fixed preset run as a plain command.

v5's planted defects the observed step measures: fc reads 4 of the 5 layers (the features that reach the loss
are layers [1, 2, 3, 4] of 8, the rule's are [1, 2, 3, 4, 5]) and gamma 7 at block 4 (recovered from the
gradient at the hidden input of the trainer's fused head+loss Function). Its teacher (targets from layer 5, the
last selected) is computed inside that Function and stays unknown. The fixed preset raises no alarm.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timing import scaled_timeout

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TINY = {"seq_len": 64, "batch_size": 4, "block_size": 4, "max_anchors": 6, "draft_layers": 5, "lr": 3e-3,
        "warmup_steps": 2, "log_every": 1, "eval_every": None, "eval_prompts": 1, "eval_max_new_tokens": 4,
        "checkpoint_every": 1, "steps": 1}


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A target readable by the observed command (it runs as an unprivileged user), a tiny config, a v5 run."""
    from trainer.target.embedded import build_embedded_target

    root = tmp_path_factory.mktemp("observed-trainer")
    target = build_embedded_target(root / "target", small=True, progress=False, steps=1)
    for path in [target, *target.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o005)
    (root / "tiny.json").write_text(json.dumps({**TINY, "target": str(target)}))
    done = subprocess.run([sys.executable, "-m", "trainer.cli", "run", "v5", "--preset", "v5", "--config",
                           str(root / "tiny.json"), "--runs-dir", str(root / "runs"), "--device", "cpu", "--quiet"],
                          cwd=root, env=env(), capture_output=True, text=True, timeout=scaled_timeout(240))
    assert done.returncode == 0, done.stderr
    return root


def diagnose(cwd: Path, out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    done = subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", "--offline", "--out", str(out), *args],
                          cwd=cwd, env=env(), capture_output=True, text=True, timeout=scaled_timeout(300))
    assert (out / "report.json").exists(), done.stderr
    return done, json.loads((out / "report.json").read_text())


def observed(report: dict) -> dict[str, tuple[str, str]]:
    """invariant -> (the observed verdict's status, its text), for the verdicts of the observed step."""
    found = {}
    for finding in report["findings"]:
        for evidence in finding["evidence"]:
            if evidence["kind"] == "probe" and evidence["location"] == "probe:observed-step":
                found[finding["id"]] = (evidence["value"].split(":", 1)[0], evidence["value"])
    return found


def test_v5_observed_through_its_recorded_command_measures_its_fc_layers_and_gamma(place: Path) -> None:
    done, report = diagnose(place, place / "v5-report", "--run", str(place / "runs" / "v5"), "--probe",
                            "--observe-recorded")
    assert done.returncode == 1, done.stderr
    assert "the run's recorded command" in done.stderr and "trainer.cli run v5 --config" in done.stderr
    found = observed(report)
    assert found["dflash.target_layer_ids"][0] == "mismatch"
    assert "[1, 2, 3, 4] of a 8-layer target" in found["dflash.target_layer_ids"][1]
    assert found["dflash.loss_decay_gamma"][0] == "mismatch" and "gamma 7.000" in found["dflash.loss_decay_gamma"][1]
    assert "fused into _FusedBlockLoss" in found["dflash.loss_decay_gamma"][1]
    assert found["dflash.anchor_slot_untrained"][0] == "match"
    assert found["dflash.target_logits_source"][0] == "unknown"  # its teacher is inside the fused Function


def test_fixed_preset_as_a_plain_command_raises_no_alarm(place: Path, tmp_path: Path) -> None:
    code = tmp_path / "code"
    shutil.copytree(ROOT / "trainer", code / "trainer", ignore=shutil.ignore_patterns("__pycache__"))
    done, report = diagnose(code, tmp_path / "report", "--code", ".", "--probe", "--", "python", "-m", "trainer.cli",
                            "run", "fixed", "--preset", "fixed", "--config", str(place / "tiny.json"), "--quiet")
    assert done.returncode == 0, done.stderr
    found = observed(report)
    assert not [f["id"] for f in report["findings"] if f["status"] == "mismatch"], report["summary"]
    assert found["dflash.target_layer_ids"][0] == "match" and found["dflash.fc_input_layers"][0] == "match"
    assert found["dflash.loss_decay_gamma"][0] == "match" and "gamma 4.000" in found["dflash.loss_decay_gamma"][1]
    assert "visible to the command read-only" in " ".join(report["probes"]["notes"])
