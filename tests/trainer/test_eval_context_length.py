"""Real decoding with a sliding-window drafter: every draft equals the training-mask forward of the same block
(the window applied over the drafter's cache as in training), and the report splits acceptance at the window."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.trainer.test_eval import FEATURE_LAYER_IDS, MASK_ID, PROMPTS, VOCAB, OracleProposer, make_target, naive_greedy
from trainer.eval.context_length import acceptance_by_context_length
from trainer.eval.speculative import DFlashProposer, evaluate, speculative_generate
from trainer.model.attention_mask import build_attention_mask
from trainer.model.drafter import DFlashDrafter

WINDOW, BLOCK = 4, 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         initializer_range=0.3, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-qwen3")
    Qwen3ForCausalLM(config).save_pretrained(path)
    return make_target(path)


def sliding_drafter(target, non_causal=False):
    torch.manual_seed(3)
    shape = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW,
             "sliding_window_non_causal": non_causal}
    return DFlashDrafter.from_target_config(target.model.config, 2, len(FEATURE_LAYER_IDS), BLOCK, MASK_ID,
                                            shape=shape).eval()


def test_acceptance_by_context_length_is_a_hand_count():
    contexts = [2, 4, 5, 8, 9, 20]
    lengths = [3, 1, 2, 3, 1, 2]
    report = acceptance_by_context_length(contexts, lengths, block_size=3, sliding_window=4)
    spans = [(b.min_context, b.max_context, b.verify_steps, b.beyond_window) for b in report.buckets]
    assert spans == [(0, 4, 2, False), (5, 8, 2, True), (9, 16, 1, True), (17, 32, 1, True)]
    assert report.buckets[0].tau == 2.0 and report.buckets[0].per_position_acceptance == [0.5, 0.5]
    assert report.buckets[1].per_position_acceptance == [1.0, 0.5]
    assert (report.tau_within_window, report.tau_beyond_window, report.verify_steps_beyond_window) == (2.0, 2.0, 4)
    no_window = acceptance_by_context_length(contexts, lengths, block_size=3, sliding_window=None)
    assert [b.max_context for b in no_window.buckets] == [32] and no_window.tau_beyond_window is None


@pytest.mark.parametrize("non_causal", [False, True])
@torch.no_grad()
def test_every_served_draft_is_the_training_forward_of_its_block(target, non_causal):
    drafter = sliding_drafter(target, non_causal)
    prompt = PROMPTS[2]  # 9 tokens: the first block already has more context than the window
    # drafts from the target's own continuation (every block accepted, so decoding goes far), while the real
    # drafter runs on the same cache and inputs and its logits are recorded
    recorder = OracleProposer(prompt + naive_greedy(target, prompt, 40), inner=DFlashProposer(drafter, target))
    result = speculative_generate(recorder, target, prompt, feature_layer_ids=FEATURE_LAYER_IDS, block_size=BLOCK,
                                  max_new_tokens=24, stop_token_ids=[])
    assert result.context_lengths == [start for start, *_ in recorder.calls]
    tokens = prompt + result.new_tokens
    for start, _, _, served in recorder.calls:
        S = start  # the training forward: features of positions 0..start-1, one anchor at start
        features, _ = target.forward_packed(torch.tensor([tokens[:S + 1]]), torch.arange(S + 1)[None],
                                            torch.zeros(1, S + 1, dtype=torch.long), FEATURE_LAYER_IDS, "final")
        block = torch.tensor([[tokens[start]] + [MASK_ID] * (BLOCK - 1)])
        masks = build_attention_mask(torch.tensor([[start]]), torch.tensor([[True]]),
                                     torch.zeros(1, S + 1, dtype=torch.long), BLOCK, False, "cpu",
                                     attention=drafter.attention)
        positions = torch.cat([torch.arange(S + 1), start + torch.arange(BLOCK)])[None]
        hidden = drafter(target.embed(block), features, positions, masks)
        torch.testing.assert_close(served[0], target.logits(hidden[:, 1:])[0], rtol=1e-4, atol=1e-4)
    assert max(start for start, *_ in recorder.calls) > 3 * WINDOW  # decoding ran well past the window


def test_eval_report_splits_acceptance_at_the_window(target):
    drafter = sliding_drafter(target)
    report = evaluate(drafter, target, PROMPTS, feature_layer_ids=FEATURE_LAYER_IDS, block_size=BLOCK,
                      max_new_tokens=20, measure_speedup=False)
    by_context = report.acceptance_by_context_length
    assert by_context.sliding_window == WINDOW and report.lossless is True
    steps = sum(b.verify_steps for b in by_context.buckets)
    assert steps == report.verify_steps and by_context.verify_steps_beyond_window > 0
    pooled = sum(b.tau * b.verify_steps for b in by_context.buckets) / steps
    assert pooled == pytest.approx(report.tau)
    assert by_context.buckets[0].max_context == WINDOW and not by_context.buckets[0].beyond_window


def test_eval_summary_prints_acceptance_by_context_length(target):
    from rich.console import Console

    from trainer.commands.eval import _print_summary

    report = evaluate(sliding_drafter(target), target, PROMPTS[:1], feature_layer_ids=FEATURE_LAYER_IDS,
                      block_size=BLOCK, max_new_tokens=16, measure_speedup=False)
    console = Console(record=True, width=200)
    _print_summary({"run": "r", "step": 1, **report.model_dump()}, console)
    text = console.export_text()
    assert f"acceptance by context length (drafter window {WINDOW}" in text and "(beyond)" in text
