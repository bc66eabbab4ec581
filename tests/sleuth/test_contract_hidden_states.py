"""dflash.hidden_state_capture: an offline cache recomputed with the real target, layer by layer."""

from __future__ import annotations

import json

import pytest
import torch
from contract_fixtures import save_target
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from sleuth.checks import ContractContext
from sleuth.checks.hidden_states import check_hidden_state_capture

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
