"""What an observed command needs from outside its code copy, and one line when it cannot run here.

The failures are real: each command really fails in the sandbox (a CUDA tensor on the CPU build of torch, a
missing module, a missing file, a server that cannot be reached), and sleuth says in one line what it needed.
The recorded-command offer is read from the committed speculators save directory (written by speculators).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.observe.needs import named_inputs
from sleuth.observe.runner import observe_command

ROOT = Path(__file__).resolve().parents[2]
SPECOUT = ROOT / "tests" / "fixtures" / "speculators" / "specout"


def test_inputs_are_the_paths_the_command_names_directly_as_key_value_or_in_its_config(tmp_path: Path) -> None:
    code, cache, target, elsewhere = (tmp_path / name for name in ("code", "cache", "target", "elsewhere"))
    for folder in (code, cache, target, elsewhere):
        folder.mkdir()
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"model": {"target": str(target)}, "name": "x", "missing": str(tmp_path / "gone")}))
    (code / "train.py").write_text("")
    found = named_inputs(["python", "train.py", "--data", str(cache), f"--config={config}", "out=relative"],
                         code, code)
    assert found == [cache.resolve(), config.resolve(), target.resolve()]
    assert elsewhere.resolve() not in found  # nothing the command does not name


@pytest.mark.parametrize("source, needed", [
    ("import torch; torch.zeros(1, device='cuda')", "it needs a CUDA GPU"),
    ("import torch, not_a_module_anywhere", "it needs the Python module not_a_module_anywhere"),
    ("import torch; open('/prepared/features/hs_0.safetensors', 'rb')",
     "it needs the file /prepared/features/hs_0.safetensors"),
    ("import socket, torch; socket.create_connection(('127.0.0.1', 8000), timeout=5)", "it needs a server or the network"),
])
def test_a_command_that_cannot_run_here_says_what_it_needed(tmp_path: Path, source: str, needed: str) -> None:
    outcome = observe_command(["python", "-c", source], tmp_path, timeout_s=120)
    assert outcome.error is not None and outcome.error.startswith("the command cannot run here: " + needed), outcome.error
    assert "\n" not in outcome.error
    assert all(v.status == "unknown" for v in outcome.verdicts)


def sleuth(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", "--offline", *args], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)


def test_the_recorded_command_is_offered_and_runs_only_with_probe(tmp_path: Path) -> None:
    done = sleuth("--run", str(SPECOUT), "--out", str(tmp_path / "report"), "--probe", cwd=tmp_path)
    offered = [line for line in done.stderr.splitlines() if line.startswith("the run recorded its training command")]
    assert len(offered) == 1, done.stderr
    assert f"speculators train --config {SPECOUT / 'run.yaml'}" in offered[0]
    assert offered[0].endswith(f"sleuth diagnose --run {SPECOUT} --probe --observe-recorded")
    refused = sleuth("--run", str(SPECOUT), "--out", str(tmp_path / "again"), "--observe-recorded", cwd=tmp_path)
    assert refused.returncode == 2 and not (tmp_path / "again").exists()
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "add --probe to consent" in lines[0]


def test_credentials_and_system_folders_are_never_opened_to_the_command(tmp_path: Path) -> None:
    """A config file (a checkout's, perhaps) that names ~/.ssh or /etc does not open them to the observed command;
    a model cache under .cache does open."""
    code = tmp_path / "code"
    code.mkdir()
    ssh = tmp_path / "home" / ".ssh"
    ssh.mkdir(parents=True)
    (ssh / "id_rsa").write_text("secret")
    model = tmp_path / "home" / ".cache" / "huggingface" / "hub" / "tiny"
    model.mkdir(parents=True)
    token = tmp_path / "home" / ".cache" / "huggingface" / "token"
    token.write_text("hf_x")
    config = code / "c.json"
    config.write_text(json.dumps({"a": str(ssh / "id_rsa"), "b": "/etc/passwd", "c": str(model), "d": str(token)}))
    found = named_inputs(["python", "train.py", "--config", str(config), str(ssh)], code, code)
    assert found == [model.resolve()]
