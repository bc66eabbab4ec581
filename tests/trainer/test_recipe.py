"""The reference's current recipe: D-PACE weighting, Muon + AdamW, and the `recipe-2026` preset.

D-PACE is compared with a plain Python loop over one block written from its definition (speculators #979,
losses/utils.py `dpace_loss_decay`), not with our own vectorised code; parity with speculators itself is in
tests/parity. Muon's resume is exact: a run stopped at a checkpoint and resumed equals a straight run.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import ConfigError, build_config
from trainer.model.loss import dflash_loss, dpace_weights, slot_weights
from trainer.run.optim import OptimizerChain, build_optimizer, split_params_for_muon

REPO = Path(__file__).resolve().parents[2]


def naive_dpace(ce: list[float], valid: list[bool], alpha: float) -> list[float]:
    smooth = [((1 - alpha) * math.exp(-c) + alpha) if v else 1.0 for c, v in zip(ce, valid)]
    prefix, running = [], 1.0
    for s in smooth:
        running *= s
        prefix.append(running)
    return [sum(prefix[j] for j in range(k, len(ce)) if valid[j]) if valid[k] else 0.0 for k in range(len(ce))]


@pytest.mark.parametrize("alpha", [0.5, 0.1, 1.0])
def test_dpace_weights_equal_the_definition_block_by_block(alpha):
    generator = torch.Generator().manual_seed(3)
    ce = torch.rand(2, 3, 6, generator=generator) * 4  # [N, A, B]
    valid = torch.rand(2, 3, 6, generator=generator) > 0.25
    valid[..., 0] = False  # slot 0 never has a label in DFlash
    got = dpace_weights(ce, valid, alpha)
    for n in range(2):
        for a in range(3):
            expected = naive_dpace(ce[n, a].tolist(), valid[n, a].tolist(), alpha)
            assert got[n, a].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    if alpha == 1.0:  # no confidence at all: slot k weighs the number of labelled slots from k on
        assert got[0, 0, -1].item() == float(valid[0, 0, -1])


def test_dpace_weights_follow_the_drafters_confidence():
    valid = torch.tensor([[[False, True, True, True]]])
    confident = dpace_weights(torch.full((1, 1, 4), 0.01), valid, 0.5)
    unsure = dpace_weights(torch.full((1, 1, 4), 5.0), valid, 0.5)
    # A confident drafter keeps later slots heavy (they will be reached); an unsure one lets them fade.
    assert confident[0, 0, 3] / confident[0, 0, 1] > unsure[0, 0, 3] / unsure[0, 0, 1]
    assert (confident[..., 0] == 0).all() and (unsure[..., 0] == 0).all()


def test_dflash_loss_with_dpace_weighs_slots_like_the_definition_and_has_no_grad_through_weights():
    generator = torch.Generator().manual_seed(5)
    draft = torch.randn(1, 2, 4, 11, generator=generator, requires_grad=True)
    target = torch.randn(1, 2, 4, 11, generator=generator)
    valid = torch.tensor([[[False, True, True, False], [False, True, True, True]]])
    loss, _ = dflash_loss(draft, target, valid.float(), "ce", "dpace", 0.5)
    logp = torch.log_softmax(draft.detach(), -1)
    ce = -logp.gather(-1, target.argmax(-1, keepdim=True)).squeeze(-1)
    total = 0.0
    for a in range(2):
        weights = naive_dpace(ce[0, a].tolist(), valid[0, a].tolist(), 0.5)
        total += sum(w * c for w, c in zip(weights, ce[0, a].tolist()))
    expected = total / (int(valid.sum()) + 1e-5)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # The weights are constants: the gradient at a slot is its weight times dCE, nothing through q.
    assert draft.grad is not None and torch.isfinite(draft.grad).all()


def test_dpace_needs_cross_entropy():
    with pytest.raises(ConfigError, match="dpace"):
        build_config(overrides=["loss_weighting=dpace", "loss=kl"])
    with pytest.raises(ValueError, match="cross-entropy"):
        dflash_loss(torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 3), torch.ones(1, 1, 2), "kl", "dpace")


def test_slot_weights_for_dpace_only_mark_labels():
    anchors = torch.tensor([[2]])
    weights = slot_weights(anchors, torch.tensor([[True]]), torch.ones(1, 12), torch.zeros(1, 12, dtype=torch.long), 4, None)
    assert weights.tolist() == [[[0.0, 1.0, 1.0, 1.0]]]


class TinyDrafter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4, bias=False)
        self.norm = torch.nn.LayerNorm(4)
        self.vector = torch.nn.Parameter(torch.ones(1, 4))  # 2-D but degenerate: AdamW, as speculators
        self.embed_tokens = torch.nn.Embedding(10, 4)  # 2-D but an embedding: AdamW


def test_muon_takes_the_matrices_and_adamw_the_rest():
    model = TinyDrafter()
    muon, adamw = split_params_for_muon(model)
    assert [id(p) for p in muon] == [id(model.fc.weight)]
    assert {id(p) for p in adamw} == {id(model.norm.weight), id(model.norm.bias), id(model.vector),
                                     id(model.embed_tokens.weight)}


def test_muon_chain_state_round_trips_exactly():
    config = build_config(overrides=["optimizer=muon", "muon_lr=0.02"])
    torch.manual_seed(0)
    model = TinyDrafter()
    optimizer = build_optimizer(config, model)
    assert isinstance(optimizer, OptimizerChain)
    assert [g["lr_scale"] for g in optimizer.param_groups] == [pytest.approx(20.0), 1.0]

    def step(opt):
        opt.zero_grad()
        (model.fc(torch.ones(2, 8)).sum() + model.norm(torch.ones(2, 4)).pow(2).sum() + model.vector.sum()).backward()
        opt.step()

    step(optimizer)
    saved = json.loads(json.dumps({"param_groups": optimizer.state_dict()["param_groups"]}))  # as the checkpoint
    state = optimizer.state_dict()["state"]
    twin_model = TinyDrafter()
    twin_model.load_state_dict(model.state_dict())
    twin = build_optimizer(config, twin_model)
    twin.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
    step(optimizer)
    model_after = {k: v.clone() for k, v in model.state_dict().items()}
    model = twin_model
    step(twin)
    for name, value in twin_model.state_dict().items():
        torch.testing.assert_close(value, model_after[name], rtol=0, atol=0)


def test_an_adamw_checkpoint_does_not_load_into_muon():
    model = TinyDrafter()
    adamw = build_optimizer(build_config(), model)
    muon = build_optimizer(build_config(overrides=["optimizer=muon"]), model)
    with pytest.raises(ValueError, match="does not match"):
        muon.load_state_dict(adamw.state_dict())


@pytest.mark.slow
def test_recipe_2026_trains_and_resumes_exactly(tmp_path, embedded_small_target):
    """The preset trains on the embedded target's small twin, and Muon + D-PACE resume bit-exactly."""
    target = embedded_small_target
    common = ["--preset", "recipe-2026", "--runs-dir", str(tmp_path / "runs"), "--quiet",
              "--set", f"target={target}", "--set", "seq_len=64", "--set", "batch_size=2", "--set", "max_anchors=4",
              "--set", "draft_layers=2", "--set", "eval_every=null", "--set", "eval_prompts=1",
              "--set", "eval_max_new_tokens=4", "--set", "log_every=1",
              "--set", "checkpoint_every=3", "--set", "warmup_steps=1",
              "--set", "schedule=constant"]  # constant: the 3-step half must see the 6-step run's lrs
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}

    def trainer(*args):
        result = subprocess.run([sys.executable, "-m", "trainer.cli", *args], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return result

    trainer("run", "straight", *common, "--steps", "6")
    trainer("run", "halves", *common, "--steps", "3")
    trainer("run", "halves", "--resume", "--steps", "6", "--runs-dir", str(tmp_path / "runs"), "--quiet")

    def rows(name):
        lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        # training rows: a 3-step first half also validates at its own last step, which the straight run does not
        return [(r["step"], r["loss"], r["acc"], r["lr"]) for r in map(json.loads, lines) if "split" not in r]

    assert rows("halves") == rows("straight")
    saved = json.loads((tmp_path / "runs" / "straight" / "config.json").read_text())
    assert saved["block_size"] == 16 and saved["loss_weighting"] == "dpace" and saved["optimizer"] == "muon"
    groups = json.loads(json.loads(_header(tmp_path / "runs" / "straight"))["__metadata__"]["param_groups"])
    assert {g["part_type"] for g in groups} == {"Muon", "AdamW"}


def _header(run: Path) -> str:
    latest = (run / "checkpoints" / "latest").read_text().strip()
    with open(run / "checkpoints" / latest / "optimizer.safetensors", "rb") as handle:
        return handle.read(int.from_bytes(handle.read(8), "little")).decode()


def test_draft_vocabulary_is_speculators_rule():
    from collections import Counter

    from trainer.data.draft_vocab import draft_token_ids, vocab_maps

    frequencies = Counter({7: 5, 3: 5, 9: 1, 2: 8})
    ids = draft_token_ids(frequencies, 3, 12)  # the 3 most frequent, ties by id, sorted
    assert ids.tolist() == [2, 3, 7]
    padded = draft_token_ids(frequencies, 6, 12)  # fewer distinct tokens than asked: smallest unused ids
    assert padded.tolist() == [0, 1, 2, 3, 7, 9]
    d2t, t2d = vocab_maps(ids, 12)
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 7] and t2d.nonzero().flatten().tolist() == [2, 3, 7]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_token_ids(frequencies, 13, 12)


@pytest.mark.slow
def test_a_draft_vocabulary_run_trains_evaluates_losslessly_and_refuses_export(tmp_path, embedded_small_target):
    target = embedded_small_target
    runs = tmp_path / "runs"
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    args = ["run", "dv", "--runs-dir", str(runs), "--quiet", "--steps", "4"]
    for key, value in {"target": target, "seq_len": 64, "batch_size": 2, "block_size": 4, "max_anchors": 4,
                       "draft_layers": 2, "eval_every": 4, "eval_prompts": 2, "eval_max_new_tokens": 8,
                       "draft_vocab_size": 48, "warmup_steps": 1}.items():
        args += ["--set", f"{key}={value}"]
    result = subprocess.run([sys.executable, "-m", "trainer.cli", *args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file

    maps = load_file(str(runs / "dv" / "draft_vocab.safetensors"))
    assert maps["token_ids"].numel() == 48 and int(maps["t2d"].sum()) == 48
    report = json.loads((runs / "dv" / "eval.json").read_text())
    assert report["lossless"] is True and report["tau"] >= 1.0
    export = subprocess.run([sys.executable, "-m", "trainer.cli", "export", "dv", "--runs-dir", str(runs), "--out",
                             str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert export.returncode == 2 and "draft vocabulary" in export.stderr and "Traceback" not in export.stderr
