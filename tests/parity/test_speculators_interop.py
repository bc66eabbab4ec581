"""Drafters and save directories made by speculators' own code, read by sleuth and loaded by trainer eval.

In the speculators environment (`make parity`): a tiny verifier saved with `save_pretrained`; speculators'
`DFlashDraftModel.from_training_args` (what `speculators train` calls) builds drafters, its
`SingleGPUCheckpointer` writes epochs and the `checkpoint_best` link. Nothing here imitates a speculators
file: defects are planted by passing the wrong arguments to speculators itself.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from speculators_guard import require_speculators

require_speculators()
from speculators.models.dflash.core import DFlashDraftModel  # noqa: E402
from speculators.train.checkpointer import SingleGPUCheckpointer  # noqa: E402
from speculators.train.cli import create_transformer_layer_config  # noqa: E402

from sleuth.interop import foreign_findings  # noqa: E402
from sleuth.runs import read_run  # noqa: E402

TOOL = Path(__file__).resolve().parents[2] / "tools" / "make_speculators_fixture.py"


@pytest.fixture(scope="module")
def verifier(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("make_speculators_fixture", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_verifier(tmp_path_factory.mktemp("spec"), train_steps=0)


def build(verifier: Path, **kwargs) -> DFlashDraftModel:
    """speculators' own construction path for `speculators train --speculator-type dflash`."""
    torch.manual_seed(0)
    layer_config = create_transformer_layer_config(
        str(verifier), num_layers=1, draft_arch="qwen3", hidden_act=None, sliding_window=2048,
        full_attention_indices=[],
    )
    args = {"verifier_name_or_path": str(verifier), "draft_vocab_size": layer_config.vocab_size, "block_size": 4,
            "draft_attn_impl": "sdpa", "mask_token_id": 300, **kwargs}
    return DFlashDraftModel.from_training_args(layer_config, **args)


def diagnose_dir(path: Path) -> dict:
    info = read_run(path)
    return {f.id: f for f in foreign_findings(info, [])}


def test_speculators_defaults_saved_with_save_pretrained_have_no_mismatch(verifier, tmp_path):
    build(verifier).save_pretrained(tmp_path / "draft")
    findings = diagnose_dir(tmp_path / "draft")
    assert {f.id: f.status for f in findings.values() if f.status == "mismatch"} == {}
    assert findings["dflash.target_layer_ids"].status == "match"
    assert findings["dflash.fc_input_layers"].status == "match"


@pytest.mark.parametrize(
    ("kwargs", "finding_id", "words"),
    [
        ({"target_layer_ids": [1, 3, 4]}, "dflash.target_layer_ids", "off by -1"),
        ({"target_layer_ids": [0, 4, 5]}, "dflash.target_layer_ids", "embeddings"),
        ({"sample_from_anchor": True}, "dflash.anchor_slot_untrained", "DSpark"),
        ({"mask_token_id": None}, "speculators.mask_token_id", "no mask token"),
    ],
)
def test_defects_made_by_speculators_itself_are_flagged(verifier, tmp_path, kwargs, finding_id, words):
    build(verifier, **kwargs).save_pretrained(tmp_path / "draft")
    finding = diagnose_dir(tmp_path / "draft")[finding_id]
    assert finding.status == "mismatch" and words in finding.reason


def test_a_save_directory_written_by_speculators_checkpointer(verifier, tmp_path):
    model = build(verifier)
    optimizer = torch.optim.AdamW(model.parameters())
    checkpointer = SingleGPUCheckpointer(tmp_path / "save")
    for epoch in (0, 1):
        checkpointer.save_checkpoint(model, optimizer, epoch)
    checkpointer.update_best_symlink(0)
    info = read_run(tmp_path / "save")
    assert info.interop.kind == "save_dir"
    assert [c.epoch for c in info.interop.checkpoints] == [0, 1]
    assert info.interop.chosen.epoch == 0  # checkpoint_best, not the latest epoch
    assert diagnose_dir(tmp_path / "save")["dflash.target_layer_ids"].status == "match"


def test_trainer_loads_the_weights_speculators_saved(verifier, tmp_path):
    from trainer.eval.foreign import load_foreign_drafter

    model = build(verifier)
    model.save_pretrained(tmp_path / "draft")
    loaded = load_foreign_drafter(tmp_path / "draft", hidden_size=model.config.transformer_layer_config.hidden_size,
                                  num_target_layers=8, device=torch.device("cpu"))
    assert loaded.feature_layer_ids == [1, 3, 4]  # vLLM [2, 4, 5] in z-lab numbering
    theirs = model.state_dict()
    for name, tensor in loaded.drafter.state_dict().items():
        if name in theirs:
            torch.testing.assert_close(tensor, theirs[name].float(), rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_the_fixture_tool_runs_speculators_train_and_matches_the_committed_fixture(tmp_path):
    """tools/make_speculators_fixture.py end to end (speculators' own `train` on CPU, one epoch), read by
    sleuth; the committed tests/fixtures/speculators has the same layout, so it cannot drift from what
    this speculators version writes."""
    import subprocess
    import sys

    subprocess.run([sys.executable, str(TOOL), str(tmp_path), "--epochs", "1"], check=True, capture_output=True,
                   timeout=1200)
    committed = Path(__file__).resolve().parents[1] / "fixtures" / "speculators"
    for name in ("specout", "specout-gamma7"):
        made = sorted(p.relative_to(tmp_path / name).as_posix() for p in (tmp_path / name).rglob("*"))
        assert made == [
            "0", "0/config.json", "0/config.py", "0/model.safetensors", "0/train_command.txt", "0/training_state.json",
            "0/val_metrics.json", "checkpoint_best", "epoch0_end", "run.yaml", "speculators.patch", "train_command.txt",
        ], made
        kept = {p.name for p in (committed / name / "0").iterdir()}
        assert kept == {p.name for p in (tmp_path / name / "0").iterdir()}
        info = read_run(tmp_path / name)
        assert info.series("loss")[0] and "val_loss" in info.metrics[-1]
        assert not [f for f in foreign_findings(info, []) if f.status == "mismatch" and f.id != "dflash.loss_decay_gamma"]
