"""A drafter exported with `--format speculators`, loaded by speculators' own DFlashDraftModel.from_pretrained
(which reloads embed_tokens and lm_head from the verifier named in the config), drafts the same logits as
our drafter on its target, for tiny targets of several families.

Gemma-style targets scale their input embeddings by sqrt(H) inside the embedding module; speculators
reloads the table as a plain nn.Embedding, so such an export cannot give the drafter its training inputs.
The exporter refuses it; the test shows the refusal is needed by writing the config anyway (bypassing the
check) and measuring the disagreement.

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
FAMILIES = ["llama", "qwen3", "mistral", "gemma2"]
SCALED = {"gemma2"}


@pytest.fixture(scope="module")
def tokenizer():
    from trainer.target.embedded import build_embedded_tokenizer

    return build_embedded_tokenizer(small=True)


def train_run(family: str, root: Path, tokenizer) -> Path:
    from trainer.config import build_config
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir

    target = save_family_target(family, root / "target", tokenizer)
    config = build_config(extra=dict(
        target=str(target), steps=1, batch_size=2, seq_len=48, draft_layers=2, block_size=BLOCK, max_anchors=4,
        eval_every=None, eval_prompts=1, eval_max_new_tokens=4, warmup_steps=0, checkpoint_every=1,
        target_layer_ids=[0, 1],  # two layers, neither the last (vLLM cannot capture the last)
    ))
    run = RunDir(root / "runs" / "r")
    train(run, config, preset=None, device="cpu", progress=False)
    return run.path


def draft_logits_both_ways(run_dir: Path, export_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] draft logits for one block: our drafter on its target, and speculators' loaded export."""
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
        expected = ours.target.logits(ours.drafter(ours.target.embed(block_ids), features[:, :CONTEXT], positions))[0]

    model = DFlashDraftModel.from_pretrained(str(export_dir)).float().eval()

    def the_anchor(loss_mask, num_anchors, size):
        return torch.tensor([CONTEXT]), torch.tensor([True])

    with torch.no_grad(), patched(speculators_core, "select_anchors", the_anchor):
        _, got, *_ = model._backbone_forward(
            hidden_states=features, input_ids=input_ids, loss_mask=torch.ones(1, seq_len, dtype=torch.long),
            verifier_last_hidden_states=torch.zeros(1, seq_len, hidden), document_ids=torch.zeros(1, seq_len, dtype=torch.long),
            position_ids=torch.arange(seq_len)[None], max_anchors=1,
        )
    return expected, got[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_speculators_loads_our_export_and_drafts_the_same_logits(family, tmp_path, tokenizer):
    from trainer.export import ExportError, drafter_spec_for_run, export_run, speculators_config
    from trainer.run.rundir import RunDir

    run_dir = train_run(family, tmp_path, tokenizer)
    out = tmp_path / "speculators"
    if family not in SCALED:
        export_run(run_dir, out, "speculators")
        expected, got = draft_logits_both_ways(run_dir, out)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert expected.std() > 0.1
        return

    with pytest.raises(ExportError, match="scaled") as info:
        export_run(run_dir, out, "speculators")
    assert "\n" not in str(info.value) and "--format zlab" in str(info.value)
    # What the refusal prevents: the same export written without the check.
    export_run(run_dir, tmp_path / "zlab", "zlab")
    spec, _ = drafter_spec_for_run(RunDir(run_dir))
    spec.speculators_refusal = None
    out.mkdir()
    (out / "config.json").write_text(json.dumps(speculators_config(spec, torch.float32)))
    (out / "model.safetensors").symlink_to(tmp_path / "zlab" / "model.safetensors")
    expected, got = draft_logits_both_ways(run_dir, out)
    diff = float((got - expected).abs().max())
    agreement = float((got.argmax(-1) == expected.argmax(-1)).float().mean())
    print(f"\n{family} export without the refusal: max abs logit diff {diff:.3g}, argmax agreement {agreement:.2f}")
    assert diff > 100 * 1e-4  # a hundred times the tolerance the other families meet
