"""A DSpark run exported with `--format speculators` loads with speculators 0.9.0's own
DSparkDraftModel.from_pretrained and computes our drafter's post-Markov logits and confidence logits for a block
(fp32, within 1e-5), with the Markov token rule of speculators' training forward (`dspark.markov_prev_token`).

Runs in speculators' own venv (`make parity`); skips elsewhere unless SPECULATORS_PARITY_REQUIRED=1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculators_guard import require_speculators

require_speculators()
from speculators.models.dflash import core as dflash_core  # noqa: E402
from speculators.models.dspark.core import DSparkDraftModel  # noqa: E402

from parity_harness import patched  # noqa: E402

from tests.trainer.tiny_targets import save_family_target  # noqa: E402

BLOCK = 5
CONTEXT = 20  # the anchor's position: the block sees context 0..19
# head type, sample_from_anchor (gated's forward is compared in test_dspark_parity.py)
CASES = [("vanilla", True), ("rnn", False)]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    from trainer.target.embedded import build_embedded_tokenizer

    return save_family_target("qwen3", tmp_path_factory.mktemp("dspark") / "target", build_embedded_tokenizer(small=True))


def train_run(root: Path, target: Path, head_type: str, sample_from_anchor: bool) -> Path:
    from trainer.config import build_config
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir

    config = build_config(preset="dspark-tiny", extra=dict(
        target=str(target), steps=1, batch_size=2, seq_len=48, draft_layers=2, block_size=BLOCK, max_anchors=4,
        eval_every=None, eval_prompts=1, eval_max_new_tokens=4, warmup_steps=0, checkpoint_every=1,
        target_layer_ids=[0, 1], dspark={"markov_rank": 8, "markov_head_type": head_type,
                                         "sample_from_anchor": sample_from_anchor},
    ))
    run = RunDir(root / "runs" / "r")
    train(run, config, preset="dspark-tiny", device="cpu", progress=False)
    return run.path


@pytest.mark.parametrize(("head_type", "sample_from_anchor"), CASES, ids=[f"{h}-anchor{a}" for h, a in CASES])
def test_speculators_loads_our_dspark_export_with_equal_logits(head_type, sample_from_anchor, target, tmp_path):
    from trainer.export import export_run
    from trainer.model.dspark import training_prev_ids
    from trainer.run.loop import load_run

    run_dir = train_run(tmp_path, target, head_type, sample_from_anchor)
    out = tmp_path / "speculators"
    export_run(run_dir, out, "speculators")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["sample_from_anchor"] is sample_from_anchor
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == (
        BLOCK if sample_from_anchor else BLOCK - 1)

    ours = load_run(run_dir, "cpu")
    drafter = ours.drafter
    k, hidden_size = len(ours.feature_layer_ids), ours.target.hidden_size
    generator = torch.Generator().manual_seed(3)
    seq_len = CONTEXT + 2 * BLOCK
    input_ids = torch.randint(5, 200, (1, seq_len), generator=generator)
    features = torch.randn(1, seq_len, k * hidden_size, generator=generator)
    block_ids = torch.full((1, BLOCK), drafter.mask_token_id)
    block_ids[0, 0] = input_ids[0, CONTEXT]
    prev = training_prev_ids(input_ids, torch.tensor([[CONTEXT]]), BLOCK, sample_from_anchor)[0]  # [1, B]
    with torch.no_grad():
        hidden = drafter(ours.target.embed(block_ids), features[:, :CONTEXT], torch.arange(CONTEXT + BLOCK)[None])
        markov, expected_confidence = drafter.heads(hidden, prev)
        expected = ours.target.logits(hidden)[0] + drafter.markov_head.markov_w2(markov)[0]  # [B, V]

    model = DSparkDraftModel.from_pretrained(str(out)).float().eval()

    def the_anchor(loss_mask, num_anchors, size):
        return torch.tensor([CONTEXT]), torch.tensor([True])

    with torch.no_grad(), patched(dflash_core, "select_anchors", the_anchor):
        their_hidden, logits, *_ = model._backbone_forward(
            hidden_states=features, input_ids=input_ids, loss_mask=torch.ones(1, seq_len, dtype=torch.long),
            verifier_last_hidden_states=torch.zeros(1, seq_len, hidden_size),
            document_ids=torch.zeros(1, seq_len, dtype=torch.long), position_ids=torch.arange(seq_len)[None],
            max_anchors=1,
        )
        hidden_blocks = their_hidden.view(1, BLOCK, -1)
        prev_emb = model.markov_head.prev_embeddings(prev)
        got = logits[0] + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden_blocks,
                                                       prev_emb=prev_emb)[0]
        got_confidence = model.confidence_head(torch.cat([hidden_blocks, prev_emb], dim=-1))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_confidence, expected_confidence, rtol=0, atol=1e-5)
    assert expected.std() > 0.1 and drafter.markov_head.markov_w2(markov).abs().max() > 0

    if head_type == "vanilla":
        # A checkpoint written by speculators itself (from the loaded export) decodes in `trainer eval DIR
        # --target` exactly as the run does: same tau, same per-slot acceptance, at temperature 0.
        from trainer.eval.foreign import evaluate_drafters

        saved = tmp_path / "saved-by-speculators"
        model.save_pretrained(saved)
        theirs, own = evaluate_drafters([saved, run_dir], str(target), prompts=2, max_new_tokens=12,
                                        block_size=None, temperature=0.0, data="embedded", seed=0, device="cpu")
        assert (theirs["layout"], own["layout"]) == ("speculators", "run")
        for key in ("tau", "acceptance_histogram", "per_position_acceptance", "output_tokens", "verify_steps"):
            assert theirs[key] == own[key], key
        assert theirs["lossless"] is True and len(theirs["acceptance_histogram"]) == BLOCK + 1
