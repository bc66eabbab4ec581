"""`sleuth probe init` and `sleuth probe check` through the CLI, on examples/anyprobe (a plain trainer)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "anyprobe"


def sleuth(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLEUTH_CACHE_DIR": str(cwd / "cache")}
    return subprocess.run([sys.executable, "-m", "sleuth.cli", "probe", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def trainer(tmp_path: Path) -> Path:
    code = tmp_path / "trainer"
    code.mkdir()
    shutil.copy(EXAMPLE / "tiny_dflash.py", code / "tiny_dflash.py")
    return code


def test_init_wires_every_method_and_the_entry_passes_check(trainer: Path, tmp_path: Path):
    done = sleuth("init", "--code", str(trainer), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    entry = trainer / "probe_entry.py"
    assert done.stdout.splitlines()[0] == f"wrote {entry}"
    assert [line.split()[1] for line in done.stdout.splitlines()[1:9]] == ["wired"] * 8
    source = entry.read_text()
    assert "tiny_dflash.block_visibility(anchors=batch.anchors, doc_ids=batch.doc_ids, block_size=BLOCK_SIZE)" in source
    assert "_todo(\"" not in source and "TODO(sleuth): " not in source.replace("f\"TODO(sleuth): {what}\"", "")
    checked = sleuth("check", "--probe-entry", "probe_entry:subject", "--code", str(trainer), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["describe", "build", "parameters", "draft_logits", "loss",
                                                        "train_step", "draft_layers", "rotary", "embeddings/lm_head"]
    assert all(line.split()[-1] == "ok" for line in lines[:-1]) and lines[-1] == "0 problem(s)"


def test_init_never_overwrites_and_writes_todos_for_what_it_cannot_wire(trainer: Path, tmp_path: Path):
    (trainer / "probe_entry.py").write_text("# mine\n")
    refused = sleuth("init", "--code", str(trainer), cwd=tmp_path)
    assert refused.returncode == 2 and (trainer / "probe_entry.py").read_text() == "# mine\n"
    assert refused.stderr.strip() == f"error: {trainer / 'probe_entry.py'} exists; pass --force to overwrite it, or --out FILE"
    # the loss moved inline into the training step: nothing computes it alone any more
    source = (trainer / "tiny_dflash.py").read_text()
    source = source.replace("    loss = dflash_loss(logits, slot_targets(out.logits, anchors, b), slot_weights(b, settings.gamma), valid)",
                            "    ce = F.cross_entropy(logits.flatten(0, -2), slot_targets(out.logits, anchors, b).argmax(-1).flatten())\n"
                            "    loss = ce")
    (trainer / "tiny_dflash.py").write_text(source.replace("def dflash_loss(", "def _unused_dflash_loss("))
    done = sleuth("init", "--code", str(trainer), "--force", "--no-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    status = dict(line.split(None, 1) for line in done.stdout.splitlines()[1:9])
    assert status["loss"].startswith("TODO: computed inline in train_step")
    checked = sleuth("check", "--probe-entry", "probe_entry:subject", "--code", str(trainer), cwd=tmp_path)
    assert "loss                not provided: loss() (TODO(sleuth): the loss: computed inline in train_step" in checked.stdout


def test_check_names_a_hook_whose_result_is_dropped(trainer: Path, tmp_path: Path):
    source = (EXAMPLE / "probe_entry_handwritten.py").read_text()
    broken = source.replace("        block = hooks.block_embeddings(F.embedding(ids.view(n, a * b), self.target.embed_weight))",
                            "        block = F.embedding(ids.view(n, a * b), self.target.embed_weight)\n"
                            "        hooks.block_embeddings(block)")
    assert broken != source
    (trainer / "probe_entry.py").write_text(broken)
    done = sleuth("check", "--probe-entry", "probe_entry:subject", "--code", str(trainer), cwd=tmp_path)
    assert done.returncode == 1
    assert ("draft_logits        calls hooks.block_embeddings but does not use its result (noise it adds leaves the "
            "logits unchanged)") in done.stdout.splitlines()
    assert done.stdout.splitlines()[-1] == "1 problem(s)"


@pytest.mark.parametrize(("args", "message"), [
    (("check", "--probe-entry", "nope"), "error: --probe-entry must be module:function"),
    (("check", "--probe-entry", "missing_module:subject"), "error: missing_module:subject: nothing could be checked: "
                                                           "cannot set up the subject: ModuleNotFoundError"),
    (("init", "--code", "/no/such/trainer"), "error: --code /no/such/trainer does not exist"),
])
def test_usage_errors_are_one_line_and_exit_2(args, message, tmp_path: Path):
    done = sleuth(*args, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().startswith(message) and len(done.stderr.strip().splitlines()) == 1


def test_init_on_a_layer_rule_without_parameters_writes_a_todo_naming_it(tmp_path: Path):
    # bench/anyprobe_blind t06 (written blind): the rule is a method reading its object's options,
    # `DFlashTrainer.layer_ids(self)`, so there is no argument to hand the target's depth to. Once the rule has
    # been called (not --no-run), `self` is bound as a namespace of the options it read, and the writer took
    # the rule's first parameter for the depth: an IndexError, before.
    code = tmp_path / "t06"
    shutil.copytree(REPO / "bench" / "anyprobe_blind" / "trainers" / "t06_hooks", code)
    done = sleuth("init", "--code", str(code), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    layer_line = next(line for line in (code / "probe_entry.py").read_text().splitlines()
                      if line.startswith("LAYER_IDS = "))
    assert layer_line.startswith("LAYER_IDS = None  # TODO(sleuth): call your trainer's rule ")
    assert "DFlashTrainer).layer_ids as the trainer does" in layer_line
