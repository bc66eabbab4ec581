"""`trainer eval --served-as ENGINE`: the drafter's sliding layers built as each engine of
playbooks/serving/engines.yaml builds them, in the same decoding loop.

What the engines themselves compute is shown against their own code in tests/parity/test_served_engines.py
(dflash 0.1.0, SpecForge 0.2.0); here: the window counts, the decoding over the cache against the one-shot
mask, losslessness, and what a run's eval.json records per engine.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from tests.trainer.test_eval import FEATURE_LAYER_IDS, MASK_ID, PROMPTS, OracleProposer, naive_greedy
from tests.trainer.test_eval_context_length import BLOCK, WINDOW, one_thread, sliding_drafter, target  # noqa: F401
from trainer.eval.speculative import DFlashProposer, evaluate, evaluate_served_by_engine, speculative_generate
from trainer.model.attention_mask import decode_window_mask, sdpa_mask
from trainer.model.drafter import DFlashDrafter
from trainer.model.served import ServedAsError, engine_names, served_as


def test_the_table_names_each_engine_and_its_version():
    assert served_as(None).engine == "speculators" and served_as("vLLM").engine == "speculators"
    assert served_as("z-lab").engine == "zlab" and served_as("sglang").window_origin == "query"
    assert served_as("specforge").window_origin == "none"
    assert "0.1.0" in served_as("zlab").version and "0.2.0" in served_as("specforge").version
    assert set(engine_names(emulated_only=True)) == {"speculators", "zlab", "sglang", "specforge"}
    with pytest.raises(ServedAsError, match="only partly documented"):
        served_as("llama.cpp")
    with pytest.raises(ServedAsError, match="unknown serving engine 'trt'"):
        served_as("trt")


def test_a_query_window_leaves_slot_j_w_minus_1_minus_j_context_positions():
    context = 9  # the anchor's position; the window W = 4 is far shorter
    anchored = decode_window_mask(context, BLOCK, WINDOW)[0, 0]  # [B, context + B]
    queried = decode_window_mask(context, BLOCK, WINDOW, window_origin="query")[0, 0]
    for slot in range(BLOCK):
        assert anchored[slot, :context].nonzero().flatten().tolist() == list(range(context - WINDOW, context))
        assert queried[slot, :context].nonzero().flatten().tolist() == list(range(context + slot - WINDOW + 1, context))
        assert queried[slot, context:].nonzero().flatten().tolist() == list(range(slot + 1))  # causal block
    # the two windows agree while the context is at most W - B positions, and differ from one more on
    for short in (WINDOW - BLOCK, WINDOW - BLOCK + 1):
        same = torch.equal(decode_window_mask(short, BLOCK, WINDOW),
                           decode_window_mask(short, BLOCK, WINDOW, window_origin="query"))
        assert same == (short <= WINDOW - BLOCK)


@pytest.mark.parametrize("engine", ["zlab", "specforge"])
@torch.no_grad()
def test_every_draft_served_as_an_engine_is_that_engines_one_shot_mask(target, engine):  # noqa: F811
    drafter = sliding_drafter(target)
    row = served_as(engine)
    prompt = PROMPTS[2]
    recorder = OracleProposer(prompt + naive_greedy(target, prompt, 40),
                              inner=DFlashProposer(drafter, target, served_as=row))
    speculative_generate(recorder, target, prompt, feature_layer_ids=FEATURE_LAYER_IDS, block_size=BLOCK,
                         max_new_tokens=24, stop_token_ids=[])
    tokens = prompt + naive_greedy(target, prompt, 40)
    differs = 0
    for start, _, _, served in recorder.calls:
        features, _ = target.forward_packed(torch.tensor([tokens[:start + 1]]), torch.arange(start + 1)[None],
                                            torch.zeros(1, start + 1, dtype=torch.long), FEATURE_LAYER_IDS, "final")
        block = torch.tensor([[tokens[start]] + [MASK_ID] * (BLOCK - 1)])
        args = (torch.tensor([[start]]), torch.tensor([[True]]), torch.zeros(1, start + 1, dtype=torch.long), BLOCK,
                False)
        # the engine's one-shot mask over the whole context ("none": a full layer's, bidirectional block)
        sliding = (sdpa_mask(*args) if row.window_origin == "none" else
                   sdpa_mask(*args, WINDOW, False, row.window_origin))
        masks = {"full_attention": sdpa_mask(*args), "sliding_attention": sliding}
        positions = torch.cat([torch.arange(start + 1), start + torch.arange(BLOCK)])[None]
        hidden = drafter(target.embed(block), features, positions, masks)
        torch.testing.assert_close(served[0], target.logits(hidden[:, 1:])[0], rtol=1e-4, atol=1e-4)
        trained = drafter(target.embed(block), features, positions,
                          {"full_attention": sdpa_mask(*args), "sliding_attention": sdpa_mask(*args, WINDOW)})
        differs += int((target.logits(trained[:, 1:])[0] - served[0]).abs().max() > 1e-3)
    assert differs > 0  # past the window the engine drafts other logits than training's mask


def test_decoding_as_each_engine_stays_lossless_and_engines_with_one_semantics_agree(target):  # noqa: F811
    drafter = sliding_drafter(target)
    reports = {engine: evaluate(drafter, target, PROMPTS, feature_layer_ids=FEATURE_LAYER_IDS, block_size=BLOCK,
                                max_new_tokens=20, measure_speedup=False, served_as=engine)
               for engine in ("speculators", "zlab", "sglang", "specforge")}
    assert all(r.lossless is True for r in reports.values())
    assert {e: r.served_as for e, r in reports.items()} == {e: e for e in reports}
    assert reports["zlab"].model_dump(exclude={"served_as", "time_per_token_spec_s"}) == \
        reports["sglang"].model_dump(exclude={"served_as", "time_per_token_spec_s"})


def test_a_full_attention_drafter_decodes_alike_whatever_the_engine(target):  # noqa: F811
    torch.manual_seed(3)
    drafter = DFlashDrafter.from_target_config(target.model.config, 2, len(FEATURE_LAYER_IDS), BLOCK, MASK_ID).eval()
    tau = {engine: evaluate(drafter, target, PROMPTS, feature_layer_ids=FEATURE_LAYER_IDS, block_size=BLOCK,
                            max_new_tokens=12, measure_speedup=False, served_as=engine).tau_per_prompt
           for engine in ("speculators", "zlab", "specforge")}
    assert tau["zlab"] == tau["speculators"] == tau["specforge"]
    assert evaluate_served_by_engine(drafter, None, lambda engine: pytest.fail("decoded")) is None


def test_eval_json_decodes_once_per_semantics_and_reports_every_engine(target):  # noqa: F811
    drafter = sliding_drafter(target)

    def decode(engine):
        decoded.append(engine.engine)
        return evaluate(drafter, target, PROMPTS[:1], feature_layer_ids=FEATURE_LAYER_IDS, block_size=BLOCK,
                        max_new_tokens=12, measure_speedup=False, served_as=engine)

    decoded: list[str] = []
    ours = evaluate(drafter, target, PROMPTS[:1], feature_layer_ids=FEATURE_LAYER_IDS, block_size=BLOCK,
                    max_new_tokens=12, measure_speedup=False)
    engines = evaluate_served_by_engine(drafter, ours, decode)
    assert decoded == ["zlab", "specforge"]  # speculators is `ours`; sglang decodes as zlab does
    assert engines["sglang"].same_semantics_as == ["zlab"] and engines["sglang"].tau == engines["zlab"].tau
    assert engines["speculators"].tau == ours.tau and engines["speculators"].serves_as_trained
    assert not engines["zlab"].serves_as_trained and not engines["specforge"].serves_as_trained
    assert all(e.lossless for e in engines.values())


def test_an_unknown_engine_is_one_line_and_exit_2(tmp_path):
    from trainer.cli import app

    result = CliRunner().invoke(app, ["eval", "no-such-run", "--runs-dir", str(tmp_path), "--served-as", "trt"])
    assert result.exit_code == 2
    expected = "--served-as: unknown serving engine 'trt'; choose from speculators, zlab, sglang, specforge"
    assert expected in result.output
    assert "Traceback" not in result.output


def test_a_runs_eval_json_and_export_carry_every_engine_and_sleuth_flags_the_one_named(tmp_path):
    """The issue's structure (`--preset zlab-qwen3.6`: four sliding layers + one full) on an attention-only target:
    the run's eval.json decodes it as each engine, the export carries those numbers, and `sleuth diagnose
    --served-by` flags z-lab's package and stays silent for vLLM."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.trainer.tiny_targets import save_tiny_qwen3
    from trainer.config import build_config
    from trainer.export import export_run
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir
    from trainer.target.embedded import build_embedded_tokenizer

    target = save_tiny_qwen3(tmp_path / "target", build_embedded_tokenizer(small=True), layers=8)
    config = build_config(preset="zlab-qwen3.6", extra=dict(
        target=str(target), steps=2, batch_size=2, seq_len=64, max_anchors=2, eval_every=None, eval_prompts=1,
        eval_max_new_tokens=8, warmup_steps=0, checkpoint_every=2))
    run = RunDir(tmp_path / "runs" / "r")
    train(run, config, preset=None, device="cpu", progress=False)
    report = json.loads((run.path / "eval.json").read_text())
    engines = report["served_by_engine"]
    assert set(engines) == {"speculators", "zlab", "sglang", "specforge"}
    assert engines["speculators"]["tau"] == report["tau"] and engines["speculators"]["serves_as_trained"]
    assert not engines["zlab"]["serves_as_trained"] and engines["zlab"]["same_semantics_as"] == ["sglang"]
    assert all(row["lossless"] for row in engines.values())
    assert json.loads((run.path / "run.json").read_text())["drafter"]["window_origin"] == "anchor"
    export = export_run(run.path, tmp_path / "export", "zlab").path
    carried = json.loads((export / "config.json").read_text())["dflash_training"]["served_by_engine"]
    assert carried["specforge"]["verify_steps"] == engines["specforge"]["verify_steps"]

    repo = Path(__file__).resolve().parents[2]

    def diagnose(engine: str) -> dict:
        done = subprocess.run(
            [sys.executable, "-m", "sleuth.cli", "diagnose", "--run", str(export), "--target", str(target), "--offline",
             "--no-probe", "--format", "json", "--out", str(tmp_path / f"d-{engine}"), "--served-by", engine],
            cwd=repo, env={**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}, capture_output=True,
            text=True, timeout=600)
        assert done.returncode in (0, 1), done.stderr
        return {f["id"]: f for f in json.loads(done.stdout)["findings"]}["dflash.sliding_window_served"]

    flagged = diagnose("zlab")
    assert flagged["status"] == "mismatch" and "counts the window from each query" in flagged["observed"]
    assert f"tau {engines['zlab']['tau']:.2f} vs {engines['speculators']['tau']:.2f}" in flagged["observed"]
    assert diagnose("vllm")["status"] == "match"
