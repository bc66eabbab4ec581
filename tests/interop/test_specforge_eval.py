"""`trainer eval DIR --target TARGET` on SpecForge output (tests/fixtures/specforge, made by
tools/make_specforge_fixture.py with SpecForge's own trainer and exporter).

The reference is SpecForge's own HF export of the same best checkpoint (`specforge.export.to_hf`, in
`export-hf/`, a z-lab-layout directory): the checkpoint read from `training_state.pt` must decode exactly
what the export decodes on the same target and prompts.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "specforge"
OUT = FIXTURE / "outputs" / "sf-tiny"
SMALL = ("--prompts", "2", "--max-new-tokens", "10", "--device", "cpu", "--json")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def invoke(*args: str):
    from typer.testing import CliRunner

    from trainer.cli import app

    return CliRunner().invoke(app, ["eval", *args])


def test_a_specforge_checkpoint_decodes_what_specforges_own_export_decodes():
    result = invoke(str(OUT), "--against", str(FIXTURE / "export-hf"), "--target", str(FIXTURE / "verifier"), *SMALL)
    assert result.exit_code == 0, result.output
    checkpoint, export = json.loads(result.stdout.strip().splitlines()[-1])["drafters"]
    assert (checkpoint["layout"], export["layout"]) == ("specforge", "zlab")
    assert checkpoint["drafter"] == f"sf-tiny/sf-tiny-best -> {(OUT / 'sf-tiny-best').resolve().name}"
    exported = json.loads((FIXTURE / "export-hf" / "config.json").read_text())
    assert checkpoint["block_size"] == export["block_size"] == exported["block_size"]
    for key in ("tau", "acceptance_histogram", "per_position_acceptance"):
        assert checkpoint[key] == export[key], key
    assert checkpoint["lossless"] is True and 1.0 <= checkpoint["tau"] <= exported["block_size"]


def test_a_torn_training_state_is_one_line_and_exit_2(tmp_path):
    copy = tmp_path / "sf-tiny"
    shutil.copytree(OUT, copy, symlinks=True)
    state = copy / (OUT / "sf-tiny-best").resolve().name / "training_state.pt"
    state.write_bytes(state.read_bytes()[:300])
    result = invoke(str(copy), "--target", str(FIXTURE / "verifier"), "--device", "cpu")
    assert result.exit_code == 2
    assert "training_state.pt cannot be read" in result.output and "Traceback" not in result.output


def test_without_target_the_message_names_the_recorded_target():
    result = invoke(str(OUT / "sf-tiny-step4"), "--device", "cpu")
    assert result.exit_code == 2
    assert "give --target" in result.output and "verifier" in result.output


SPECFORGE = os.environ.get("SLEUTH_SPECFORGE_PATH") or os.environ.get("UPSTREAM_SPECFORGE_PATH")


@pytest.mark.skipif(not SPECFORGE, reason="SpecForge checkout not given (SLEUTH_SPECFORGE_PATH / UPSTREAM_SPECFORGE_PATH)")
def test_the_rebuilt_drafter_computes_what_specforges_own_model_computes(monkeypatch):
    """Our DFlashDrafter built from training_state.pt vs SpecForge's DFlashDraftModel with the same weights
    (built as its `materialize_draft` does, in float32), on the same context features and block: same hidden
    states. SpecForge's draft model imports without sglang; it is imported from the checkout, not installed."""
    monkeypatch.syspath_prepend(SPECFORGE)
    try:
        from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    except Exception as exc:  # its pinned transformers may differ from ours
        pytest.skip(f"SpecForge's draft model does not import here: {exc}")
    from trainer.eval.foreign import load_foreign_drafter

    checkpoint = (OUT / "sf-tiny-best").resolve()
    state = torch.load(checkpoint / "training_state.pt", map_location="cpu", weights_only=True)
    config = AutoDraftModelConfig.from_file(str(FIXTURE / "draft-dflash.json"))
    config._attn_implementation = "sdpa"
    theirs = AutoDraftModel.from_config(config, torch_dtype=torch.float32)
    missing, unexpected = theirs.load_state_dict(state["draft_state_dict"], strict=False)
    assert not unexpected and all("embed" in key for key in missing)
    theirs.eval()
    ours = load_foreign_drafter(OUT, hidden_size=32, num_target_layers=8, device=torch.device("cpu")).drafter
    torch.manual_seed(0)
    context, block = 7, state["dflash_block_size"]
    features = torch.randn(1, context, len(state["dflash_target_layer_ids"]) * 32)
    embeds = torch.randn(1, block, 32)
    positions = torch.arange(context + block).unsqueeze(0)
    with torch.no_grad():
        expected = theirs(position_ids=positions, noise_embedding=embeds, target_hidden=features, is_causal=False)
        got = ours(embeds, features, positions)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
