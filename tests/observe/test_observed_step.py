"""`sleuth diagnose --code . --probe -- CMD`: the user's own trainer, run isolated and observed for one step.

Two hand-written trainers in different styles (tests/fixtures/observe: a functional argparse script, a class-based
package run with `python -m`), each on a tiny real Qwen3 saved with save_pretrained into the project. The planted
defects are edits of the trainer's source, found by what the observed step measured, never by reading names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "observe"
OBSERVED = ("dflash.target_layer_ids", "dflash.fc_input_layers", "dflash.frozen_embed_head",
            "dflash.loss_decay_gamma", "dflash.anchor_slot_untrained", "dflash.target_shift",
            "dflash.target_logits_source")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("target") / "tiny-target"
    Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=16, num_hidden_layers=12, vocab_size=64, max_position_embeddings=128,
                                 tie_word_embeddings=False)).save_pretrained(path)
    return path


def project(tmp_path: Path, style: str, target: Path, plants: list[tuple[str, str, str]] = ()) -> Path:
    """A copy of the trainer with the target saved beside it; each plant is (file, old, new), old found once."""
    root = tmp_path / style
    shutil.copytree(FIXTURES / style, root)
    shutil.copytree(target, root / "tiny-target")
    for file, old, new in plants:
        text = (root / file).read_text()
        assert text.count(old) == 1, (file, old)
        (root / file).write_text(text.replace(old, new))
    if style == "classy":
        (root / "small.json").write_text(json.dumps({"target": "tiny-target", "num_taps": 5, "block_size": 4,
                                                     "gamma": 4.0, "lr": 1e-3, "steps": 3}))
    return root


def diagnose(cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    out = cwd.parent / f"{cwd.name}-report"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", "--offline", "--out", str(out), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    report = out / "report.json"
    return done, json.loads(report.read_text()) if report.exists() else None


def observed(report: dict) -> dict[str, dict]:
    found = {f["id"]: f for f in report["findings"] if f["id"] in OBSERVED}
    assert set(found) == set(OBSERVED)
    return found


def probe_value(finding: dict) -> str:
    evidence = [e for e in finding["evidence"] if e["kind"] == "probe"]
    assert evidence and evidence[0]["location"] == "probe:observed-step", finding
    return evidence[0]["value"]


def assert_attention_matches(report: dict) -> None:
    """The mask as the step applied it decides; this target has no eos/pad ids and the drafter no rotary module."""
    found = {f["id"]: f for f in report["findings"]}
    for invariant in ("dflash.context_excludes_anchor", "dflash.blocks_isolated", "dflash.block_bidirectional"):
        assert found[invariant]["status"] == "match", (invariant, found[invariant])
        assert "6 block(s)" in probe_value(found[invariant]) or "placed block(s)" in probe_value(found[invariant])
    for invariant in ("dflash.mask_token_distinct", "dflash.block_position_ids"):
        assert probe_value(found[invariant]).startswith("unknown: not exercised by the observed step")


FUNCTIONAL = ("--", "python", "train.py", "--target", "tiny-target", "--steps", "3")
CLASSY = ("--", "python", "-m", "drafttrain", "--config", "small.json")


def test_clean_functional_trainer_matches_on_what_its_step_exercised(tmp_path: Path, tiny_target: Path) -> None:
    done, report = diagnose(project(tmp_path, "functional", tiny_target), "--code", ".", "--probe", *FUNCTIONAL)
    assert report is not None, done.stderr
    found = observed(report)
    for invariant, finding in found.items():
        assert finding["status"] == "match", (invariant, finding)
    assert "[1, 3, 5, 7, 9]" in probe_value(found["dflash.target_layer_ids"])
    assert "gamma 4.000" in probe_value(found["dflash.loss_decay_gamma"])
    assert_attention_matches(report)
    notes = " ".join(report["probes"]["notes"])
    assert "observed 1 optimizer step" in notes and "train.py:" in notes and "lm_head" in notes
    assert not [f["id"] for f in report["findings"] if f["status"] == "mismatch"], report["summary"]


def test_planted_fc_gamma_shift_and_teacher_defects_are_measured_mismatches(tmp_path: Path, tiny_target: Path) -> None:
    plants = [("train.py", "fc = nn.Linear(len(taps) * hidden", "fc = nn.Linear((len(taps) - 1) * hidden"),
              ("train.py", 'drafter["fc"](feats)', 'drafter["fc"](feats[..., : (len(taps) - 1) * hidden])'),
              ("train.py", "def slot_weights(block_size, gamma=4.0):", "def slot_weights(block_size, gamma=7.0):"),
              ("train.py", "label_pos = (anchors[:, None] + torch.arange(block) - 1)",
               "label_pos = (anchors[:, None] + torch.arange(block))"),
              ("train.py", "teacher = out.logits.argmax(-1)",
               "teacher = target.lm_head(target.model.norm(out.hidden_states[taps[-1] + 1])).argmax(-1)"),
              ("train.py", 'return torch.softmax(scores.masked_fill(~allow, float("-inf")), -1) @ v',
               'weights = scores.masked_fill(~allow, float("-inf")).exp()\n    return weights / weights.sum(-1, '
               'keepdim=True) @ v'),
              ("train.py", "torch.arange(length)[None, :] < q_anchor", "torch.arange(length)[None, :] <= q_anchor")]
    done, report = diagnose(project(tmp_path, "functional", tiny_target, plants), "--code", ".", "--probe",
                            *FUNCTIONAL)
    assert report is not None, done.stderr
    assert done.returncode == 1
    found = observed(report)
    assert found["dflash.fc_input_layers"]["status"] == "mismatch"
    assert "layers [9] of the gathered [1, 3, 5, 7, 9] never reach the loss" in probe_value(found["dflash.fc_input_layers"])
    assert found["dflash.loss_decay_gamma"]["status"] == "mismatch"
    assert "gamma 7.000" in probe_value(found["dflash.loss_decay_gamma"])
    assert found["dflash.target_shift"]["status"] == "mismatch"
    assert found["dflash.target_logits_source"]["status"] == "mismatch"
    assert "targets from layer 9 of 12" in probe_value(found["dflash.target_logits_source"])
    assert "anchor + j;" in probe_value(found["dflash.target_shift"])
    # What the run gathered is the reference's selection; slot 0 still carries no loss.
    assert found["dflash.target_layer_ids"]["status"] == "match"
    assert found["dflash.anchor_slot_untrained"]["status"] == "match"
    assert "[1, 3, 5, 7, 9]" in probe_value(found["dflash.target_layer_ids"])
    # no attention call was captured: the gradient at the target features says the anchor's position is seen
    context = next(f for f in report["findings"] if f["id"] == "dflash.context_excludes_anchor")
    assert context["status"] == "mismatch", context
    assert "positions [17] reach the loss, at or after its last anchor 17" in probe_value(context)


def test_clean_class_trainer_its_frozen_embedding_is_no_false_alarm(tmp_path: Path, tiny_target: Path) -> None:
    done, report = diagnose(project(tmp_path, "classy", tiny_target), "--code", ".", "--probe", *CLASSY)
    assert report is not None, done.stderr
    found = observed(report)
    for invariant, finding in found.items():
        assert finding["status"] == "match", (invariant, finding)
    assert "requires_grad False" in probe_value(found["dflash.frozen_embed_head"])
    assert_attention_matches(report)  # nn.MultiheadAttention's weights path: the scores its softmax received
    notes = " ".join(report["probes"]["notes"])
    assert "stack at drafttrain/trainer.py:" in notes
    # the real CosineAnnealingLR (T_max = the run's 3 steps), read by stepping a copy: its floor is the run's horizon
    assert "schedule CosineAnnealingLR at drafttrain/trainer.py:" in notes and "floor 0 first at step" in notes
    # small.json, named by the command, configures lr 1e-3 and 3 steps: the optimizer was built with that lr, and the
    # cosine ends at its floor on step 3 (no warmup is named, so that part is not claimed)
    found = {f["id"]: f for f in report["findings"]}
    assert found["dflash.optimizer_groups"]["status"] == "match"
    assert "AdamW group 0 lr 0.001" in probe_value(found["dflash.optimizer_groups"])
    horizon = found["dflash.schedule_horizon"]
    assert horizon["status"] == "unknown" and "the floor 0 is reached at the last step (3)" in probe_value(horizon)


def test_trainable_target_embedding_found_and_nothing_unexercised_matches(tmp_path: Path, tiny_target: Path) -> None:
    plants = [("drafttrain/trainer.py", "        self.embed.requires_grad_(False)\n", ""),
              # the head applied functionally: no module produced the draft logits; they are taken where F.linear made them
              ("drafttrain/trainer.py", "logits = self.target.get_output_embeddings()(hidden)",
               "logits = F.linear(hidden, self.target.get_output_embeddings().weight)"),
              # one causal mask over all the blocks: each sees the blocks before it, causally within itself
              ("drafttrain/trainer.py", "q_block[:, None] == q_block[None, :]",
               "torch.arange(len(anchors) * block)[:, None] >= torch.arange(len(anchors) * block)[None, :]")]
    done, report = diagnose(project(tmp_path, "classy", tiny_target, plants), "--code", ".", "--probe", *CLASSY)
    assert report is not None, done.stderr
    found = observed(report)
    frozen = found["dflash.frozen_embed_head"]
    assert frozen["status"] == "mismatch"
    assert "changed" in probe_value(frozen) and "embed" in probe_value(frozen)
    for invariant in ("dflash.loss_decay_gamma", "dflash.anchor_slot_untrained"):
        # measured at the logits F.linear made (no module produced them), and named so
        assert found[invariant]["status"] == "match", found[invariant]
        assert "F.linear at drafttrain/trainer.py:" in probe_value(found[invariant])
    attention = {f["id"]: f for f in report["findings"]}
    assert attention["dflash.blocks_isolated"]["status"] == "mismatch"
    isolated = probe_value(attention["dflash.blocks_isolated"])
    assert "slot 0 of block 1 sees block keys 0..4 (its block is 4..7)" in isolated
    assert attention["dflash.block_bidirectional"]["status"] == "mismatch"
    assert "see [1, 2, 3, 4] of the block's 4 tokens (causal within the block)" in \
        probe_value(attention["dflash.block_bidirectional"])
    assert attention["dflash.context_excludes_anchor"]["status"] == "match"


def test_without_probe_the_command_does_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "code").mkdir()
    done, report = diagnose(tmp_path / "code", "--code", ".", "--", sys.executable, "-c",
                            f"open({str(marker)!r}, 'w')")
    assert done.returncode == 2 and report is None
    assert not marker.exists()
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "only with --probe" in lines[0]


def test_a_command_that_cannot_run_here_fails_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    done, _report = diagnose(tmp_path / "code", "--code", ".", "--probe", "--", "python", "-c",
                             "raise SystemExit('this trainer needs a CUDA device')")
    assert done.returncode == 2
    errors = [line for line in done.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "needs a CUDA device" in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def test_several_steps_are_observed_and_judged_on_the_last(tmp_path: Path, tiny_target: Path) -> None:
    done, report = diagnose(project(tmp_path, "functional", tiny_target), "--code", ".", "--probe",
                            "--observe-steps", "2", *FUNCTIONAL)
    assert report is not None, done.stderr
    assert "observed 2 optimizer step(s)" in report["probes"]["notes"][0]
    assert all(f["status"] == "match" for f in observed(report).values())
    # a run shorter than asked says so in one line instead of judging a step it never took
    done, _report = diagnose(project(tmp_path / "short", "functional", tiny_target), "--code", ".", "--probe",
                             "--observe-steps", "5", *FUNCTIONAL)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "after 3 optimizer step(s), before the 5 observed" in errors[0]
