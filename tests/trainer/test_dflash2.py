"""DFlash2 (drafter_kind: dflash2) on real tiny targets: its config errors, the convolutions' identity init and
block locality, the selector loss against a per-slot Python loop, greedy decoding through the selector
(against a naive walk, lossless), and the dflash2-tiny preset training end to end.

Parity with speculators 0.9.0 itself is tests/parity/test_dflash2_parity.py (its own venv)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from test_target import CPU, save_tiny_target
from trainer.config import PRESETS, ConfigError, DFlash2Config, build_config
from trainer.model.dflash2 import DFlash2Drafter, GroupedDynamicCausalConv
from trainer.model.dflash2_loss import predecessor_ids, selector_loss
from trainer.model.drafter import DFlashDrafter
from trainer.model.loss import LogitsHead
from trainer.target.embedded import build_embedded_tokenizer
from trainer.target.frozen import FrozenTarget


@pytest.fixture(scope="module")
def tokenizer():
    return build_embedded_tokenizer(small=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer):
    return FrozenTarget.load(str(save_tiny_target(tmp_path_factory.mktemp("tiny"), tokenizer)), CPU)


@pytest.mark.parametrize(("extra", "message"), [
    ({"drafter_kind": "dspark", "dflash2": {"selector_top_k": 4}}, "dflash2 settings are given but drafter_kind is 'dspark'"),
    ({"drafter_kind": "dflash2", "dflash2": {"conv_kernel_size": 9}}, "conv_kernel_size 9 exceeds block_size 8"),
    ({"drafter_kind": "dflash2", "draft_vocab_size": 100}, "needs the full target vocabulary"),
    ({"dflash2": {"selector_top_k": 4}}, "dflash2 settings are given but drafter_kind is 'dflash'"),
    ({"drafter_kind": "dflash2", "loss_weighting": "dpace"}, "loss_weighting 'decay'"),
    ({"drafter_kind": "dflash2", "parallelism": "fsdp2"}, "use parallelism 'ddp'"),
    ({"drafter_kind": "dflash2", "dflash2": {"selector_rank": True}}, "not a boolean"),
    ({"drafter_kind": "dflash2", "dflash2": {"top_k": 4}}, "unknown config key 'dflash2.top_k'"),
])
def test_bad_dflash2_configs_are_one_line_errors(extra, message):
    with pytest.raises(ConfigError) as error:
        build_config(extra=extra)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(("settings", "message"), [
    ({"conv_group_size": 24}, "conv_group_size 24 does not divide the hidden size 32"),
    ({"selector_top_k": 4000}, "selector_top_k 4000 exceeds the vocabulary"),
])
def test_shapes_that_need_the_target_fail_when_the_drafter_is_built(target, settings, message):
    with pytest.raises(ConfigError, match=message):
        DFlash2Drafter.from_target_config(target.model.config, 1, 2, 4, 0, dflash2=DFlash2Config(**settings))


def test_set_reaches_the_dflash2_section_and_the_defaults_are_dflash():
    config = build_config(preset="dflash2-tiny", overrides=["dflash2.selector_top_k=4"])
    assert config.dflash2.selector_top_k == 4 and config.dflash2.selector_rank == 32  # the preset's rank kept
    assert config.drafter_kind == "dflash2"
    assert build_config().drafter_kind == "dflash" and build_config().dflash2 == DFlash2Config()
    # the preset as plain DFlash: its dflash2 section cleared
    plain = build_config(preset="dflash2-tiny", overrides=["drafter_kind=dflash", "dflash2=null"])
    assert plain.drafter_kind == "dflash" and plain.dflash2 == DFlash2Config()


def test_conv_is_identity_at_init_and_never_crosses_a_block():
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(32, block_size=4, kernel_size=3, group_size=8)
    x = torch.randn(2, 12, 32)
    prepared, taps = conv.prepare(x)
    assert torch.equal(prepared, x) and torch.equal(conv.finish(x, taps), x)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    before, _ = conv.prepare(x)
    bumped = x.clone()
    bumped[:, 4:8] += 5.0  # block 1 only
    after, _ = conv.prepare(bumped)
    assert torch.equal(after[:, :4], before[:, :4]) and torch.equal(after[:, 8:], before[:, 8:])
    assert (after[:, 4:8] - before[:, 4:8]).abs().max() > 0.1
    # a naive per-position sum over taps, inside the block only
    delta = conv.kernel_projection(x).view(2, 12, 2, 3, 4)[:, :, 0]  # [N, Q, k, G]
    expected = torch.zeros_like(x)
    for i in range(12):
        for t in range(3):
            if i % 4 >= t:
                coefficient = conv.base_kernel[0, t] + delta[:, i, t].repeat_interleave(8, dim=-1)
                expected[:, i] += coefficient * x[:, i - t]
    torch.testing.assert_close(before, expected)


def test_a_fresh_dflash2_drafter_drafts_exactly_what_dflash_does(target):
    # Composition, not a copy: with DFlash's weights in DFlash2's layers and the convolutions at identity,
    # the hidden states are DFlash's to the bit.
    torch.manual_seed(0)
    dflash = DFlashDrafter.from_target_config(target.model.config, 2, 2, 4, 5)
    dflash2 = DFlash2Drafter.from_target_config(target.model.config, 2, 2, 4, 5,
                                                dflash2=DFlash2Config(conv_group_size=8, selector_top_k=4))
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing)
    embeds, features = torch.randn(1, 8, 32), torch.randn(1, 10, 64)
    positions = torch.arange(18)[None]
    with torch.no_grad():
        assert torch.equal(dflash2(embeds, features, positions), dflash(embeds, features, positions))


def test_selector_loss_matches_a_per_slot_loop():
    torch.manual_seed(1)
    from trainer.model.dflash2 import CandidateSelector

    n, a, b, hidden, vocab, k = 2, 3, 4, 16, 40, 5
    selector = CandidateSelector(vocab, hidden, rank=6, top_k=k, initializer_range=0.5)
    head = LogitsHead(torch.randn(vocab, hidden))
    draft = torch.randn(n * a * b, hidden, requires_grad=True)
    input_ids = torch.randint(0, vocab, (n, 30))
    anchors = torch.tensor([[2, 9, 20], [0, 5, 14]])
    weights = torch.rand(n, a, b) * (torch.rand(n, a, b) > 0.3)
    weights[:, :, 0] = 0.0
    gold = torch.randint(0, vocab, (n, a, b))
    gold[0, 0, 1] = head(draft[1].detach()).argmax()  # one gold surely in the top-K, ...
    gold[0, 0, 2] = head(draft[2].detach()).argmin()  # ... one surely not (injected at rank K)
    weights[0, 0, 1:3] = 0.7
    got = selector_loss(draft, head, selector, predecessor_ids(input_ids, anchors, b), gold, weights, chunk_size=4)

    rows = []
    for row in range(n):
        total, count = 0.0, 0
        for anchor in range(a):
            for slot in range(b):
                w = float(weights[row, anchor, slot])
                if w <= 0:
                    continue
                m = (row * a + anchor) * b + slot
                logits = head(draft[m])
                candidates = logits.topk(k).indices.tolist()
                target = int(gold[row, anchor, slot])
                if target not in candidates:
                    candidates[-1] = target
                previous = int(input_ids[row, anchors[row, anchor] + slot - 1])  # x[a+k-1]
                context = selector.predecessor_codebook[previous] * selector.hidden_projection(draft[m])
                scores = torch.stack([logits[c] + (context * selector.successor_codebook[c]).sum() for c in candidates])
                total = total + w * F.cross_entropy(scores[None], torch.tensor([candidates.index(target)]))
                count += 1
        rows.append(total / (count + 1e-5))
    expected = torch.stack(rows).mean()
    torch.testing.assert_close(got.loss, expected)
    grad_got, = torch.autograd.grad(got.loss, draft, retain_graph=True)
    grad_expected, = torch.autograd.grad(expected, draft)
    torch.testing.assert_close(grad_got, grad_expected)
    assert bool(got.gold_in_top_k[0, 0, 1]) and not bool(got.gold_in_top_k[0, 0, 2])


def test_greedy_proposals_walk_the_selector_from_the_anchor(target):
    from transformers import DynamicCache

    from trainer.eval.speculative import DFlash2Proposer, proposer_for

    torch.manual_seed(2)
    drafter = DFlash2Drafter.from_target_config(target.model.config, 1, 2, 4, 5,
                                                dflash2=DFlash2Config(conv_group_size=8, selector_top_k=6,
                                                                      selector_rank=8)).eval()
    with torch.no_grad():
        for codebook in (drafter.candidate_selector.predecessor_codebook, drafter.candidate_selector.successor_codebook):
            codebook.normal_(std=2.0)  # strong enough that the selector overrules the unary argmax somewhere
    proposer = proposer_for(drafter, target)
    assert isinstance(proposer, DFlash2Proposer)
    block = torch.tensor([[17, 5, 5, 5]])
    features = torch.randn(1, 6, 64)
    positions = torch.arange(10)[None]
    with torch.no_grad():
        proposal = proposer.propose(block, features, positions, DynamicCache())[0]  # [3, V]
        hidden = drafter(target.embed(block), features, positions)[0, 1:]
        unary = target.logits(hidden)
    previous, walk = 17, []
    for slot in range(3):
        candidates = unary[slot].topk(6).indices
        with torch.no_grad():
            transition = drafter.candidate_selector.transition_scores(hidden[slot:slot + 1], torch.tensor([previous]),
                                                                      candidates[None])[0]
        previous = int(candidates[(unary[slot, candidates] + transition).argmax()])
        walk.append(previous)
    assert proposal.argmax(dim=-1).tolist() == walk
    assert walk != unary.argmax(dim=-1).tolist(), "the selector changed nothing: the test would pass for DFlash"
    assert torch.isinf(proposal).sum(dim=-1).tolist() == [unary.shape[-1] - 6] * 3


@pytest.fixture(scope="module")
def preset_run(tmp_path_factory, tokenizer):
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir

    root = tmp_path_factory.mktemp("dflash2-run")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = build_config(preset="dflash2-tiny", extra=dict(
            target=str(save_tiny_target(root / "target", tokenizer)), steps=2, batch_size=2, seq_len=48,
            max_anchors=3, draft_layers=2, eval_every=None, eval_prompts=2, eval_max_new_tokens=12, warmup_steps=0,
            draft_config={"layer_types": ["sliding_attention"] * 2, "sliding_window": 16,
                          "sliding_window_non_causal": True},
        ))
        run = RunDir(root / "runs" / "d2")
        result = train(run, config, preset="dflash2-tiny", device="cpu", progress=False)
    finally:
        torch.set_num_threads(threads)
    assert result.steps_done == 2
    return run.path


def test_the_preset_trains_decodes_losslessly_and_reports_tau(preset_run):
    saved = json.loads((preset_run / "config.json").read_text())
    assert saved["drafter_kind"] == "dflash2" and saved["dflash2"] == PRESETS["dflash2-tiny"]["dflash2"]
    rows = [json.loads(line) for line in (preset_run / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    alpha = PRESETS["dflash2-tiny"]["dflash2"]["selector_loss_alpha"]
    for row in rows:  # the total is the unary term plus alpha times the selector's, as logged
        assert row["loss"] == pytest.approx(row["unary_loss"] + alpha * row["selector_loss"], rel=1e-4)
    report = json.loads((preset_run / "eval.json").read_text())
    assert report["lossless"] is True and report["tau"] >= 1.0 and report["verify_steps"] > 0
    assert report.get("teacher_forced") is None  # the unary replay does not describe the selector's proposals
    from safetensors.torch import load_file

    from trainer.run.checkpoint import DRAFTER_FILE, latest_checkpoint

    weights = load_file(str(latest_checkpoint(preset_run / "checkpoints").path / DRAFTER_FILE))
    assert {"candidate_selector.predecessor_codebook", "layers.0.attention_conv.base_kernel"} <= set(weights)


def test_both_exports_decode_exactly_as_the_run(preset_run, tmp_path):
    # `trainer eval DIR --target` on each export builds a DFlash2 drafter from its config alone (speculators'
    # flat fields; z-lab's dflash_config, architectures and is_causal) and decodes token for token as the run.
    from trainer.eval.foreign import evaluate_drafters
    from trainer.export import ExportError, export_run, load_exported_drafter

    flat, nested = tmp_path / "speculators", tmp_path / "zlab"
    export_run(preset_run, flat, "speculators")
    export_run(preset_run, nested, "zlab")
    assert json.loads((nested / "config.json").read_text())["dflash_config"]["selector_rank"] == 32
    target = str(preset_run.parent.parent / "target")
    results = evaluate_drafters([flat, nested, preset_run], target, prompts=2, max_new_tokens=12, block_size=None,
                                temperature=0.0, data="embedded", seed=0, device="cpu")
    assert [r["layout"] for r in results] == ["speculators", "zlab", "run"]
    for key in ("tau", "acceptance_histogram", "output_tokens", "verify_steps"):
        assert results[0][key] == results[1][key] == results[2][key], key
    assert all(r["lossless"] is True for r in results)
    with pytest.raises(ExportError, match="DFlash2 export"):  # the DFlash-only reloader must not drop the convs
        load_exported_drafter(nested)


def test_dflash2_decodes_greedily_only(preset_run):
    from trainer.data.datasets import heldout_prompts
    from trainer.eval.speculative import EvalError, speculative_generate
    from trainer.run.loop import load_run

    loaded = load_run(preset_run, "cpu")
    prompt = heldout_prompts("embedded", loaded.target.tokenizer, 1)[0]
    with pytest.raises(EvalError, match="greedily only"):
        speculative_generate(loaded.drafter, loaded.target, prompt, feature_layer_ids=loaded.feature_layer_ids,
                             block_size=8, max_new_tokens=4, temperature=0.7)
    with pytest.raises(EvalError, match="drafts blocks of 8"):
        speculative_generate(loaded.drafter, loaded.target, prompt, feature_layer_ids=loaded.feature_layer_ids,
                             block_size=4, max_new_tokens=4)
