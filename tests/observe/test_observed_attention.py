"""The drafter's attention as the observed step called it: the mask (SDPA's, or the scores softmax received), the
positions handed to rotary and the block's token ids decide context_excludes_anchor, blocks_isolated,
block_bidirectional, mask_token_distinct and block_position_ids.

A trainer with HF rotary and scaled_dot_product_attention under a hand-built additive mask (tests/fixtures/observe/
sdpa), anchors differing per row, on a tiny real Qwen3 saved with save_pretrained (eos 62, the mask token 63). Its
planted defects are edits of its source; each run is one subprocess (two in all), shared by the tests that read it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.observe.test_observed_step import diagnose, probe_value, project

ATTENTION = ("dflash.context_excludes_anchor", "dflash.blocks_isolated", "dflash.block_bidirectional",
             "dflash.mask_token_distinct", "dflash.block_position_ids")
SDPA = ("--", "python", "train.py", "--target", "tiny-target", "--steps", "2")
MASK_LINE = "out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)"


@pytest.fixture(scope="module")
def target_with_eos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("target") / "tiny-target"
    Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=16, num_hidden_layers=12, vocab_size=64, max_position_embeddings=128,
                                 tie_word_embeddings=False, eos_token_id=62, pad_token_id=62)).save_pretrained(path)
    return path


def run(tmp_path_factory: pytest.TempPathFactory, target: Path, plants: list[tuple[str, str, str]]) -> dict:
    root = project(tmp_path_factory.mktemp("sdpa"), "sdpa", target, plants)
    done, report = diagnose(root, "--code", ".", "--probe", *SDPA)
    assert report is not None, done.stderr
    return {f["id"]: f for f in report["findings"]} | {"_report": report}


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, target_with_eos: Path) -> dict:
    return run(tmp_path_factory, target_with_eos, [])


@pytest.fixture(scope="module")
def leaky(tmp_path_factory: pytest.TempPathFactory, target_with_eos: Path) -> dict:
    """Layer 0's mask lets the context include the anchor, layer 1 calls SDPA with is_causal instead of a mask, the
    block's positions continue after the context, and the mask token is eos."""
    return run(tmp_path_factory, target_with_eos, [
        ("train.py", "torch.arange(length)[None, None, :] < q_anchor",
         "torch.arange(length)[None, None, :] <= q_anchor"),
        ("train.py", "for layer in self.layers:\n            x = layer(x, ctx, cos, sin, mask)",
         "for index, layer in enumerate(self.layers):\n"
         "            x = layer(x, ctx, cos, sin, None if index else mask)"),
        ("train.py", MASK_LINE,
         "out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)"),
        ("train.py", "pos_block = (anchors[:, :, None] + torch.arange(block)).reshape(rows, -1)",
         "pos_block = (length + torch.arange(n * block)).expand(rows, -1)"),
        ("train.py", "mask_id = vocab - 1", "mask_id = target.config.eos_token_id")])


def test_clean_sdpa_trainer_matches_every_attention_invariant_it_exercised(clean: dict) -> None:
    for invariant in ATTENTION:
        assert clean[invariant]["status"] == "match", (invariant, clean[invariant])
    assert "6 placed block(s)" in probe_value(clean["dflash.block_position_ids"])
    assert "mask token 63" in probe_value(clean["dflash.mask_token_distinct"])
    notes = " ".join(clean["_report"]["probes"]["notes"])
    assert "2 call(s) in Drafter.layers.0, Drafter.layers.1 (scaled_dot_product_attention: additive mask)" in notes
    assert not [f["id"] for f in clean["_report"]["findings"] if f["status"] == "mismatch"], \
        clean["_report"]["summary"]


def test_context_with_the_anchor_wrong_positions_and_eos_as_mask_are_mismatches(leaky: dict) -> None:
    context = leaky["dflash.context_excludes_anchor"]
    assert context["status"] == "mismatch", context
    assert "layer 0, row 0, block 0 (anchor 5): its slots see context up to position 5" in probe_value(context)
    positions = leaky["dflash.block_position_ids"]
    assert positions["status"] == "mismatch", positions
    assert "slots at positions [24, 25, 26, 27], the anchor at 5" in probe_value(positions)
    token = leaky["dflash.mask_token_distinct"]
    assert token["status"] == "mismatch", token
    assert "mask token 62" in probe_value(token) and "eos" in probe_value(token)
    # layer 0's block part is untouched: no block sees another
    assert leaky["dflash.blocks_isolated"]["status"] == "match", leaky["dflash.blocks_isolated"]


def test_is_causal_is_never_bidirectional(leaky: dict) -> None:
    bidirectional = leaky["dflash.block_bidirectional"]
    assert bidirectional["status"] == "mismatch", bidirectional
    assert "scaled_dot_product_attention: is_causal at Drafter.layers.1" in probe_value(bidirectional)
