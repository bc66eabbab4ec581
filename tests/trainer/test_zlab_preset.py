"""The `zlab-qwen3.6` preset trains (two steps, on a tiny saved qwen3_5 target instead of the built-in one), and
the built-in `embedded-qwen3_5` target is a real qwen3_5 hybrid with the published RoPE layout."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.tiny_targets import save_tiny_qwen3_5
from trainer.config import PRESETS


def test_the_preset_trains_and_records_the_published_structure(tmp_path):
    from trainer.config import build_config
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir
    from trainer.target.embedded import build_embedded_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = save_tiny_qwen3_5(tmp_path / "target", build_embedded_tokenizer(small=True), layers=8)
        config = build_config(preset="zlab-qwen3.6", extra=dict(
            target=str(target), steps=2, batch_size=2, max_anchors=2, eval_every=None, eval_prompts=1,
            eval_max_new_tokens=4, warmup_steps=0,
        ))
        run = RunDir(tmp_path / "runs" / "zlab-qwen3.6")
        result = train(run, config, preset="zlab-qwen3.6", device="cpu", progress=False)
    finally:
        torch.set_num_threads(threads)
    assert result.steps_done == 2
    info = json.loads((run.path / "run.json").read_text())
    drafter = info["drafter"]
    assert drafter["layer_windows"] == [32] * 4 + [None] and drafter["sliding_window_non_causal"] is False
    assert (drafter["num_attention_heads"], drafter["num_key_value_heads"], drafter["head_dim"]) == (4, 1, 16)
    assert drafter["rotary_dim"] == 16 and drafter["rope_parameters"]["rope_theta"] == 1e7
    saved = json.loads((run.path / "config.json").read_text())
    assert saved["target_layer_ids"] == [1, 2, 3, 4, 5] and saved["block_size"] == 16
    assert saved["draft_config"] == {**PRESETS["zlab-qwen3.6"]["draft_config"], "sliding_window_non_causal": False,
                                     "rope_theta": None}
    # the mask token is the target tokenizer's own <|mask|>
    assert json.loads((run.path / "eval.json").read_text())["tau"] >= 1.0


@pytest.mark.slow
def test_embedded_qwen3_5_is_a_qwen3_5_hybrid(tmp_path):
    from transformers import AutoConfig

    from trainer.target.embedded import build_embedded_target

    path = build_embedded_target(tmp_path / "q35", steps=2, progress=False, name="embedded-qwen3_5")
    config = AutoConfig.from_pretrained(path).get_text_config()
    assert config.model_type == "qwen3_5_text" and config.num_hidden_layers == 8
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    rope = config.rope_parameters
    assert (rope["partial_rotary_factor"], rope["rope_theta"], rope["mrope_interleaved"]) == (0.25, 1e7, True)
    assert 2 * sum(rope["mrope_section"]) == config.head_dim // 4  # the sections cover the rotated quarter
    marker = json.loads((path / "dflash-embedded.json").read_text())
    assert marker["name"] == "embedded-qwen3_5" and marker["recipe"]["family"] == "qwen3_5"
