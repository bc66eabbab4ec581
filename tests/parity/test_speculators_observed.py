"""A tiny `speculators train` (DFlash) run, observed for one optimizer step: `sleuth diagnose --code . --probe
--probe-python <speculators venv> -- python make_speculators_fixture.py --train-on-cpu ...`.

speculators' own training code runs as written (tools/make_speculators_fixture.py points only its device choice at
the CPU); its verifier is a tiny Qwen3 saved with save_pretrained, its data comes from its own `prepare-data`, and
its hidden-state cache is what the HF verifier computes at vLLM's capture points (speculators' own
`check_hidden_states` validates it). The clean run's observed verdicts raise no alarm: what the step exercised
(slot 0 untrained, the frozen embeddings and head) matches, and what it could not follow (features from the cache,
the teacher over cached hidden states, D-PACE weights) stays unknown. The plain `speculators train` on a machine
without an accelerator fails in one line saying it needs a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from speculators_guard import require_speculators

require_speculators()

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "make_speculators_fixture.py"
TRAIN = ["--speculator-type", "dflash", "--verifier-name-or-path", "verifier", "--data-path", "data", "--save-path",
         "specout", "--epochs", "1", "--num-layers", "1", "--block-size", "4", "--max-anchors", "8",
         "--total-seq-len", "96", "--target-layer-ids", "2", "4", "5", "--draft-attn-impl", "sdpa",
         "--hidden-states-dtype", "float32", "--num-workers", "0", "--on-missing", "raise", "--seed", "0",
         "--optimizer", "adamw", "--lr", "1e-3", "--log-freq", "1", "--loss-implementation", "eager",
         "--run-name", "specout"]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's directory: the verifier, speculators' prepared data with its hidden-state cache, the launcher."""
    spec = importlib.util.spec_from_file_location("make_speculators_fixture", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = tmp_path_factory.mktemp("speculators-observed")
    here = Path.cwd()
    os.chdir(root)  # the tool writes relative paths, as a user's run would
    try:
        module.build_verifier(Path("."), train_steps=0)
        data = module.prepare_data(Path("."), Path("verifier"))
        module.cache_hidden_states(data, Path("verifier"))
    finally:
        os.chdir(here)
    shutil.copy(TOOL, root / TOOL.name)
    return root


def observe(project: Path, out: Path, *command: str) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    done = subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", "--offline", "--out", str(out), "--code",
                           ".", "--probe", "--probe-python", sys.executable, "--", *command], cwd=project,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
    report = out / "report.json"
    return done, json.loads(report.read_text()) if report.exists() else None


def observed(report: dict) -> dict[str, str]:
    return {f["id"]: e["value"] for f in report["findings"] for e in f["evidence"]
            if e["kind"] == "probe" and e["location"] == "probe:observed-step"}


def test_clean_speculators_step_observed_without_false_alarm(project: Path, tmp_path: Path) -> None:
    done, report = observe(project, tmp_path / "report", "python", TOOL.name, "--train-on-cpu", *TRAIN)
    assert report is not None, done.stderr
    mismatches = {f["id"]: [e["value"][:300] for e in f["evidence"]] for f in report["findings"]
                  if f["status"] == "mismatch"}
    assert done.returncode == 0 and not mismatches, mismatches
    found = observed(report)
    assert found["dflash.anchor_slot_untrained"].startswith("match: slot 0 weight 0")
    assert found["dflash.frozen_embed_head"].startswith("match: unchanged by the observed step")
    assert "DFlashDraftModel.lm_head" in found["dflash.anchor_slot_untrained"]
    for invariant in ("dflash.target_layer_ids", "dflash.fc_input_layers", "dflash.target_shift",
                      "dflash.loss_decay_gamma"):
        assert found[invariant].startswith("unknown"), (invariant, found[invariant])


def test_fixed_decay_gamma_7_at_block_4_is_measured(project: Path, tmp_path: Path) -> None:
    done, report = observe(project, tmp_path / "report", "python", TOOL.name, "--train-on-cpu", *TRAIN,
                           "--per-position-loss-weight", "fixed-exp-decay", "--dflash-decay-gamma", "7.0")
    assert report is not None and done.returncode == 1, done.stderr
    assert observed(report)["dflash.loss_decay_gamma"].startswith("mismatch: gamma 7.000 at block size 4")


def test_plain_speculators_train_without_an_accelerator_fails_in_one_line(project: Path, tmp_path: Path) -> None:
    done, _report = observe(project, tmp_path / "report", str(Path(sys.executable).parent / "speculators"), "train",
                            *TRAIN)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert "the command cannot run here: it needs a CUDA GPU" in errors[0]
