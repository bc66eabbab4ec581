"""dflash.hidden_state_capture: an offline cache recomputed with the real target, layer by layer."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from contract_fixtures import WORDS, save_target, write_run
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from sleuth.checks import ContractContext
from sleuth.checks.hidden_states import check_hidden_state_capture
from sleuth.runs import read_run

REPO = Path(__file__).resolve().parents[2]

LAYERS = 4
SEQUENCES = [[6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 6, 7]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("target") / "qwen3", layers=LAYERS)


@pytest.fixture(scope="module")
def states(target):
    """Per sequence: HF hidden_states (index 0..L, the last one final-normed, as transformers returns it) and
    the last decoder layer's raw output (what vLLM captures as the final layer)."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    raw_last = []
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: raw_last.append(out[0] if isinstance(out, tuple) else out))
    result = []
    with torch.no_grad():
        for ids in SEQUENCES:
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
            result.append(([h[0] for h in out.hidden_states], raw_last[-1][0]))
    hook.remove()
    return result


def speculators_cache(path, states, hf_indices, final: str = "raw"):
    """hs_<i>.safetensors as speculators writes them: token_ids [T], hidden_states [T, n, H]."""
    (path / "hidden_states").mkdir(parents=True)
    for i, (ids, (hidden, raw_last)) in enumerate(zip(SEQUENCES, states)):
        entries = [hidden[j] for j in hf_indices] + [raw_last if final == "raw" else hidden[LAYERS]]
        save_file({"token_ids": torch.tensor(ids), "hidden_states": torch.stack(entries, dim=1).contiguous()},
                  str(path / "hidden_states" / f"hs_{i}.safetensors"))
    return path


def check(cache, target, aux_ids):
    return check_hidden_state_capture(ContractContext(
        config={"aux_hidden_state_layer_ids": aux_ids}, target_dir=target, hidden_states=cache))


def test_a_correct_speculators_cache_matches(tmp_path, target, states):
    finding = check(speculators_cache(tmp_path / "c", states, [1, 2]), target, [1, 2])
    assert finding.status == "match", finding.observed


def test_a_cache_shifted_by_one_layer_names_the_layer(tmp_path, target, states):
    # ids [1, 2] in vLLM's convention mean HF hidden_states[1], [2]; the capture stored [2], [3].
    finding = check(speculators_cache(tmp_path / "c", states, [2, 3]), target, [1, 2])
    assert finding.status == "mismatch"
    assert ("entry 0 holds decoder layer 1's output (HF hidden_states[2]) instead of decoder layer 0's output "
            "(HF hidden_states[1]): off by +1 layer") in finding.observed
    assert "entry 1 holds decoder layer 2's output" in finding.observed
    assert "entry 2" not in finding.observed  # the final layer was captured right


def test_a_final_norm_applied_to_the_final_layer_is_named(tmp_path, target, states):
    finding = check(speculators_cache(tmp_path / "c", states, [1, 2], final="normed"), target, [1, 2])
    assert finding.status == "mismatch"
    assert "entry 2 holds final_norm(decoder layer 3's output" in finding.observed


def test_the_simple_manifest_layout_in_zlab_convention(tmp_path, target, states):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps(
        {"format": "dflash-hidden-states", "version": 1, "layer_ids": [0, 2], "convention": "zlab", "target": str(target)}))
    for i, (ids, (hidden, _)) in enumerate(zip(SEQUENCES, states)):
        # z-lab id i is HF hidden_states[i + 1]; this capture forgot the +1 for the second id.
        stored = torch.stack([hidden[1], hidden[2]], dim=1).contiguous()
        save_file({"input_ids": torch.tensor(ids), "hidden_states": stored}, str(cache / f"{i}.safetensors"))
    finding = check_hidden_state_capture(ContractContext(hidden_states=cache))
    assert finding.status == "mismatch"
    assert "entry 1 holds decoder layer 1's output (HF hidden_states[2]) instead of decoder layer 2's output" in finding.observed
    assert "entry 0" not in finding.observed


def test_no_cache_or_unknown_layer_ids_are_unknown(tmp_path, target, states):
    assert check_hidden_state_capture(ContractContext()).status == "unknown"
    cache = speculators_cache(tmp_path / "c", states, [1, 2])
    finding = check_hidden_state_capture(ContractContext(target_dir=target, hidden_states=cache))
    assert finding.status == "unknown" and "layer ids are not known" in finding.reason


# --- the trainer's own offline cache (`trainer hidden-states generate`), read through its manifest ------------

@pytest.fixture(scope="module")
def trainer_cache(tmp_path_factory, target):
    """A real cache written by the trainer's CLI (a subprocess: sleuth never imports trainer) for the tiny
    target, storing layers [0, 1, 2] and the final layer 3, from a small text corpus of its vocabulary."""
    root = tmp_path_factory.mktemp("trainer_cache")
    rng = random.Random(0)
    data = root / "data.txt"
    data.write_text("\n\n".join(" ".join(rng.choice(WORDS[:10]) for _ in range(rng.randint(10, 40))) for _ in range(40)))
    cache = root / "cache"
    made = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "hidden-states", "generate", "--out", str(cache), "--rows-per-shard", "8",
         "--set", f"target={target}", "--set", f"data={data}", "--set", "seq_len=32", "--set", "draft_layers=3",
         "--set", "target_layer_ids=[0,1,2]"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    return cache


def rewrite_cache(source, dest, layers: list[int], tensors: dict[str, str]):
    """A copy of a trainer cache whose manifest claims `layers` and whose tensor `new` holds `old`'s states."""
    dest.mkdir()
    manifest = json.loads((source / "manifest.json").read_text())
    (dest / "manifest.json").write_text(json.dumps({**manifest, "layers": layers}))
    for shard in sorted(source.glob("shard-*.safetensors")):
        stored = load_file(str(shard))
        save_file({"input_ids": stored["input_ids"], "position_ids": stored["position_ids"],
                   **{new: stored[old].clone() for new, old in tensors.items()}}, str(dest / shard.name))
    return dest


@pytest.mark.slow
def test_the_trainers_cache_matches_its_target(trainer_cache):
    # The target is found through the manifest; every document of the sampled rows is recomputed alone.
    finding = check_hidden_state_capture(ContractContext(hidden_states=trainer_cache))
    assert finding.status == "match", finding.observed
    assert "layer.3 = final_norm(decoder layer 3's output" in finding.expected  # transformers' last state is normed


@pytest.mark.slow
def test_a_trainer_cache_shifted_by_one_layer_names_the_layer(trainer_cache, tmp_path):
    # A capture that stored HF hidden_states[i + 2] for z-lab layer i (one +1 too many) on layers 0 and 1.
    shifted = rewrite_cache(trainer_cache, tmp_path / "shifted", [0, 1, 3],
                            {"layer.0": "layer.1", "layer.1": "layer.2", "layer.3": "layer.3"})
    finding = check_hidden_state_capture(ContractContext(hidden_states=shifted))
    assert finding.status == "mismatch"
    assert ("layer.0 holds decoder layer 1's output (HF hidden_states[2]) instead of decoder layer 0's output "
            "(HF hidden_states[1]): off by +1 layer") in finding.observed
    assert "layer.1 holds decoder layer 2's output (HF hidden_states[3]) instead of decoder layer 1's" in finding.observed
    assert "layer.3" not in finding.observed  # the final layer was stored right


@pytest.mark.slow
def test_a_run_trained_from_a_cache_is_checked_without_naming_it(trainer_cache, tmp_path, target):
    # The raw last layer where transformers' final-normed state belongs (a capture hook on the last decoder layer).
    raw_last = rewrite_cache(trainer_cache, tmp_path / "raw_last", [0, 1, 2, 3],
                             {"layer.0": "layer.0", "layer.1": "layer.1", "layer.2": "layer.2", "layer.3": "layer.2"})
    run = write_run(tmp_path / "offline", target=target, config={"hidden_states": str(raw_last)})
    finding = check_hidden_state_capture(ContractContext(run=read_run(run)))
    assert finding.status == "mismatch"
    assert "layer.3 holds decoder layer 2's output (HF hidden_states[3]) instead of decoder layer 3's output" in finding.observed
    assert "without the final norm" in finding.observed
