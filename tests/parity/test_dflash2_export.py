"""A DFlash2 run exported in both layouts is reloaded by the reference packages' own DFlash2 classes, and they
draft what our drafter drafts:

  * `--format speculators` (flat fields, `speculators_model_type: dflash2`): speculators 0.9.0's
    DFlash2DraftModel.from_pretrained; the same hidden states and unary logits for a block, and the same
    selector scores for the same candidates and predecessors.
  * `--format zlab` (nested `dflash_config`, `architectures: [DFlash2DraftModel]`, `is_causal: false`): z-lab's
    dflash 0.1.0 DFlash2DraftModel.from_pretrained (which maps the bare codebook names onto its Embeddings);
    the same block hidden states, and its greedy `propose` walks to the tokens our DFlash2Proposer proposes.

The run trains a few steps at a high learning rate so convolutions and codebooks are far from their init.
Runs in the reference venv (`make parity`); skips elsewhere unless SPECULATORS_PARITY_REQUIRED=1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculators_guard import require_speculators

require_speculators()
from speculators.models.dflash import core as speculators_core  # noqa: E402
from speculators.models.dflash2.core import DFlash2DraftModel  # noqa: E402

from parity_harness import patched  # noqa: E402

from tests.trainer.tiny_targets import save_family_target  # noqa: E402

BLOCK = 4
CONTEXT = 20  # the anchor's position; the window (32) covers all of it, where z-lab's and ours agree


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from trainer.config import build_config
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir
    from trainer.target.embedded import build_embedded_tokenizer

    root = tmp_path_factory.mktemp("dflash2-export")
    target = save_family_target("qwen3", root / "target", build_embedded_tokenizer(small=True))
    config = build_config(preset="dflash2-tiny", extra=dict(
        target=str(target), steps=3, batch_size=2, seq_len=48, draft_layers=2, block_size=BLOCK, max_anchors=4,
        lr=0.05, eval_every=None, eval_prompts=1, eval_max_new_tokens=4, warmup_steps=0, checkpoint_every=3,
        target_layer_ids=[0, 1], draft_config={"layer_types": ["sliding_attention"] * 2, "sliding_window": 32,
                                               "sliding_window_non_causal": True},
        dflash2={"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 6},
    ))
    run = RunDir(root / "runs" / "d2")
    train(run, config, preset="dflash2-tiny", device="cpu", progress=False)
    return run.path


def our_block(run_dir: Path):
    """Our loaded run on one block: (loaded run, features [1, S, k*H], input ids [1, S], block ids, hidden [1, B, H])."""
    from trainer.run.loop import load_run

    ours = load_run(run_dir, "cpu")
    k, hidden = len(ours.feature_layer_ids), ours.target.hidden_size
    generator = torch.Generator().manual_seed(3)
    seq_len = CONTEXT + 2 * BLOCK
    input_ids = torch.randint(5, 200, (1, seq_len), generator=generator)
    features = torch.randn(1, seq_len, k * hidden, generator=generator)
    block_ids = torch.full((1, BLOCK), ours.drafter.mask_token_id)
    block_ids[0, 0] = input_ids[0, CONTEXT]
    with torch.no_grad():
        out = ours.drafter(ours.target.embed(block_ids), features[:, :CONTEXT], torch.arange(CONTEXT + BLOCK)[None])
    return ours, features, input_ids, block_ids, out


def test_the_run_moved_far_from_identity(run_dir):
    ours = our_block(run_dir)[0]
    kernel = ours.drafter.layers[0].attention_conv.base_kernel
    assert (kernel[:, 1:].abs().max() > 1e-2) and (ours.drafter.layers[0].mlp_conv.kernel_projection.weight.abs().max() > 1e-2)


def test_speculators_reloads_the_flat_export_and_drafts_the_same(run_dir, tmp_path):
    from trainer.export import export_run

    out = tmp_path / "speculators"
    export_run(run_dir, out, "speculators")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["architectures"] == ["DFlash2DraftModel"]
    assert (config["conv_group_size"], config["selector_top_k"], config["sliding_window_non_causal"]) == (8, 6, True)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1

    ours, features, input_ids, _block, hidden = our_block(run_dir)
    model = DFlash2DraftModel.from_pretrained(str(out)).float().eval()
    seq_len = input_ids.shape[1]

    def the_anchor(loss_mask, num_anchors, size):
        return torch.tensor([CONTEXT]), torch.tensor([True])

    with torch.no_grad(), patched(speculators_core, "select_anchors", the_anchor):
        their_hidden, their_logits, *_ = model._backbone_forward(
            hidden_states=features, input_ids=input_ids, loss_mask=torch.ones(1, seq_len, dtype=torch.long),
            verifier_last_hidden_states=torch.zeros(1, seq_len, ours.target.hidden_size),
            document_ids=torch.zeros(1, seq_len, dtype=torch.long), position_ids=torch.arange(seq_len)[None],
            max_anchors=1,
        )
    torch.testing.assert_close(their_hidden, hidden, rtol=0, atol=1e-5)
    unary = ours.target.logits(hidden)
    torch.testing.assert_close(their_logits, unary, rtol=0, atol=1e-5)
    assert unary.std() > 0.1
    # the selector: the same candidates and predecessors give the same scores
    predecessors = torch.randint(5, 200, (1, BLOCK), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        candidates, theirs = model.candidate_selector.select(unary, hidden, predecessors)
        mine = unary[0].gather(1, candidates[0]) + ours.drafter.candidate_selector.transition_scores(
            hidden[0], predecessors[0], candidates[0])
    torch.testing.assert_close(theirs[0], mine, rtol=0, atol=1e-5)
    assert (mine - unary[0].gather(1, candidates[0])).abs().max() > 1e-3  # the selector contributes


def test_zlab_reloads_the_nested_export_and_proposes_the_same_tokens(run_dir, tmp_path):
    from dflash.model import DFlash2DraftModel as ZlabDFlash2
    from transformers import DynamicCache

    from trainer.eval.speculative import proposer_for
    from trainer.export import export_run

    out = tmp_path / "zlab"
    export_run(run_dir, out, "zlab")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    nested = config["dflash_config"]
    assert (nested["conv_kernel_size"], nested["conv_group_size"], nested["selector_rank"], nested["selector_top_k"]) \
        == (2, 8, 8, 6)

    ours, features, _ids, block_ids, hidden = our_block(run_dir)
    model = ZlabDFlash2.from_pretrained(str(out)).float().eval()
    # every weight reached z-lab's model (the codebooks through its own key mapping)
    torch.testing.assert_close(model.candidate_selector.predecessor_codebook.weight,
                               ours.drafter.candidate_selector.predecessor_codebook, rtol=0, atol=0)
    with torch.no_grad():
        their_hidden = model(position_ids=torch.arange(CONTEXT + BLOCK)[None],
                             noise_embedding=ours.target.embed(block_ids), target_hidden=features[:, :CONTEXT])
        torch.testing.assert_close(their_hidden, hidden, rtol=0, atol=1e-5)
        their_tokens, _candidates, _q = model.propose(their_hidden[:, 1:], block_ids[:, 0],
                                                      ours.target.model.lm_head, 0.0)
        proposal = proposer_for(ours.drafter, ours.target).propose(
            block_ids, features[:, :CONTEXT], torch.arange(CONTEXT + BLOCK)[None], DynamicCache())
    assert proposal[0].argmax(dim=-1).tolist() == their_tokens[0].tolist()
