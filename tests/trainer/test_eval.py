"""The draft-verify loop against naive references: an uncached greedy loop, an uncached speculative loop,
oracle and always-wrong drafters whose acceptance is known in advance, and a Monte Carlo check of the
rejection-sampling rule. The target is a tiny random Qwen3 saved and reloaded through from_pretrained.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config, Qwen3ForCausalLM

from trainer.eval.speculative import (
    EvalError,
    accept_rejection_sampling,
    evaluate,
    greedy_generate,
    speculative_generate,
)
from trainer.model.drafter import DFlashDrafter
from trainer.target.frozen import FrozenTarget

VOCAB = 128
MASK_ID = VOCAB - 1  # a row no test prompt uses
EOS_ID = 3
FEATURE_LAYER_IDS = [0, 2]  # of 4 target layers
PROMPTS = [[5, 17, 42, 8, 99, 23], [11, 2, 77], [64, 65, 66, 67, 68, 69, 70, 71, 9]]


class TinyTokenizer:
    """Just what FrozenTarget reads from a tokenizer."""

    def __init__(self, eos_token_id: int | None = EOS_ID) -> None:
        self.eos_token_id = eos_token_id
        self.pad_token_id = 0
        self.mask_token_id = None

    def __len__(self) -> int:
        return VOCAB - 1


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: a second intra-op thread only adds synchronisation, and on a busy 2-core machine
    spinning threads make every Linear ~7x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
        # Wide logits: a random model at the default 0.02 has near-tied argmaxes that a batched verify
        # and a one-token step may order differently in the last float bit.
        initializer_range=0.3, tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("tiny-qwen3")
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def make_target(path: Path, eos_token_id: int | None = EOS_ID) -> FrozenTarget:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    return FrozenTarget(model, TinyTokenizer(eos_token_id), path, "test", mask_token_id=MASK_ID)


@pytest.fixture(scope="module")
def target(target_dir) -> FrozenTarget:
    return make_target(target_dir)


def make_drafter(target: FrozenTarget, block_size: int, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter.from_target_config(
        target.model.config, num_layers=2, num_features=len(FEATURE_LAYER_IDS), block_size=block_size,
        mask_token_id=MASK_ID,
    )
    return drafter.eval()


# --- naive references ----------------------------------------------------------------------------------


_GREEDY_REFERENCE: dict[tuple[int, ...], list[int]] = {}


@torch.no_grad()
def naive_greedy(target: FrozenTarget, prompt: list[int], n_new: int) -> list[int]:
    """The target's greedy continuation, recomputing the whole sequence for every token.

    Memoised per prompt (every test target has the same weights): a continuation's prefix is the shorter
    continuation, so one 80-token run serves every test on that prompt."""
    key = tuple(prompt)
    sequence = list(prompt) + _GREEDY_REFERENCE.get(key, [])
    while len(sequence) - len(prompt) < n_new:
        logits = target.model(input_ids=torch.tensor([sequence])).logits  # [1, S, V]
        sequence.append(int(logits[0, -1].argmax()))
    _GREEDY_REFERENCE[key] = sequence[len(prompt):]
    return sequence[len(prompt):len(prompt) + n_new]


@torch.no_grad()
def uncached_speculative(proposer, target: FrozenTarget, prompt: list[int], block_size: int, max_new: int):
    """The draft-verify loop with no cache at all: every step reruns the target on the whole sequence and
    the drafter on the whole verified context. Returns (new tokens, acceptance lengths)."""
    model = target.model
    n = len(prompt)
    tokens = list(prompt) + naive_greedy(target, prompt, 1)
    lengths = []
    while len(tokens) - n < max_new:
        start = len(tokens) - 1  # the anchor's position; context is 0..start-1
        hidden = model(input_ids=torch.tensor([tokens[:start]]), output_hidden_states=True).hidden_states
        context = torch.cat([hidden[i + 1] for i in FEATURE_LAYER_IDS], dim=-1)  # [1, start, k*H]
        block = torch.tensor([[tokens[-1]] + [MASK_ID] * (block_size - 1)])
        positions = torch.arange(start + block_size)[None]
        draft = proposer.propose(block, context, positions, DynamicCache())[0].argmax(-1).tolist()
        logits = model(input_ids=torch.tensor([tokens + draft])).logits[0, start:]  # [B, V]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == int(logits[accepted].argmax()):
            accepted += 1
        lengths.append(accepted + 1)
        tokens += (draft[:accepted] + [int(logits[accepted].argmax())])[: max_new - (len(tokens) - n)]
    return tokens[n:], lengths


class OracleProposer:
    """Drafts from a known sequence (the target's greedy continuation): the first `correct(start)` slots
    right, the rest deliberately wrong, so every step's acceptance length is known in advance.
    Optionally runs a real drafter first (same inputs) and records its logits."""

    def __init__(self, sequence: list[int], correct=lambda start: 10**9, inner=None) -> None:
        self.sequence = sequence
        self.correct = correct
        self.inner = inner
        self.calls = []  # (start, context positions, context features, inner logits)

    def propose(self, block_ids, context_features, position_ids, cache):
        block_size = block_ids.shape[1]
        start = int(position_ids[0, -block_size])
        inner = self.inner.propose(block_ids, context_features, position_ids, cache) if self.inner else None
        context_positions = position_ids[0, :-block_size].tolist()
        self.calls.append((start, context_positions, context_features.clone(), inner))
        logits = torch.full((1, block_size - 1, VOCAB), -10.0)
        for slot in range(1, block_size):
            token = self.sequence[start + slot]
            if slot > self.correct(start):
                token = (token + 1) % VOCAB
            logits[0, slot - 1, token] = 10.0
        return logits


def always_wrong(sequence):
    return OracleProposer(sequence, correct=lambda start: 0)


def expected_steps(prompt_len: int, max_new: int, block_size: int, correct) -> list[int]:
    """Acceptance lengths a scripted oracle must produce, by walking positions like a human would."""
    lengths, produced = [], 1  # the prefill makes the first token
    while produced < max_new:
        start = prompt_len + produced - 1
        length = min(correct(start), block_size - 1) + 1
        lengths.append(length)
        produced += length
    return lengths


# --- greedy baseline ---------------------------------------------------------------------------------


def test_greedy_generate_equals_uncached_loop(target):
    for prompt in PROMPTS:
        result = greedy_generate(target, prompt, max_new_tokens=20, stop_token_ids=[])
        assert result.new_tokens == naive_greedy(target, prompt, 20)
        assert result.target_forwards == 20


# --- losslessness and tau ----------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_lossless_at_temperature_zero_with_a_real_drafter(target, block_size):
    drafter = make_drafter(target, block_size)
    report = evaluate(
        drafter, target, PROMPTS, feature_layer_ids=FEATURE_LAYER_IDS, block_size=block_size,
        max_new_tokens=20, stop_token_ids=[], measure_speedup=False,
    )
    assert report.lossless is True and report.lossless_mismatch_prompts == []
    # and against the naive reference, not just against our own greedy loop
    result = speculative_generate(
        drafter, target, PROMPTS[0], feature_layer_ids=FEATURE_LAYER_IDS, block_size=block_size,
        max_new_tokens=20, stop_token_ids=[],
    )
    assert result.new_tokens == naive_greedy(target, PROMPTS[0], 20)


def test_a_wrong_output_is_reported_as_not_lossless(target):
    """The lossless check must be able to fail: a target whose verify passes (and only those) prefer the
    next token id up, so speculative decoding drifts from the plain greedy baseline."""
    real_model = target.model

    class ShiftedVerify(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = real_model
            self.config = real_model.config

        def forward(self, input_ids, cache=None, **kwargs):
            out = self.inner(input_ids=input_ids, cache=cache, **kwargs)
            if input_ids.shape[1] == 4:  # a verify pass of a 4-token block (prompts have other lengths)
                out.logits = out.logits.roll(1, dims=-1)
            return out

    liar = SimpleNamespace(**{**vars(target), "model": ShiftedVerify()})
    sequence = PROMPTS[0] + naive_greedy(target, PROMPTS[0], 20)
    report = evaluate(OracleProposer(sequence), liar, PROMPTS[:2], feature_layer_ids=FEATURE_LAYER_IDS,
                      block_size=4, max_new_tokens=12, stop_token_ids=[], measure_speedup=False)
    assert report.lossless is False
    assert report.lossless_mismatch_prompts == [0, 1]


@pytest.mark.parametrize("block_size,max_new", [(4, 1 + 4 * 4), (6, 15), (2, 8)])
def test_oracle_drafter_reaches_tau_equal_block_size(target, block_size, max_new):
    for prompt in PROMPTS:
        oracle = OracleProposer(prompt + naive_greedy(target, prompt, max_new + block_size))
        report = evaluate(oracle, target, [prompt], feature_layer_ids=FEATURE_LAYER_IDS, block_size=block_size,
                          max_new_tokens=max_new, stop_token_ids=[], measure_speedup=False)
        assert report.tau == block_size
        assert report.per_position_acceptance == [1.0] * (block_size - 1)
        assert report.acceptance_histogram == [0] * (block_size - 1) + [report.verify_steps]
        assert report.verify_steps == -(-(max_new - 1) // block_size)  # ceil: full blocks until the length cut
        assert report.output_tokens == max_new
        assert report.tokens_per_target_forward == max_new / (1 + report.verify_steps)
        assert report.lossless is True


def test_always_wrong_drafter_gives_tau_one_and_still_lossless(target):
    max_new = 15
    for prompt in PROMPTS:
        sequence = prompt + naive_greedy(target, prompt, max_new + 4)
        report = evaluate(always_wrong(sequence), target, [prompt], feature_layer_ids=FEATURE_LAYER_IDS,
                          block_size=4, max_new_tokens=max_new, stop_token_ids=[], measure_speedup=False)
        assert report.tau == 1.0
        assert report.per_position_acceptance == [0.0, 0.0, 0.0]
        assert report.per_position_acceptance_conditional == [0.0, None, None]
        assert report.acceptance_histogram == [max_new - 1, 0, 0, 0]
        assert report.tokens_per_target_forward == 1.0
        assert report.lossless is True


def test_report_statistics_equal_a_hand_count(target):
    """Scripted acceptance lengths across two prompts; the report must equal a plain count of them."""
    block_size, max_new = 5, 30
    correct = lambda start: (start * 7) % 6  # 0..5 correct slots: every length 1..5 occurs  # noqa: E731
    lengths = []
    oracles = []
    for prompt in PROMPTS[:2]:
        sequence = prompt + naive_greedy(target, prompt, max_new + block_size)
        oracles.append(OracleProposer(sequence, correct))
        lengths += expected_steps(len(prompt), max_new, block_size, correct)

    class Sequential:  # switch oracle when the loop starts the second prompt (its prefill resets start)
        def __init__(self):
            self.index, self.last_start = 0, -1

        def propose(self, block_ids, context_features, position_ids, cache):
            start = int(position_ids[0, -block_ids.shape[1]])
            if start < self.last_start:
                self.index += 1
            self.last_start = start
            return oracles[self.index].propose(block_ids, context_features, position_ids, cache)

    report = evaluate(Sequential(), target, PROMPTS[:2], feature_layer_ids=FEATURE_LAYER_IDS,
                      block_size=block_size, max_new_tokens=max_new, stop_token_ids=[], measure_speedup=False)
    assert report.verify_steps == len(lengths)
    assert report.tau == pytest.approx(sum(lengths) / len(lengths))
    assert report.acceptance_histogram == [lengths.count(k) for k in range(1, block_size + 1)]
    for k in range(1, block_size):
        accepted_k = sum(1 for length in lengths if length - 1 >= k)
        reached_k = sum(1 for length in lengths if length - 1 >= k - 1)
        assert report.per_position_acceptance[k - 1] == pytest.approx(accepted_k / len(lengths))
        assert report.per_position_acceptance_conditional[k - 1] == pytest.approx(accepted_k / reached_k)
    assert sum(report.per_position_acceptance) == pytest.approx(report.tau - 1)
    assert report.lossless is True


# --- caches and context ----------------------------------------------------------------------------


def test_cached_loop_equals_uncached_loop_on_a_long_generation(target):
    """A real drafter behind an oracle that accepts a varying number of slots: the target cache is
    cropped at every acceptance length and the drafter's cache grows by 1..B tokens per step. Tokens,
    acceptance lengths and the drafter's own logits must equal a loop that recomputes everything."""
    block_size, max_new = 4, 60
    prompt = PROMPTS[0]
    drafter = make_drafter(target, block_size)
    sequence = prompt + naive_greedy(target, prompt, max_new + block_size)
    correct = lambda start: random.Random(start).randrange(block_size)  # noqa: E731

    from trainer.eval.speculative import DFlashProposer

    cached = OracleProposer(sequence, correct, inner=DFlashProposer(drafter, target))
    result = speculative_generate(cached, target, prompt, feature_layer_ids=FEATURE_LAYER_IDS,
                                  block_size=block_size, max_new_tokens=max_new, stop_token_ids=[])
    uncached = OracleProposer(sequence, correct, inner=DFlashProposer(drafter, target))
    tokens, lengths = uncached_speculative(uncached, target, prompt, block_size, max_new)

    assert result.new_tokens == tokens == sequence[len(prompt):len(prompt) + max_new]
    assert result.acceptance_lengths == lengths == expected_steps(len(prompt), max_new, block_size, correct)
    assert len(set(lengths)) == block_size  # every crop length was exercised
    assert len(cached.calls) == len(uncached.calls)
    for (start_c, _, _, logits_c), (start_u, _, _, logits_u) in zip(cached.calls, uncached.calls):
        assert start_c == start_u
        torch.testing.assert_close(logits_c, logits_u, rtol=1e-4, atol=1e-4)


def test_real_drafter_cached_equals_uncached(target):
    """Without any oracle: the real drafter's own drafts decide acceptance."""
    from trainer.eval.speculative import DFlashProposer

    drafter = make_drafter(target, 3, seed=7)
    prompt = PROMPTS[1]
    result = speculative_generate(drafter, target, prompt, feature_layer_ids=FEATURE_LAYER_IDS,
                                  block_size=3, max_new_tokens=20, stop_token_ids=[])
    tokens, lengths = uncached_speculative(DFlashProposer(drafter, target), target, prompt, 3, 20)
    assert result.new_tokens == tokens
    assert result.acceptance_lengths == lengths


@torch.no_grad()
def test_drafter_context_is_only_verified_tokens_never_the_anchor(target):
    """Each call gets exactly the tokens verified since the previous call, positions strictly before
    the anchor, with the features the target computes for them in a full uncached pass."""
    block_size, max_new = 4, 30
    prompt = PROMPTS[2]
    sequence = prompt + naive_greedy(target, prompt, max_new + block_size)
    proposer = OracleProposer(sequence, correct=lambda start: start % 4)
    result = speculative_generate(proposer, target, prompt, feature_layer_ids=FEATURE_LAYER_IDS,
                                  block_size=block_size, max_new_tokens=max_new, stop_token_ids=[])
    full = prompt + result.new_tokens
    hidden = target.model(input_ids=torch.tensor([full]), output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i + 1] for i in FEATURE_LAYER_IDS], dim=-1)[0]  # [S, k*H]

    covered = 0
    for start, context_positions, context_features, _ in proposer.calls:
        assert context_positions == list(range(covered, start))  # new context only, ends before the anchor
        assert start not in context_positions
        torch.testing.assert_close(context_features[0], features[covered:start], rtol=1e-4, atol=1e-4)
        covered = start
    assert proposer.calls[0][0] == len(prompt)  # the first block's anchor is the prefill's token


# --- stop tokens and length ----------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 3, 5])
def test_max_new_tokens_is_exact(target, block_size):
    drafter = make_drafter(target, block_size)
    prompt = PROMPTS[1]
    for max_new in (1, 2, 7, 13):
        result = speculative_generate(drafter, target, prompt, feature_layer_ids=FEATURE_LAYER_IDS,
                                      block_size=block_size, max_new_tokens=max_new, stop_token_ids=[])
        assert result.new_tokens == naive_greedy(target, prompt, max_new)
        sequence = prompt + naive_greedy(target, prompt, max_new + block_size)
        oracle = speculative_generate(OracleProposer(sequence), target, prompt,
                                      feature_layer_ids=FEATURE_LAYER_IDS, block_size=block_size,
                                      max_new_tokens=max_new, stop_token_ids=[])
        assert len(oracle.new_tokens) == max_new


def test_stops_at_the_first_stop_token_and_keeps_it(target_dir, target):
    prompt = PROMPTS[0]
    continuation = naive_greedy(target, prompt, 40)
    # A stop token first seen mid-way, so an oracle block accepts it and tokens after it in one verify.
    index = next(i for i in range(3, 40) if continuation[i] not in continuation[:i])
    stop = continuation[index]
    expected = continuation[: index + 1]
    sequence = prompt + continuation + naive_greedy(target, prompt + continuation, 8)

    assert greedy_generate(target, prompt, max_new_tokens=40, stop_token_ids=[stop]).new_tokens == expected
    for proposer in (OracleProposer(sequence), always_wrong(sequence), make_drafter(target, 4)):
        result = speculative_generate(proposer, target, prompt, feature_layer_ids=FEATURE_LAYER_IDS,
                                      block_size=4, max_new_tokens=40, stop_token_ids=[stop])
        assert result.new_tokens == expected
    # stop_token_ids None means the target's eos.
    eos_target = make_target(target_dir, eos_token_id=stop)
    result = speculative_generate(OracleProposer(sequence), eos_target, prompt,
                                  feature_layer_ids=FEATURE_LAYER_IDS, block_size=4, max_new_tokens=40)
    assert result.new_tokens == expected
    assert greedy_generate(eos_target, prompt, max_new_tokens=40).new_tokens == expected
    # A stop token as the very first generated token: nothing is drafted at all.
    first = continuation[0]
    proposer = OracleProposer(sequence)
    result = speculative_generate(proposer, target, prompt, feature_layer_ids=FEATURE_LAYER_IDS,
                                  block_size=4, max_new_tokens=40, stop_token_ids=[first])
    assert result.new_tokens == [first] and proposer.calls == [] and result.acceptance_lengths == []


# --- temperature > 0 -------------------------------------------------------------------------------------


def test_rejection_sampling_emits_the_target_distribution():
    """Monte Carlo: the first committed token (draft if accepted, else the residual resample) ~ p."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
    q = torch.tensor([0.1, 0.5, 0.1, 0.1, 0.2])
    target_probs = torch.stack([p, torch.full((5,), 0.2)])  # [B=2, V]
    counts = torch.zeros(5)
    trials = 6000
    accepted_total = 0
    for _ in range(trials):
        draft = torch.multinomial(q, 1, generator=generator)  # [1]
        accepted, bonus = accept_rejection_sampling(draft, q[None], target_probs, generator)
        token = int(draft[0]) if accepted else bonus
        counts[token] += 1
        accepted_total += accepted
    torch.testing.assert_close(counts / trials, p, atol=0.025, rtol=0)
    assert accepted_total / trials == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.025)


def test_sampling_is_seeded_and_not_called_lossless(target):
    drafter = make_drafter(target, 4)
    kwargs = dict(feature_layer_ids=FEATURE_LAYER_IDS, block_size=4, max_new_tokens=12, temperature=0.8,
                  stop_token_ids=[], measure_speedup=False)
    state = torch.random.get_rng_state()
    first = evaluate(drafter, target, PROMPTS[:1], seed=3, **kwargs)
    again = evaluate(drafter, target, PROMPTS[:1], seed=3, **kwargs)
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG (training's) is untouched
    assert first.lossless is None and first.temperature == 0.8
    timeless = {"time_per_token_spec_s": 0}
    assert first.model_dump() | timeless == again.model_dump() | timeless
    samples = {
        tuple(speculative_generate(drafter, target, PROMPTS[0], feature_layer_ids=FEATURE_LAYER_IDS, block_size=4,
                                   max_new_tokens=12, temperature=0.8, stop_token_ids=[],
                                   generator=torch.Generator().manual_seed(seed)).new_tokens)
        for seed in (0, 1)
    }
    assert len(samples) == 2  # different seeds sample differently


# --- the report ----------------------------------------------------------------------------------------------


def test_report_with_speedup_is_complete_json(target):
    drafter = make_drafter(target, 4)
    drafter.train()
    report = evaluate(drafter, target, PROMPTS[:2], feature_layer_ids=FEATURE_LAYER_IDS, block_size=4,
                      max_new_tokens=10, stop_token_ids=[])
    assert drafter.training  # the caller's mode is restored
    data = json.loads(report.model_dump_json())
    for key in ("tau", "per_position_acceptance", "speedup", "lossless", "acceptance_histogram",
                "tokens_per_target_forward", "time_per_token_spec_s", "time_per_token_greedy_s"):
        assert key in data
    assert data["speedup"] == pytest.approx(data["time_per_token_greedy_s"] / data["time_per_token_spec_s"])
    assert data["prompts"] == 2 and data["output_tokens"] == 20 and data["block_size"] == 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block_size": 0}, "block size"),
        ({"max_new_tokens": 0}, "max new tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"prompts": []}, "no prompts"),
        ({"prompts": [[]]}, "at least one token"),
    ],
)
def test_bad_arguments_raise_eval_error(target, kwargs, match):
    args = dict(prompts=PROMPTS, feature_layer_ids=FEATURE_LAYER_IDS, block_size=4, max_new_tokens=8) | kwargs
    prompts = args.pop("prompts")
    with pytest.raises(EvalError, match=match):
        evaluate(make_drafter(target, 4), target, prompts, **args)


# --- `trainer eval` ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A real two-step run on the small embedded target: runs/<name> with a checkpoint."""
    from trainer.config import build_config
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir
    from trainer.target.embedded import build_embedded_target

    root = tmp_path_factory.mktemp("eval-cli")
    target_path = build_embedded_target(root / "target", small=True, steps=1, progress=False)
    config = build_config(extra=dict(
        target=str(target_path), steps=2, batch_size=2, seq_len=64, draft_layers=2, block_size=4, max_anchors=4,
        eval_every=None, eval_prompts=2, eval_max_new_tokens=8, warmup_steps=0,
    ))
    train(RunDir(root / "runs" / "r1"), config, preset=None, device="cpu", progress=False)
    return root / "runs"


def invoke(*args: str):
    from typer.testing import CliRunner

    from trainer.cli import app

    return CliRunner().invoke(app, ["eval", *args])


def snapshot(path: Path) -> dict[str, float]:
    return {str(p.relative_to(path)): p.stat().st_mtime for p in sorted(path.rglob("*"))}


def test_eval_command_prints_json_and_writes_nothing(trained_run):
    before = snapshot(trained_run)
    result = invoke("r1", "--runs-dir", str(trained_run), "--json", "--device", "cpu")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert data["run"] == "r1" and data["step"] == 2
    assert data["prompts"] == 2 and data["max_new_tokens"] == 8 and data["block_size"] == 4  # the run's config
    assert data["lossless"] is True
    assert 1.0 <= data["tau"] <= 4.0 and len(data["per_position_acceptance"]) == 3
    assert data["speedup"] > 0
    assert snapshot(trained_run) == before

    result = invoke(str(trained_run / "r1"), "--json", "--block-size", "2", "--prompts", "1",
                    "--max-new-tokens", "5", "--temperature", "0.7")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["block_size"], data["prompts"], data["max_new_tokens"]) == (2, 1, 5)
    assert data["lossless"] is None and len(data["per_position_acceptance"]) == 1


def test_eval_command_human_summary(trained_run):
    result = invoke("r1", "--runs-dir", str(trained_run), "--prompts", "1", "--max-new-tokens", "6")
    assert result.exit_code == 0, result.output
    for word in ("tau", "tokens / target forward", "speedup", "lossless", "per-position acceptance", "histogram"):
        assert word in result.stdout
    assert "loading run" in result.stderr and "loading run" not in result.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["nope"], "no run named 'nope'"),
        (["r1", "--prompts", "0"], "--prompts must be at least 1"),
        (["r1", "--block-size", "0"], "--block-size must be at least 1"),
        (["r1", "--max-new-tokens", "-3"], "--max-new-tokens must be at least 1"),
        (["r1", "--temperature", "-1"], "--temperature must be"),
    ],
)
def test_eval_command_user_errors_are_one_line_exit_2(trained_run, args, message):
    result = invoke(*args, "--runs-dir", str(trained_run))
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1


def test_eval_command_run_without_checkpoint(trained_run, tmp_path):
    import shutil

    shutil.copytree(trained_run / "r1", tmp_path / "fresh", ignore=shutil.ignore_patterns("checkpoints"))
    result = invoke("fresh", "--runs-dir", str(tmp_path))
    assert result.exit_code == 2
    assert "no checkpoint" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.output
