"""The step's memory estimate (trainer/run/memory.py) against a measured peak, and the refusal it drives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_target import CPU, save_tiny_target
from tests.timing import scaled_timeout
from trainer.config import build_config, resolve_for_target
from trainer.run.memory import estimate_step_memory
from trainer.target.embedded import build_embedded_tokenizer
from trainer.target.frozen import FrozenTarget

REPO = Path(__file__).resolve().parents[2]
EXTRA_ROWS = 30_000  # a ~31k vocabulary on a 32-wide target: logits, not weights, are what a step holds

# Resident memory of one training step (forward, loss, backward, optimizer) above the resident memory before
# it: the kernel's high-water mark, reset before the step. glibc returns every block above 64 KiB to the
# kernel when freed (MALLOC_MMAP_THRESHOLD_, set before the process starts), so RSS follows the tensors.
MEASURE = r"""
import json, sys, torch
torch.set_num_threads(1)
from trainer.config import build_config, resolve_for_target
from trainer.data.datasets import Document, batch_for_step, pack_documents
from trainer.model.loss import loss_chunk_slots
from trainer.run.loop import build_drafter, optimizer_step
from trainer.run.memory import estimate_step_memory
from trainer.run.optim import build_optimizer
from trainer.run.step import StepPlan, dflash_step, sample_step_anchors
from trainer.target.frozen import FrozenTarget

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

target = FrozenTarget.load(sys.argv[1], torch.device("cpu"))
out = []
for overrides in json.loads(sys.argv[2]):
    config = resolve_for_target(build_config(overrides=overrides), target.num_layers)
    config = config.model_copy(update={"loss_chunk_size": loss_chunk_slots(
        config.loss_chunk_size, target.vocab_size, config.block_size)})
    docs = [Document([5 + (7 * i) % 200 for i in range(n)], [1] * n) for n in (300, 500, 400, 700)]
    packed = pack_documents(docs, config.seq_len, target.pad_token_id)
    plan = StepPlan.from_config(config, target)
    drafter = build_drafter(config, target, plan)
    optimizer = build_optimizer(config, drafter)
    peaks = []
    for step in (1, 2):  # the second step: the optimizer's state exists already, as in a run
        batch = batch_for_step(packed, step, config.batch_size, 0)
        anchors, valid = sample_step_anchors(batch, plan, 0, step)
        open("/proc/self/clear_refs", "w").write("5")
        before = status("VmRSS:")
        loss, _ = dflash_step(target, drafter, batch, anchors, valid, plan)
        optimizer_step(config, drafter, optimizer, loss)
        peaks.append(status("VmHWM:") - before)
    estimate = estimate_step_memory(config, target)
    out.append({"measured": peaks[1], "estimated": estimate.peak - estimate.weights, "largest": estimate.largest()})
    del drafter, optimizer
print(json.dumps(out))
"""

CASES = [  # (overrides, the part that should dominate)
    (["seq_len=256", "batch_size=1", "max_anchors=64", "block_size=8", "draft_layers=1", "loss_chunk_size=512"],
     "loss"),
    (["seq_len=256", "batch_size=1", "max_anchors=64", "block_size=8", "draft_layers=1", "loss=kl"], "loss"),
    (["seq_len=1024", "batch_size=1", "max_anchors=256", "block_size=16", "draft_layers=3", "loss_chunk_size=16"],
     "drafter"),
]


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory):
    tokenizer = build_embedded_tokenizer(small=True)
    return save_tiny_target(tmp_path_factory.mktemp("wide"), tokenizer, extra_rows=EXTRA_ROWS)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_estimate_covers_the_measured_step_peak_without_wasting_much(wide_target):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", MEASURE, str(wide_target), json.dumps([c for c, _ in CASES])],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for (overrides, largest), row in zip(CASES, json.loads(result.stdout.splitlines()[-1])):
        ratio = row["estimated"] / row["measured"]
        assert row["largest"] == largest, (overrides, row)
        assert 1.0 <= ratio <= 1.6, (overrides, row)


def test_the_parts_move_with_their_knobs(wide_target):
    target = FrozenTarget.load(str(wide_target), CPU)

    def estimate(*overrides):
        config = resolve_for_target(build_config(overrides=["batch_size=1", *overrides]), target.num_layers)
        return estimate_step_memory(config, target)

    base = estimate("seq_len=512", "max_anchors=32", "loss_chunk_size=64")
    chunk = estimate("seq_len=512", "max_anchors=32", "loss_chunk_size=128")
    larger = estimate("seq_len=512", "max_anchors=32", "loss_chunk_size=256")
    anchors = estimate("seq_len=512", "max_anchors=64", "loss_chunk_size=64")
    longer = estimate("seq_len=1024", "max_anchors=32", "loss_chunk_size=64")
    wider = estimate("seq_len=512", "max_anchors=32", "loss_chunk_size=64", "draft_config.intermediate_size=1024")
    # linear in the chunk, at least one float32 logit row per slot, and nothing else moves
    assert larger.loss - chunk.loss == pytest.approx(2 * (chunk.loss - base.loss), rel=1e-6)
    assert chunk.loss - base.loss >= 64 * target.vocab_size * 4
    assert chunk.drafter == base.drafter and chunk.target_forward == base.target_forward
    assert anchors.drafter > 1.5 * base.drafter and anchors.loss - base.loss < 0.01 * base.loss
    assert longer.target_forward > 2 * base.target_forward and longer.loss == base.loss
    # the drafter the run builds: its own draft_config shape (an MLP 16x the target's 64 here)
    assert wider.drafter > 2 * base.drafter and wider.weights > base.weights and wider.loss == base.loss


@pytest.mark.parametrize("overrides, knob", [
    (["max_anchors=100000", "loss_chunk_size=16"], "lower max_anchors"),
    (["max_anchors=2000", "block_size=16", "draft_layers=1", "loss_chunk_size=100000000"], "lower loss_chunk_size"),
    (["seq_len=1048576", "max_anchors=4", "loss_chunk_size=16"], "lower seq_len or batch_size"),
])
def test_a_step_too_large_for_memory_is_refused_in_one_line_naming_the_knob(
        tmp_path, monkeypatch, wide_target, overrides, knob):
    """16 GiB of memory here (whatever the machine has): the estimate is over it, nothing is written."""
    import trainer.run.loop as loop
    import trainer.run.memory as memory
    from tests.faults.trainer_faults import assert_one_line_error, invoke

    def never(*args, **kwargs):
        raise AssertionError("the step ran: the config was not refused")

    monkeypatch.setattr(memory, "_device_memory_bytes", lambda device: 16 * 2**30)
    monkeypatch.setattr(loop, "training_step", never)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"target": str(wide_target), "seq_len": 4096, "batch_size": 8, "eval_every": None}))
    runs = tmp_path / "runs"
    result = invoke("run", "big", "--config", str(config), "--runs-dir", str(runs), "--quiet",
                    *[arg for item in overrides for arg in ("--set", item)])
    line = assert_one_line_error(result.stderr, result.exit_code)
    assert "needs at least" in line and "GiB of cpu memory here" in line and knob in line, line
    assert not (runs / "big").exists()


def test_runs_within_memory_are_not_refused(wide_target):
    from trainer.run.memory import check_fits_memory

    target = FrozenTarget.load(str(wide_target), CPU)
    config = resolve_for_target(build_config(overrides=["seq_len=256", "batch_size=2"]), target.num_layers)
    assert 0 < check_fits_memory(config, target).peak < 2**30


def test_the_real_cli_refuses_a_step_no_machine_holds_before_writing_anything(wide_target, tmp_path):
    """`trainer run` as a process, the machine's own memory: ~70 TB of masks for 64 rows x 1M block tokens."""
    from tests.faults.trainer_faults import run_trainer

    runs = tmp_path / "runs"
    result = run_trainer("run", "huge", "--set", f"target={wide_target}", "--set", "seq_len=65536",
                         "--set", "batch_size=64", "--set", "max_anchors=65536", "--set", "eval_every=null",
                         "--runs-dir", str(runs), "--quiet", timeout=scaled_timeout(120))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "needs at least" in lines[0] and "lower max_anchors" in lines[0], lines[0]
    assert not runs.exists() or not any(runs.iterdir())


def test_a_killed_run_with_many_loss_chunks_resumes_to_the_uninterrupted_metrics(wide_target, tmp_path):
    """A 31k vocabulary, one block per loss chunk (24 chunks a step) and D-PACE's per-block weights: SIGKILL
    after the first checkpoint, resume, and every logged number equals the run that was never killed."""
    import signal
    import time

    from test_train_e2e import TINY, _env, comparable, metric_rows, trainer_cli

    config = tmp_path / "c.json"
    config.write_text(json.dumps({**TINY, "target": str(wide_target), "steps": 8, "draft_layers": 1,
                                  "loss_chunk_size": 4, "loss_weighting": "dpace", "eval_prompts": 1}))
    runs = tmp_path / "runs"
    straight = trainer_cli("run", "straight", "--config", str(config), "--runs-dir", str(runs), "--quiet")
    assert straight.returncode == 0, straight.stderr
    assert json.loads((runs / "straight" / "config.json").read_text())["loss_chunk_size"] == 4

    process = subprocess.Popen([sys.executable, "-m", "trainer.cli", "run", "killed", "--config", str(config),
                                "--runs-dir", str(runs)], cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    killed = runs / "killed"
    deadline = time.monotonic() + scaled_timeout(180)
    while time.monotonic() < deadline and process.poll() is None:
        rows = (killed / "metrics.jsonl").read_text().count("\n") if (killed / "metrics.jsonl").exists() else 0
        if (killed / "checkpoints" / "latest").exists() and rows >= 4:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert json.loads((killed / "run.json").read_text())["status"] == "running"  # killed before it finished
    resumed = trainer_cli("run", "killed", "--resume", "--runs-dir", str(runs), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(metric_rows(killed)) == comparable(metric_rows(runs / "straight"))
