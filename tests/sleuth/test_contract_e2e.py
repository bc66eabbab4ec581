"""The train-to-serve contract end to end: the trainer trains v3 and v5 for 40 steps on the embedded target,
`sleuth diagnose` reads their run directories (subprocesses: sleuth never imports trainer).

The issue's done-when: v5's `dflash.train_serve_gap` is a mismatch explained by `dflash.target_logits_source`,
v3's a match; both runs record the drafter's rotation as it trains, which is the one their exports serve. Sizes are cut for
CPU (packed rows of 128, batch 4, a final eval of 4 prompts x 32 new tokens); the full-size numbers are in
the notes of issue 16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHEAP = {"seq_len": 128, "batch_size": 4, "eval_every": "null", "eval_prompts": 4, "eval_max_new_tokens": 32,
         "checkpoint_every": 40, "log_every": 10}


def cli(tool: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", f"{tool}.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module")
def diagnoses(tmp_path_factory) -> dict[str, dict[str, dict]]:
    runs = tmp_path_factory.mktemp("contract_e2e")
    sets = [a for k, v in CHEAP.items() for a in ("--set", f"{k}={v}")]
    found: dict[str, dict[str, dict]] = {}
    for preset in ("v3", "v5"):
        trained = cli("trainer", "run", preset, "--preset", preset, "--steps", "40", "--runs-dir", str(runs), "-q", *sets)
        assert trained.returncode == 0, trained.stderr
        diagnosed = cli("sleuth", "diagnose", "--run", preset, "--runs-dir", str(runs), "--offline", "--no-probe",
                        "--format", "json")
        assert diagnosed.returncode in (0, 1), diagnosed.stderr
        found[preset] = {f["id"]: f for f in json.loads(diagnosed.stdout)["findings"]}
    return found


@pytest.mark.slow
def test_v5_has_a_train_serve_gap_explained_by_its_logits_source_and_v3_has_none(diagnoses):
    v5, v3 = diagnoses["v5"]["dflash.train_serve_gap"], diagnoses["v3"]["dflash.train_serve_gap"]
    assert v5["status"] == "mismatch", (v5["observed"], v5["reason"])
    assert v5["notes"][0] == "explanation found: dflash.target_logits_source"
    assert diagnoses["v5"]["dflash.target_logits_source"]["status"] == "mismatch"
    assert v3["status"] == "match", (v3["observed"], v3["reason"])
    assert "block by block" in v3["observed"] and "longer at 0 and shorter at 0" in v3["observed"]


@pytest.mark.slow
def test_a_trainer_run_records_its_rope_and_serving_rotates_the_same(diagnoses):
    for preset in ("v3", "v5"):
        rope = diagnoses[preset]["dflash.rope_served_as_trained"]
        assert rope["status"] == "match", rope.get("reason")
        assert rope["evidence"][0]["location"].endswith("run.json: drafter.draft_config")
        assert rope["evidence"][1]["location"].endswith("run.json: drafter")
        windows = diagnoses[preset]["dflash.sliding_window_served"]
        assert windows["status"] == "match" and "full-attention layers, trained and served" in windows["observed"]


@pytest.mark.slow
def test_a_run_on_a_partial_rotary_target_records_a_drafter_that_rotates_all_dims(tmp_path):
    """The trainer's drafter takes the target's theta but rotates every dimension (trainer/model/drafter.py
    `full_attention_rope`), and its exports say so; on a GPT-NeoX target that rotates a quarter this is no
    finding: the rule compares training with serving, not the drafter with the target (which flagged every
    run on such a target, Qwen3.5 / 3.6 included, before)."""
    import random

    from contract_fixtures import WORDS, save_tokenizer
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    target = tmp_path / "neox"
    tokenizer = save_tokenizer(target)
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=128, eos_token_id=0, pad_token_id=1,
                           bos_token_id=2, tie_word_embeddings=False, rotary_pct=0.25)
    GPTNeoXForCausalLM(config).save_pretrained(target)
    rng = random.Random(0)
    data = tmp_path / "data.txt"
    data.write_text("\n\n".join(" ".join(rng.choice(WORDS[:10]) for _ in range(rng.randint(10, 40))) for _ in range(40)))
    sets = {"target": target, "data": data, "seq_len": 32, "batch_size": 2, "block_size": 4, "max_anchors": 4,
            "draft_layers": 1, "eval_every": "null", "eval_prompts": 1, "eval_max_new_tokens": 4, "warmup_steps": 0}
    trained = cli("trainer", "run", "neox", "--steps", "1", "--runs-dir", str(tmp_path / "runs"), "-q",
                  *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")])
    assert trained.returncode == 0, trained.stderr
    diagnosed = cli("sleuth", "diagnose", "--run", "neox", "--runs-dir", str(tmp_path / "runs"), "--offline",
                    "--no-probe", "--format", "json")
    rope = {f["id"]: f for f in json.loads(diagnosed.stdout)["findings"]}["dflash.rope_served_as_trained"]
    assert rope["status"] == "match", rope.get("reason")
    assert "partial_rotary_factor=1.0" in rope["observed"]
