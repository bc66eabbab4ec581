"""DSpark in the trainer: its config, slot rule, Markov token rule, loss (against a plain reference), the
`dspark-tiny` preset end to end (train, lossless decoding with B proposals, export), in seconds on a CPU.
Parity with speculators 0.9.0 itself is in tests/parity/test_dspark_parity.py and test_dspark_export.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer.config import PRESETS, ConfigError, build_config
from trainer.model.dspark import MarkovHead, training_prev_ids
from trainer.model.dspark_loss import dspark_loss, dspark_slot_weights
from trainer.model.loss import BlockTeacher, LogitsHead

REPO = Path(__file__).resolve().parents[2]


# --- config ----------------------------------------------------------------------------------------------------


def test_a_dspark_run_saves_speculators_defaults_and_a_dflash_run_none():
    config = build_config(overrides=["drafter_kind=dspark"])
    # speculators 0.9.0 models/dspark/config.py and core.py get_trainer_kwargs (confidence_head_alpha 1.0)
    assert config.dspark.model_dump() == {
        "sample_from_anchor": True, "markov_rank": 256, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True, "confidence_head_alpha": 1.0,
        "draft_confidence_min": None,  # ours: a decoding-time threshold, off
    }
    plain = build_config()
    assert plain.drafter_kind == "dflash" and plain.dspark is None


@pytest.mark.parametrize(("overrides", "message"), [
    (["drafter_kind=dflash2", "dspark.markov_rank=8"], "dspark settings are given but drafter_kind is 'dflash2'"),
    (["drafter_kind=dspark", "dspark.markov_rank=0"], "confidence_head_with_markov requires dspark.markov_rank > 0"),
    (["dspark.markov_rank=8"], "drafter_kind is 'dflash'"),
    (["drafter_kind=dspark", "dspark.markov_head_type=lstm"], "dspark.markov_head_type"),
    (["drafter_kind=dspark", "loss_weighting=dpace"], "loss_weighting 'decay' only"),
    (["drafter_kind=dspark", "parallelism=fsdp2"], "fsdp2 is not implemented"),
    (["drafter_kind=dspark", "draft_vocab_size=64"], "full vocabulary"),
    (["drafter_kind=dspark", "dspark.with_markov=true"], "unknown config key 'dspark.with_markov'"),
    (["drafter_kind=dspark", "dspark.enable_confidence_head=false", "dspark.draft_confidence_min=0.5"],
     "draft_confidence_min needs the confidence head"),
])
def test_bad_dspark_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as error:
        build_config(overrides=overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_cli_refuses_another_kinds_dspark_section_in_one_line_with_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "trainer.cli", "run", "x", "--runs-dir", str(tmp_path),
                             "--set", "drafter_kind=dflash2", "--set", "dspark.markov_rank=8"], cwd=REPO,
                            capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert "dspark settings" in result.stderr and len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_the_preset_mirrors_deepspec_at_tiny_size():
    config = build_config(preset="dspark-tiny")
    assert (config.drafter_kind, config.block_size, config.draft_layers, config.loss_decay_gamma) == ("dspark", 7, 5, 4.0)
    assert config.dspark.sample_from_anchor and config.dspark.confidence_head_alpha == 1.0
    assert config.resolved_layer_ids(36) == [1, 9, 17, 25, 33]  # DeepSpec's layers on Qwen3-4B
    assert "dspark-tiny" in PRESETS


# --- slot and token rules, against Python loops ----------------------------------------------------------------


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_slot_weights_and_markov_tokens_follow_the_rule(sample_from_anchor):
    g = torch.Generator().manual_seed(0)
    S, B, gamma = 30, 4, 4.0
    input_ids = torch.randint(0, 50, (2, S), generator=g)
    loss_mask = (torch.rand(2, S, generator=g) < 0.7).long()
    doc_ids = torch.zeros(2, S, dtype=torch.long)
    doc_ids[:, 15:] = 1
    doc_ids[1, 27:] = -1
    anchors = torch.tensor([[2, 12, 20, 25], [0, 13, 14, 22]])
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    weights = dspark_slot_weights(anchors, valid, loss_mask, doc_ids, B, gamma, sample_from_anchor)
    prev = training_prev_ids(input_ids, anchors, B, sample_from_anchor)
    offset = 1 if sample_from_anchor else 0
    for n in range(2):
        for i in range(4):
            a = int(anchors[n, i])
            for k in range(B):
                label = a + k + offset
                ok = (bool(valid[n, i]) and label < S and bool(loss_mask[n, label])
                      and int(doc_ids[n, label]) == int(doc_ids[n, a]))
                decay = math.exp(-k / gamma) if sample_from_anchor else (0.0 if k == 0 else math.exp(-(k - 1) / gamma))
                assert float(weights[n, i, k]) == pytest.approx(decay if ok else 0.0)
                # the token right before the label; slot 0 without anchor sampling takes the anchor
                assert int(prev[n, i, k]) == int(input_ids[n, max(label - 1, a)])


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_decoding_one_slot_at_a_time_equals_the_training_forward(head_type):
    torch.manual_seed(0)
    head = MarkovHead(40, 40, 6, 8, head_type)
    prev = torch.randint(0, 40, (3, 5))
    hidden = torch.randn(3, 5, 8)
    batched = head.features(head.prev_embeddings(prev), hidden)
    state, steps = None, []
    for k in range(5):
        features, state = head.step(head.prev_embeddings(prev[:, k]), hidden[:, k], state)
        steps.append(features)
    torch.testing.assert_close(torch.stack(steps, dim=1), batched)


# --- the loss, against a plain reference ----------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "sample_from_anchor"), [("kl", True), ("ce", True), ("kl", False)])
def test_loss_and_gradients_equal_a_plain_reference(kind, sample_from_anchor):
    g = torch.Generator().manual_seed(1)
    N, A, B, H, V, r, S = 2, 3, 4, 8, 20, 5, 24
    hidden = torch.randn(N * A * B, H, generator=g, requires_grad=True)
    markov = torch.randn(N * A * B, r, generator=g, requires_grad=True)
    w2 = torch.randn(V, r, generator=g, requires_grad=True)
    conf = torch.randn(N * A * B, generator=g, requires_grad=True)
    head_weight = torch.randn(V, H, generator=g)
    teacher_hidden = torch.randn(N * S, H, generator=g)
    teacher_weight = torch.randn(V, H, generator=g)
    rows = torch.randint(0, N * S, (N * A * B,), generator=g)
    for n in range(N):  # each slot learns from its own packed row
        rows[n * A * B:(n + 1) * A * B] = rows[n * A * B:(n + 1) * A * B] % S + n * S
    weights = torch.rand(N, A, B, generator=g) * (torch.rand(N, A, B, generator=g) < 0.8)
    alpha = 0.7

    result = dspark_loss(hidden, LogitsHead(head_weight), markov, w2, conf,
                         BlockTeacher(teacher_hidden, LogitsHead(teacher_weight), rows), weights, kind, alpha,
                         sample_from_anchor, chunk_size=B)  # one block per chunk
    ours = torch.autograd.grad(result.loss, (hidden, markov, w2, conf))

    logits = hidden @ head_weight.T + markov @ w2.T  # [M, V] the post-Markov logits
    teacher = teacher_hidden[rows] @ teacher_weight.T
    if kind == "kl":
        target_p = teacher.softmax(-1)
        per_slot = (target_p * (target_p.log() - logits.log_softmax(-1))).sum(-1)
    else:
        per_slot = F.cross_entropy(logits, teacher.argmax(-1), reduction="none")
    rate = torch.minimum(logits.softmax(-1), teacher.softmax(-1)).sum(-1).detach()
    bce = F.binary_cross_entropy_with_logits(conf, rate, reduction="none")
    w = weights.flatten(1)
    count = (w > 0).sum(1).float()
    main = ((per_slot.view(N, -1) * w).sum(1) / (count + 1e-5)).mean()
    confidence = ((bce.view(N, -1) * w).sum(1) / (count + 1e-8)).mean()
    reference = main + alpha * confidence
    expected = torch.autograd.grad(reference, (hidden, markov, w2, conf))

    assert float(result.loss.detach()) == pytest.approx(float(reference.detach()), rel=1e-5)
    assert float(result.confidence.detach()) == pytest.approx(float(confidence.detach()), rel=1e-5)
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(result.accept_rate.flatten()[w.flatten() > 0], rate[w.flatten() > 0])


# --- the preset, end to end -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dspark_run(tmp_path_factory) -> Path:
    from tests.trainer.tiny_targets import save_tiny_qwen3
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir
    from trainer.target.embedded import build_embedded_tokenizer

    root = tmp_path_factory.mktemp("dspark")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = save_tiny_qwen3(root / "target", build_embedded_tokenizer(small=True), layers=6)
        config = build_config(preset="dspark-tiny", extra=dict(
            target=str(target), steps=3, batch_size=2, seq_len=48, max_anchors=4, draft_layers=2,
            eval_every=None, eval_prompts=2, eval_max_new_tokens=12, warmup_steps=0, checkpoint_every=3,
        ))
        run = RunDir(root / "runs" / "dspark-tiny")
        train(run, config, preset="dspark-tiny", device="cpu", progress=False)
    finally:
        torch.set_num_threads(threads)
    return run.path


def test_the_preset_trains_and_decodes_losslessly_with_b_proposals(dspark_run):
    saved = json.loads((dspark_run / "config.json").read_text())
    assert saved["drafter_kind"] == "dspark" and saved["dspark"]["markov_rank"] == 16
    rows = [json.loads(line) for line in (dspark_run / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(row["loss"]) for row in rows) and len(rows[-1]["position_acc"]) == 7  # slot 0 trained
    # DSpark's terms per logged step: loss = main + alpha * confidence (alpha 1.0 in the preset)
    last = rows[-1]
    assert last["loss"] == pytest.approx(last["dspark_main_loss"] + last["dspark_confidence_loss"], rel=1e-5)
    assert 0.0 < last["dspark_accept_rate"] <= 1.0
    report = json.loads((dspark_run / "eval.json").read_text())
    assert report["lossless"] is True and report["tau"] >= 1.0
    # sample_from_anchor: 7 drafts per verify step, so an acceptance length of up to 8
    assert len(report["acceptance_histogram"]) == 8 and len(report["per_position_acceptance"]) == 7


def test_the_proposer_drafts_the_markov_chain_of_its_own_tokens(dspark_run):
    # Decoding feeds slot k the token drafted at k-1; the training forward given those tokens as prev must
    # pick the same tokens (the two paths of trainer/model/dspark.py agree on `dspark.markov_prev_token`).
    from transformers import DynamicCache

    from trainer.run.loop import load_run

    loaded = load_run(dspark_run, "cpu")
    proposer, drafter = loaded.proposer(), loaded.drafter
    assert proposer.num_proposals(7) == 7
    g = torch.Generator().manual_seed(5)
    context, B = 10, 7
    features = torch.randn(1, context, len(loaded.feature_layer_ids) * loaded.target.hidden_size, generator=g)
    block = torch.full((1, B), drafter.mask_token_id)
    block[0, 0] = 7
    positions = torch.arange(context + B)[None]
    with torch.no_grad():
        logits = proposer.propose(block, features, positions, DynamicCache())[0]  # [7, V]
        drafted = logits.argmax(-1)
        hidden = drafter(loaded.target.embed(block), features, positions)
        prev = torch.cat([block[0, :1], drafted[:-1]])[None]  # prev_0 = anchor, prev_k = drafted at k-1
        markov, _ = drafter.heads(hidden, prev)
        replay = loaded.target.logits(hidden)[0] + drafter.markov_head.markov_w2(markov)[0]
    torch.testing.assert_close(replay, logits, rtol=1e-5, atol=1e-5)


def test_export_writes_speculators_dspark_and_refuses_zlab(dspark_run, tmp_path):
    from trainer.export import ExportError, export_run

    with pytest.raises(ExportError, match="--format speculators"):
        export_run(dspark_run, tmp_path / "zlab", "zlab")
    result = export_run(dspark_run, tmp_path / "spec", "speculators")
    config = result.config
    assert config["speculators_model_type"] == "dspark" and config["speculators_config"]["algorithm"] == "dspark"
    assert config["sample_from_anchor"] is True
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    assert (config["markov_rank"], config["markov_head_type"]) == (16, "vanilla")
    assert config["enable_confidence_head"] and config["confidence_head_with_markov"]


def test_confidence_scheduled_drafting_stops_where_the_predicted_prefix_falls_below_the_threshold(dspark_run):
    from transformers import DynamicCache

    from trainer.eval.dspark import DSparkProposer
    from trainer.eval.speculative import evaluate
    from trainer.run.loop import load_run

    loaded = load_run(dspark_run, "cpu")
    drafter, target = loaded.drafter, loaded.target
    g = torch.Generator().manual_seed(6)
    context, B = 10, 7
    features = torch.randn(1, context, len(loaded.feature_layer_ids) * target.hidden_size, generator=g)
    block = torch.full((1, B), drafter.mask_token_id)
    block[0, 0] = 9
    positions = torch.arange(context + B)[None]

    def propose(confidence_min):
        return DSparkProposer(drafter, target, confidence_min=confidence_min).propose(block, features, positions,
                                                                                      DynamicCache())[0]

    full = propose(None)
    with torch.no_grad():  # the confidence head on the drafted chain, as the training forward computes it
        hidden = drafter(target.embed(block), features, positions)
        prev = torch.cat([block[0, :1], full.argmax(-1)[:-1]])[None]
        _, confidence = drafter.heads(hidden, prev)
    prefix = torch.sigmoid(confidence[0]).cumprod(0)  # [7] predicted chance that slots 0..k are all accepted
    assert bool((prefix[1:] < prefix[:-1]).all())
    threshold = float(prefix[2] + prefix[3]) / 2
    torch.testing.assert_close(propose(threshold), full[:3])  # fewer drafts, never different ones
    torch.testing.assert_close(propose(1e-12), full)
    assert propose(1.0).shape[0] == 1  # one slot always drafts

    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    report = evaluate(DSparkProposer(drafter, target, confidence_min=1.0), target, prompts,
                      feature_layer_ids=loaded.feature_layer_ids, block_size=B, max_new_tokens=10,
                      measure_speedup=False, check_lossless=True)
    assert report.lossless is True and sum(report.acceptance_histogram[2:]) == 0  # one draft + bonus at most


def test_trainer_eval_reads_the_export_as_it_decodes_the_run(dspark_run, tmp_path):
    # `trainer eval DIR --target` on the speculators export: same drafter, same heads, so the same decoding.
    from trainer.eval.foreign import evaluate_drafters
    from trainer.export import export_run

    export_run(dspark_run, tmp_path / "spec", "speculators")
    target = json.loads((dspark_run / "config.json").read_text())["target"]
    exported, own = evaluate_drafters([tmp_path / "spec", dspark_run], target, prompts=2, max_new_tokens=12,
                                      block_size=None, temperature=0.0, data="embedded", seed=0, device="cpu")
    assert (exported["layout"], own["layout"]) == ("speculators", "run")
    for key in ("tau", "acceptance_histogram", "per_position_acceptance", "output_tokens", "verify_steps"):
        assert exported[key] == own[key], key
    assert exported["lossless"] is True and len(exported["acceptance_histogram"]) == 8
