"""The `zlab-qwen3.6` preset's drafter (four sliding-window layers and one full, its own 4 / 1 heads of 16,
block 16) on a tiny `qwen3_5` target, exported with `--format speculators` and loaded by speculators 0.9.0's
own DFlashDraftModel.from_pretrained, drafts our logits (fp32, within 1e-5) for a block whose context is
longer than the window, where the window decides the result.

What speculators 0.9.0 needs for a qwen3_5 verifier: `AutoConfig` of the verifier (transformers 5.19 has
`qwen3_5_text`; its final norm is Gemma-style, which speculators picks for `verifier_norm`, a training-only
module), the verifier's `embed_tokens.weight` / `lm_head.weight` found by name or suffix (a text model's
`model.embed_tokens.weight`; Qwen3.6's `model.language_model.embed_tokens.weight` also ends with it), and a
layer config that keeps the window: `use_sliding_window: true` (Qwen3Config sets sliding_window to None
otherwise) with explicit `layer_types`. The last test shows that gate: the same export without it loads fine
and drafts other logits, because speculators then builds every layer full attention.

Runs in speculators' own venv (`make parity`); skips elsewhere unless SPECULATORS_PARITY_REQUIRED=1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculators_guard import require_speculators

require_speculators()
from speculators.models.dflash import core as speculators_core  # noqa: E402
from speculators.models.dflash.core import DFlashDraftModel  # noqa: E402

from parity_harness import patched  # noqa: E402

from tests.trainer.tiny_targets import save_tiny_qwen3_5  # noqa: E402

BLOCK = 16
WINDOW = 32  # the preset's
CONTEXT = 45  # the anchor's position: past the window, so a sliding layer reads only 13..44
LAYER_TYPES = ["sliding_attention"] * 4 + ["full_attention"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from trainer.config import build_config
    from trainer.export import export_run
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir
    from trainer.target.embedded import build_embedded_tokenizer

    root = tmp_path_factory.mktemp("sliding")
    # 8 layers: the preset's layer rule picks [1, 2, 3, 4, 5], none of them the last (vLLM cannot capture it)
    target = save_tiny_qwen3_5(root / "target", build_embedded_tokenizer(small=True), layers=8)
    config = build_config(preset="zlab-qwen3.6", extra=dict(
        target=str(target), steps=2, batch_size=2, seq_len=64, max_anchors=2, eval_every=None, eval_prompts=1,
        eval_max_new_tokens=4, warmup_steps=0, checkpoint_every=2,
    ))
    run = RunDir(root / "runs" / "r")
    train(run, config, preset=None, device="cpu", progress=False)
    out = root / "speculators"
    export_run(run.path, out, "speculators")
    return run.path, out


def draft_logits(run_dir: Path, export_dir: Path) -> tuple[torch.Tensor, torch.Tensor, DFlashDraftModel]:
    """[B, V] for one block anchored at CONTEXT: our drafter's inference pass, and speculators' loaded export."""
    from trainer.run.loop import load_run

    ours = load_run(run_dir, "cpu")
    k, hidden = len(ours.feature_layer_ids), ours.target.hidden_size
    generator = torch.Generator().manual_seed(5)
    seq_len = CONTEXT + 2 * BLOCK
    input_ids = torch.randint(5, 200, (1, seq_len), generator=generator)
    features = torch.randn(1, seq_len, k * hidden, generator=generator)
    block_ids = torch.full((1, BLOCK), ours.drafter.mask_token_id)
    block_ids[0, 0] = input_ids[0, CONTEXT]
    with torch.no_grad():
        hidden_out = ours.drafter(ours.target.embed(block_ids), features[:, :CONTEXT], torch.arange(CONTEXT + BLOCK)[None])
        expected = ours.target.logits(hidden_out)[0]

    model = DFlashDraftModel.from_pretrained(str(export_dir)).float().eval()

    def the_anchor(loss_mask, num_anchors, size):
        return torch.tensor([CONTEXT]), torch.tensor([True])

    with torch.no_grad(), patched(speculators_core, "select_anchors", the_anchor):
        _, got, *_ = model._backbone_forward(
            hidden_states=features, input_ids=input_ids, loss_mask=torch.ones(1, seq_len, dtype=torch.long),
            verifier_last_hidden_states=torch.zeros(1, seq_len, hidden),
            document_ids=torch.zeros(1, seq_len, dtype=torch.long), position_ids=torch.arange(seq_len)[None],
            max_anchors=1,
        )
    return expected, got[0], model


def test_speculators_builds_the_windows_and_drafts_our_logits(exported):
    run_dir, out = exported
    config = json.loads((out / "config.json").read_text())
    layer = config["transformer_layer_config"]
    assert (layer["layer_types"], layer["sliding_window"], layer["use_sliding_window"]) == (LAYER_TYPES, WINDOW, True)
    assert (layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == (4, 1, 16)
    assert config["aux_hidden_state_layer_ids"] == [2, 3, 4, 5, 6] and config["block_size"] == BLOCK  # vLLM ids
    assert config["sliding_window_non_causal"] is False
    # full rotary in 1-D: none of the target's partial rotary or mRoPE sections reach the drafter's config
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    expected, got, model = draft_logits(run_dir, out)
    assert (model.sliding_window, model.sliding_window_indices) == (WINDOW, [0, 1, 2, 3])
    assert [layer.self_attn.sliding_window for layer in model.layers] == [WINDOW] * 4 + [None]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert expected.std() > 0.1


def test_without_use_sliding_window_speculators_serves_full_attention(exported, tmp_path):
    run_dir, out = exported
    config = json.loads((out / "config.json").read_text())
    del config["transformer_layer_config"]["use_sliding_window"]  # the gate: Qwen3Config's default is false
    gated = tmp_path / "gated"
    gated.mkdir()
    (gated / "config.json").write_text(json.dumps(config))
    (gated / "model.safetensors").symlink_to(out / "model.safetensors")
    expected, got, model = draft_logits(run_dir, gated)
    assert model.sliding_window is None  # every layer is built full attention, silently
    assert (got - expected).abs().max() > 1e-3
