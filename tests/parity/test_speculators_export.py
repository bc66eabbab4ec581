"""A drafter exported with `--format speculators`, loaded by speculators' own DFlashDraftModel.from_pretrained,
drafts the same logits as our drafter on its target (fp32, within 1e-5), for tiny targets of several families
and for draft-vocabulary runs.

speculators reloads embed_tokens and lm_head from the verifier named in the config, by name and as a plain
table. Where that cannot reproduce what the drafter saw (Gemma's embeddings scaled by sqrt(H) inside the
embedding module; GPT-2's transformer.wte and GPT-NeoX's gpt_neox.embed_in, which speculators does not find), the
export carries the effective tables and names no verifier path, so speculators keeps them: the same test
covers those families. A draft-vocabulary run exports d2t / t2d and the reduced lm_head, which speculators
keeps from the checkpoint; its logits are over the draft vocabulary, and d2t maps them to the same target ids.

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

from tests.trainer.tiny_targets import save_family_target  # noqa: E402

BLOCK = 4
CONTEXT = 20  # the anchor's position: the block sees context 0..19
# Plain tables (reloaded from the verifier), scaled tables (carried), tables speculators finds under other
# names (carried); the first of each also with a draft vocabulary.
CASES = [
    ("llama", None), ("qwen3", None), ("mistral", None), ("gemma2", None), ("gemma3_text", None), ("gpt2", None),
    ("gpt_neox", None), ("qwen3", 24), ("gemma2", 24),
]
CARRIES_TABLES = {"gemma2", "gemma3_text", "gpt2", "gpt_neox"}


@pytest.fixture(scope="module")
def tokenizer():
    from trainer.target.embedded import build_embedded_tokenizer

    return build_embedded_tokenizer(small=True)


def train_run(family: str, root: Path, tokenizer, draft_vocab_size: int | None) -> Path:
    from trainer.config import build_config
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir

    target = save_family_target(family, root / "target", tokenizer)
    config = build_config(extra=dict(
        target=str(target), steps=1, batch_size=2, seq_len=48, draft_layers=2, block_size=BLOCK, max_anchors=4,
        eval_every=None, eval_prompts=1, eval_max_new_tokens=4, warmup_steps=0, checkpoint_every=1,
        target_layer_ids=[0, 1],  # two layers, neither the last (vLLM cannot capture the last)
        draft_vocab_size=draft_vocab_size,
    ))
    run = RunDir(root / "runs" / "r")
    train(run, config, preset=None, device="cpu", progress=False)
    return run.path


def draft_logits_both_ways(run_dir: Path, export_dir: Path) -> tuple[torch.Tensor, torch.Tensor, DFlashDraftModel]:
    """[B, V or Vd] draft logits for one block: our drafter on its target, and speculators' loaded export."""
    from trainer.run.loop import load_run

    ours = load_run(run_dir, "cpu")
    k, hidden = len(ours.feature_layer_ids), ours.target.hidden_size
    generator = torch.Generator().manual_seed(3)
    seq_len = CONTEXT + 2 * BLOCK
    input_ids = torch.randint(5, 200, (1, seq_len), generator=generator)
    features = torch.randn(1, seq_len, k * hidden, generator=generator)  # [1, S, k*H] as the verifier gives them
    block_ids = torch.full((1, BLOCK), ours.drafter.mask_token_id)
    block_ids[0, 0] = input_ids[0, CONTEXT]
    positions = torch.arange(CONTEXT + BLOCK)[None]  # context 0..C-1, block C..C+B-1
    with torch.no_grad():
        hidden_out = ours.drafter(ours.target.embed(block_ids), features[:, :CONTEXT], positions)
        expected = ours.target.logits(hidden_out, ours.draft_token_ids)[0]  # [B, V] or [B, Vd]

    model = DFlashDraftModel.from_pretrained(str(export_dir)).float().eval()

    def the_anchor(loss_mask, num_anchors, size):
        return torch.tensor([CONTEXT]), torch.tensor([True])

    with torch.no_grad(), patched(speculators_core, "select_anchors", the_anchor):
        _, got, *_ = model._backbone_forward(
            hidden_states=features, input_ids=input_ids, loss_mask=torch.ones(1, seq_len, dtype=torch.long),
            verifier_last_hidden_states=torch.zeros(1, seq_len, hidden), document_ids=torch.zeros(1, seq_len, dtype=torch.long),
            position_ids=torch.arange(seq_len)[None], max_anchors=1,
        )
    return expected, got[0], model


@pytest.mark.parametrize(("family", "draft_vocab_size"), CASES, ids=[f"{f}-vocab{v}" if v else f for f, v in CASES])
def test_speculators_loads_our_export_and_drafts_the_same_logits(family, draft_vocab_size, tmp_path, tokenizer):
    from trainer.export import export_run
    from trainer.run.loop import load_run

    run_dir = train_run(family, tmp_path, tokenizer, draft_vocab_size)
    out = tmp_path / "speculators"
    result = export_run(run_dir, out, "speculators")
    config = json.loads((out / "config.json").read_text())
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    expected, got, model = draft_logits_both_ways(run_dir, out)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert expected.std() > 0.1  # real logits, not a constant that would match anything

    if family in CARRIES_TABLES:  # the tables come from the export, and speculators was told no verifier
        assert verifier is None and any("embeddings and lm_head" in note for note in result.notes)
    else:
        assert verifier == str((tmp_path / "target").resolve()) and not result.notes
    if draft_vocab_size:
        ours = load_run(run_dir, "cpu")
        assert config["draft_vocab_size"] == draft_vocab_size < config["transformer_layer_config"]["vocab_size"]
        assert model.use_draft_vocab
        # d2t maps draft index i to target id i + d2t[i]: the same ids our drafter proposes among
        assert torch.equal(torch.arange(draft_vocab_size) + model.d2t, ours.draft_token_ids)
        assert torch.equal(model.t2d.nonzero()[:, 0], ours.draft_token_ids)
        # A checkpoint written by speculators itself (from the loaded export) measures in `trainer eval DIR
        # --target` what the run measures: tau in the target vocabulary, identical at temperature 0.
        from trainer.eval.foreign import evaluate_drafters

        saved = tmp_path / "saved-by-speculators"
        model.save_pretrained(saved)
        theirs, own = evaluate_drafters(
            [saved, run_dir], str(tmp_path / "target"), prompts=2, max_new_tokens=12, block_size=None,
            temperature=0.0, data="embedded", seed=0, device="cpu",
        )
        assert (theirs["layout"], own["layout"]) == ("speculators", "run")
        for key in ("tau", "acceptance_histogram", "per_position_acceptance", "output_tokens", "verify_steps"):
            assert theirs[key] == own[key], key
        assert theirs["lossless"] is True and own["verify_steps"] > 0
