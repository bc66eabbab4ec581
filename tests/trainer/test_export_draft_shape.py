"""A drafter with its own shape (sliding-window layers, its own heads) on a `qwen3_5` target: the run records it,
`trainer export` writes it in both layouts the way the loaders build it, and the z-lab reload drafts the run's
own logits for a context longer than the window (where a lost window changes them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.tiny_targets import char_tokenizer, save_tiny_qwen3_5
from tests.trainer.zlab_reader import zlab_reads
from trainer.export import export_run, load_exported_drafter

BLOCK, WINDOW = 4, 6
LAYER_TYPES = ["sliding_attention", "full_attention"]
SHAPE = {"layer_types": LAYER_TYPES, "sliding_window": WINDOW, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "intermediate_size": 48}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from trainer.config import build_config
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir

    root = tmp_path_factory.mktemp("shape")
    target = save_tiny_qwen3_5(root / "target", char_tokenizer(), layers=4)
    config = build_config(extra=dict(
        target=str(target), steps=2, batch_size=2, seq_len=48, draft_layers=2, block_size=BLOCK, max_anchors=4,
        eval_every=None, eval_prompts=1, eval_max_new_tokens=6, warmup_steps=0, checkpoint_every=2,
        target_layer_ids=[0, 1], draft_config={**SHAPE, "sliding_window_non_causal": True},
    ))
    run = RunDir(root / "runs" / "r")
    train(run, config, preset=None, device="cpu", progress=False)
    return run.path


def test_run_records_the_drafter_as_it_trains(run_dir):
    config = json.loads((run_dir / "config.json").read_text())
    assert config["draft_config"]["layer_types"] == LAYER_TYPES and config["draft_config"]["sliding_window"] == WINDOW
    drafter = json.loads((run_dir / "run.json").read_text())["drafter"]
    assert drafter["layer_windows"] == [WINDOW, None] and drafter["sliding_window_non_causal"] is True
    assert (drafter["num_attention_heads"], drafter["num_key_value_heads"], drafter["head_dim"]) == (4, 2, 8)
    # the target rotates a quarter of each head with mRoPE sections; the drafter rotates its whole head in 1-D
    assert drafter["rotary_dim"] == 8 and drafter["rope_parameters"]["partial_rotary_factor"] == 1.0
    assert "mrope_section" not in drafter["rope_parameters"] and drafter["rope_layout"] == "neox"


def test_both_layouts_carry_the_shape_as_the_loaders_build_it(run_dir, tmp_path):
    zlab = json.loads((export_run(run_dir, tmp_path / "z", "zlab").path / "config.json").read_text())
    spec = json.loads((export_run(run_dir, tmp_path / "s", "speculators").path / "config.json").read_text())
    layer = spec["transformer_layer_config"]
    for config in (zlab, layer):
        assert (config["layer_types"], config["sliding_window"], config["use_sliding_window"]) == (LAYER_TYPES, WINDOW, True)
        assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 8)
        assert config["intermediate_size"] == 48
        assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    assert spec["sliding_window_non_causal"] is True and "sliding_window_non_causal" not in layer
    read = zlab_reads(zlab)
    assert read["layer_windows"] == [WINDOW, None] and read["rotary_dim"] == read["head_dim"] == 8
    assert (read["target_layer_ids"], read["block_size"]) == ([0, 1], BLOCK)


def test_zlab_reload_drafts_the_runs_logits_past_the_window(run_dir, tmp_path):
    from trainer.run.loop import load_run

    out = export_run(run_dir, tmp_path / "z", "zlab").path
    ours = load_run(run_dir, "cpu")
    reloaded = load_exported_drafter(out)
    assert [layer.self_attn.sliding_window for layer in reloaded.layers] == [WINDOW, None]
    context = 3 * WINDOW  # the sliding layer reads only the last WINDOW of these positions
    torch.manual_seed(0)
    features = torch.randn(1, context, 2 * ours.target.hidden_size)
    block = ours.target.embed(torch.full((1, BLOCK), ours.drafter.mask_token_id))
    positions = torch.arange(context + BLOCK)[None]
    with torch.no_grad():
        expected = ours.drafter(block, features, positions)
        got = reloaded(block, features, positions)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # the same weights served with every layer full attention draft something else
    config = json.loads((out / "config.json").read_text())
    config["use_sliding_window"] = False
    (out / "config.json").write_text(json.dumps(config))
    as_full = load_exported_drafter(out)
    assert [layer.self_attn.sliding_window for layer in as_full.layers] == [None, None]
    with torch.no_grad():
        assert (as_full(block, features, positions) - expected).abs().max() > 1e-4


def diagnose(directory: Path, target: Path) -> dict[str, dict]:
    """`sleuth diagnose` on an export directory, in its own process (sleuth never imports trainer)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", "--run", str(directory), "--target",
                           str(target), "--offline", "--no-probe", "--format", "json", "--out", str(directory.parent / "d")],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 1), done.stderr
    return {f["id"]: f for f in json.loads(done.stdout)["findings"]}


def test_sleuth_flags_an_export_without_its_windows_and_one_with_the_targets_partial_rotary(run_dir, tmp_path):
    target = Path(json.loads((run_dir / "run.json").read_text())["target"]["path"])
    out = export_run(run_dir, tmp_path / "good" / "export", "speculators").path
    found = diagnose(out, target)
    assert found["dflash.sliding_window_served"]["status"] == "match"
    assert found["dflash.rope_served_as_trained"]["status"] == "match"
    assert found["dflash.target_tables_resolve"]["status"] == "match"

    for name, edit, invariant, says in [
        ("no-windows", lambda layer: [layer.pop(k) for k in ("layer_types", "sliding_window", "use_sliding_window")],
         "dflash.sliding_window_served", "served 2 full-attention layers"),
        ("partial", lambda layer: layer["rope_parameters"].update(partial_rotary_factor=0.25),
         "dflash.rope_served_as_trained", "partial_rotary_factor 0.25 served, 1.0 trained"),
    ]:
        broken = tmp_path / name / "export"
        broken.mkdir(parents=True)
        (broken / "model.safetensors").symlink_to(out / "model.safetensors")
        config = json.loads((out / "config.json").read_text())
        edit(config["transformer_layer_config"])
        (broken / "config.json").write_text(json.dumps(config))
        finding = diagnose(broken, target)[invariant]
        assert finding["status"] == "mismatch" and says in finding["observed"], finding
    # the partial factor is the target's own (0.25 in its config): the finding says where it came from
    assert any("is the target's own" in note for note in finding["notes"])
