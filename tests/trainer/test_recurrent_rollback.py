"""Real decoding on recurrent-state targets: after a rejected verify block the target is where greedy decoding
would be, on every family of tests/trainer/tiny_targets.py that keeps a recurrent state.

A crop restores attention K/V but not a recurrent state (Gated DeltaNet, Kimi Delta Attention, Mamba-2,
lightning attention): the state has read all B block tokens. The tiny targets decay their state slowly
(SLOW_DECAY_A), as trained heads do, so a state left a few tokens ahead shows in the next logits. References
recompute everything without a cache: the target's logits and hidden states on the whole sequence.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from tests.trainer.tiny_targets import RECURRENT_FAMILIES, save_family_target
from trainer.eval.speculative import speculative_generate
from trainer.target.frozen import FrozenTarget

FEATURE_LAYER_IDS = [0, 2]  # of the 4 layers: a linear-attention layer and a full-attention one
BLOCK = 4
PROMPT_LENGTH = 12
# float32: a cached forward (recurrent steps, chunked kernels) against one uncached pass differs by summation
# order only: measured at most 1.8e-7 on the next logits and 7.2e-7 on the context features over these
# families; the crop-only rollback this replaced left the next logits 1.7e-5 (granitemoehybrid) to 0.06
# (kimi_linear) off.
ATOL = 2e-6
ATTENTION_ONLY = ("qwen3", "gemma2")  # full attention / sliding windows: a crop alone is exact


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    from trainer.target.embedded import build_embedded_tokenizer

    tokenizer = build_embedded_tokenizer(small=True)
    loaded: dict[str, FrozenTarget] = {}

    def load(family: str) -> FrozenTarget:
        if family not in loaded:
            path = save_family_target(family, tmp_path_factory.mktemp(family), tokenizer)
            loaded[family] = FrozenTarget.load(str(path), torch.device("cpu"))
        return loaded[family]

    return load


def prompt_ids(target: FrozenTarget, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, target.vocab_size - 10, (PROMPT_LENGTH,), generator=generator).tolist()


@torch.no_grad()
def uncached(target: FrozenTarget, tokens: list[int]):
    return target.model(input_ids=torch.tensor([tokens]), output_hidden_states=True, use_cache=False)


@torch.no_grad()
def naive_greedy(target: FrozenTarget, prompt: list[int], n_new: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(n_new):
        sequence.append(int(uncached(target, sequence).logits[0, -1].argmax()))
    return sequence[len(prompt):]


def records_states_per_position() -> bool:
    """transformers >= 5.25 can keep a linear-attention layer's state after each position (activate_past_recording's
    recurrent_states_to_keep); 5.24 cannot, and every recurrent rollback there is a replay."""
    from transformers.cache_utils import LinearAttentionLayer

    return "recurrent_states_to_keep" in inspect.signature(LinearAttentionLayer.activate_past_recording).parameters


# State kept outside the per-layer cache entries (MiniMax's lightning attention): no recorded history can restore it.
STATE_OUTSIDE_LAYERS = ("minimax",)


@pytest.mark.parametrize("recorded", [True, False], ids=["block-recorded", "replay-forced"])
@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES) + list(ATTENTION_ONLY))
@torch.no_grad()
def test_a_rejected_block_leaves_the_target_at_the_committed_tokens(targets, family, recorded):
    """Prefill, verify a block, keep 1..B of it, decode one more token: the logits are those of the committed
    sequence run without a cache, for every kept length (B: the whole block accepted, no rollback). Both exact ways
    back: the cache's own per-position states (asked for the whole block), and the saved state plus a replay (a
    cache asked to record fewer positions than the pass feeds cannot restore from its records)."""
    from trainer.eval.target_cache import TargetCache

    target = targets(family)
    prompt = prompt_ids(target)
    block = prompt_ids(target, seed=1)[:BLOCK]
    recurrent = family in RECURRENT_FAMILIES
    from_history = recurrent and recorded and records_states_per_position() and family not in STATE_OUTSIDE_LAYERS
    for kept in range(1, BLOCK + 1):
        cache = TargetCache(target.model, verify_tokens=BLOCK if recorded else 1)
        cache.forward(torch.tensor([prompt]))
        cache.begin_verify(tokens=BLOCK)
        cache.forward(torch.tensor([block]))
        cache.commit(torch.tensor([block]), PROMPT_LENGTH, kept)
        assert cache.length == PROMPT_LENGTH + kept
        committed = prompt + block[:kept]
        next_token = 7
        got = cache.forward(torch.tensor([[next_token]])).logits[0, -1]
        expected = uncached(target, committed + [next_token]).logits[0, -1]
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL, msg=f"{family}, {kept} of {BLOCK} kept")
        expected_rollback = "crop" if not recurrent else "state_history" if from_history else "state_replay"
        assert cache.rollback == expected_rollback
        assert cache.replays == (1 if recurrent and not from_history and kept < BLOCK else 0)


class OracleProposer:
    """Drafts the target's greedy continuation with the first `correct(start)` slots right and the rest wrong,
    so acceptance varies step by step over every length; records the context each step hands the drafter."""

    def __init__(self, sequence: list[int], vocab_size: int) -> None:
        self.sequence = sequence
        self.vocab_size = vocab_size
        self.contexts: list[tuple[list[int], torch.Tensor]] = []  # (context positions, features [1, C, k*H])

    @staticmethod
    def correct(start: int) -> int:
        return random.Random(start).randrange(BLOCK)

    def propose(self, block_ids, context_features, position_ids, cache):
        start = int(position_ids[0, -BLOCK])
        self.contexts.append((position_ids[0, :-BLOCK].tolist(), context_features.clone()))
        logits = torch.full((1, BLOCK - 1, self.vocab_size), -10.0)
        for slot in range(1, BLOCK):
            token = self.sequence[start + slot]
            if slot > self.correct(start):
                token = (token + 1) % self.vocab_size
            logits[0, slot - 1, token] = 10.0
        return logits


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_speculative_decoding_is_greedy_decoding_token_for_token(targets, family):
    """Every acceptance length, many steps: the output is the uncached greedy continuation and every context
    handed to the drafter is the target's own hidden states at those positions (a state left ahead by a
    rejected block would shift both)."""
    target = targets(family)
    prompt = prompt_ids(target)
    max_new = 24
    sequence = prompt + naive_greedy(target, prompt, max_new + BLOCK)
    proposer = OracleProposer(sequence, target.vocab_size)
    result = speculative_generate(proposer, target, prompt, feature_layer_ids=FEATURE_LAYER_IDS, block_size=BLOCK,
                                  max_new_tokens=max_new, stop_token_ids=[])
    assert result.new_tokens == sequence[len(prompt):len(prompt) + max_new]
    assert len(set(result.acceptance_lengths)) == BLOCK  # every rollback length was exercised
    hidden = uncached(target, sequence).hidden_states
    features = torch.cat([hidden[i + 1] for i in FEATURE_LAYER_IDS], dim=-1)[0]  # [S, k*H]
    for positions, context in proposer.contexts:
        torch.testing.assert_close(context[0], features[positions], rtol=0, atol=ATOL)
    if records_states_per_position() and family not in STATE_OUTSIDE_LAYERS:
        # the cache's own per-position states: no forward beyond the verify passes
        assert (result.target_rollback, result.state_replays) == ("state_history", 0)
    else:
        assert result.target_rollback == "state_replay"
        assert result.state_replays == sum(1 for length in result.acceptance_lengths if length < BLOCK)
