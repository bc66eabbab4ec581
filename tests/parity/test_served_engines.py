"""Served as each engine serves it: the real clients load our export and draft what `--served-as` emulates.

The `zlab-qwen3.6` preset's drafter (four sliding layers, W = 32, and one full; block 16), trained two steps on
a tiny attention-only Qwen3 target and exported in z-lab's layout, is loaded by
    * z-lab's own package, dflash 0.1.0 (PyPI): `DFlashDraftModel.from_pretrained` and `dflash_generate`;
    * SpecForge 0.2.0: its `DFlashDraftModel.from_pretrained` and `spec_generate`.
Their draft logits for a block past the window equal ours built as `trainer/model/served.py` builds that
engine's attention (and differ from our training mask's, so the comparison sees the window), and their own
decoding loops send the target the same blocks, verify step for verify step, as `evaluate(..., served_as=...)`.
A full-attention drafter drafts our logits in both, whatever the engine.

Runs in the reference venv (`make parity`: bench/setup_speculators_env.sh installs dflash 0.1.0 --no-deps);
skips elsewhere unless SPECULATORS_PARITY_REQUIRED=1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speculators_guard import REQUIRED

try:
    from dflash.model import DFlashDraftModel as ZlabDraftModel
    from dflash.model import _make_cache as zlab_cache
    from dflash.model import dflash_generate
    from specforge.modeling.draft.dflash import DFlashDraftModel as SpecForgeDraftModel
except Exception as exc:  # ImportError, or a broken install
    if REQUIRED:
        pytest.fail(f"SPECULATORS_PARITY_REQUIRED=1 but dflash / specforge do not import: {exc!r}", pytrace=False)
    pytest.skip(f"dflash 0.1.0 / SpecForge are not importable here ({type(exc).__name__}): they run in the reference "
                "venv (bench/setup_speculators_env.sh, then `make parity`)", allow_module_level=True)

from tests.trainer.tiny_targets import save_tiny_qwen3  # noqa: E402

BLOCK, WINDOW = 16, 32  # the preset's
CONTEXT = 45  # an anchor past the window: a sliding layer's view depends on who counts it
PROMPT_TOKENS, NEW_TOKENS = 40, 48


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train_and_export(root: Path, target: Path, draft_config: dict | None) -> tuple[Path, Path]:
    from trainer.config import build_config
    from trainer.export import export_run
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir

    extra = dict(target=str(target), steps=2, batch_size=2, seq_len=64, max_anchors=2, eval_every=None,
                 eval_prompts=1, eval_max_new_tokens=4, warmup_steps=0, checkpoint_every=2)
    if draft_config is not None:
        extra["draft_config"] = draft_config
    config = build_config(preset="zlab-qwen3.6", extra=extra)
    run = RunDir(root / "runs" / "r")
    train(run, config, preset=None, device="cpu", progress=False)
    out = root / "zlab"
    export_run(run.path, out, "zlab")
    return run.path, out


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from trainer.target.embedded import build_embedded_tokenizer

    # Attention-only (hybrid qwen3_5 targets need the cached-decoding fix on main); 8 layers: taps [1..5].
    return save_tiny_qwen3(tmp_path_factory.mktemp("target"), build_embedded_tokenizer(small=True), layers=8)


@pytest.fixture(scope="module")
def sliding(tmp_path_factory, target_dir):
    return _train_and_export(tmp_path_factory.mktemp("sliding"), target_dir, None)


@pytest.fixture(scope="module")
def full(tmp_path_factory, target_dir):
    # The same structure with every layer full attention: all engines serve it as trained.
    draft = {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 272,
             "layer_types": ["full_attention"] * 5, "sliding_window": None,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e7}}
    return _train_and_export(tmp_path_factory.mktemp("full"), target_dir, draft)


def _ours(run_dir: Path):
    from trainer.run.loop import load_run

    return load_run(run_dir, "cpu")


def _block_inputs(loaded, seed: int = 5):
    k, hidden = len(loaded.feature_layer_ids), loaded.target.hidden_size
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(1, CONTEXT, k * hidden, generator=generator)
    block = torch.full((1, BLOCK), loaded.drafter.mask_token_id)
    block[0, 0] = 7
    return features, block, torch.arange(CONTEXT + BLOCK)[None]


@torch.no_grad()
def _our_logits(loaded, engine: str | None) -> torch.Tensor:
    from trainer.model.served import served_as

    features, block, positions = _block_inputs(loaded)
    kwargs = {} if engine is None else {"served_as": served_as(engine)}
    hidden = loaded.drafter(loaded.target.embed(block), features, positions, **kwargs)
    return loaded.target.logits(hidden)[0]


@torch.no_grad()
def _zlab_logits(loaded, export: Path) -> torch.Tensor:
    model = ZlabDraftModel.from_pretrained(str(export)).float().eval()
    features, block, positions = _block_inputs(loaded)
    hidden = model(target_hidden=features, noise_embedding=loaded.target.embed(block), position_ids=positions,
                   past_key_values=zlab_cache(model.config), use_cache=True)
    return loaded.target.logits(hidden)[0]


@torch.no_grad()
def _specforge_logits(loaded, export: Path) -> torch.Tensor:
    model = SpecForgeDraftModel.from_pretrained(str(export)).float().eval()
    features, block, positions = _block_inputs(loaded)
    # exactly spec_generate's call: no mask, is_causal=False
    hidden = model(target_hidden=features, noise_embedding=loaded.target.embed(block), position_ids=positions,
                   past_key_values=__import__("transformers").DynamicCache(), use_cache=True, is_causal=False)
    return loaded.target.logits(hidden)[0]


def test_zlab_0_1_0_drafts_our_logits_built_as_it_builds_them(sliding):
    run_dir, export = sliding
    loaded = _ours(run_dir)
    theirs = _zlab_logits(loaded, export)
    torch.testing.assert_close(theirs, _our_logits(loaded, "zlab"), rtol=0, atol=1e-5)
    # the window decides: our training mask (speculators / vLLM) drafts other logits for the same block
    assert (theirs - _our_logits(loaded, None)).abs().max() > 1e-3
    assert theirs.std() > 0.1


def test_specforge_drafts_our_logits_built_as_its_loop_builds_them(sliding):
    run_dir, export = sliding
    loaded = _ours(run_dir)
    theirs = _specforge_logits(loaded, export)
    torch.testing.assert_close(theirs, _our_logits(loaded, "specforge"), rtol=0, atol=1e-5)
    assert (theirs - _our_logits(loaded, None)).abs().max() > 1e-3
    assert (theirs - _our_logits(loaded, "zlab")).abs().max() > 1e-3


def test_a_full_attention_drafter_is_served_as_trained_everywhere(full):
    run_dir, export = full
    loaded = _ours(run_dir)
    ours = _our_logits(loaded, None)
    for engine in ("zlab", "sglang", "specforge"):
        torch.testing.assert_close(_our_logits(loaded, engine), ours, rtol=0, atol=0)
    torch.testing.assert_close(_zlab_logits(loaded, export), ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(_specforge_logits(loaded, export), ours, rtol=0, atol=1e-5)


# --- whole decoding loops ---------------------------------------------------------------------------------


class VerifyRecorder:
    """The blocks a decoding loop sends the target after its prefill, and their first positions."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[int, list[int]]] = []
        self.handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("position_ids")
        start = int(positions[0, 0]) if positions is not None else -1
        self.calls.append((start, ids[0].tolist()))

    def verify_blocks(self) -> list[tuple[int, list[int]]]:
        self.handle.remove()
        return self.calls[1:]  # the first call is the prefill


def _prompt(target) -> list[int]:
    text = "the quick brown fox jumps over the lazy dog and then it runs back home again "
    ids = target.tokenizer(text * 4)["input_ids"]
    return ids[:PROMPT_TOKENS]


def _ours_decoding(run_dir: Path, engine: str | None, prompt: list[int]):
    from trainer.eval.speculative import DFlashProposer, speculative_generate
    from trainer.model.served import served_as

    loaded = _ours(run_dir)
    recorder = VerifyRecorder(loaded.target.model)
    result = speculative_generate(DFlashProposer(loaded.drafter, loaded.target, served_as=served_as(engine)),
                                  loaded.target, prompt, feature_layer_ids=loaded.feature_layer_ids,
                                  block_size=BLOCK, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    return result, recorder.verify_blocks(), loaded


def _steps_to_reach(lengths: list[int], tokens: int) -> int:
    """Verify steps a loop that stops at `tokens` new tokens makes with these acceptance lengths (the prefill
    gives the first token)."""
    produced, steps = 1, 0
    for length in lengths:
        if produced >= tokens:
            break
        produced += length
        steps += 1
    return steps


def _compare(ours_result, ours_blocks, their_blocks) -> None:
    # Theirs ran with room for one more block, so every step ours makes is a full block in theirs too.
    steps = len(ours_result.acceptance_lengths)
    their_starts = [start for start, _ in their_blocks]
    their_lengths = [b - a for a, b in zip(their_starts, their_starts[1:])]
    assert ours_blocks == their_blocks[:steps]
    assert ours_result.acceptance_lengths == their_lengths[:steps]
    assert _steps_to_reach(their_lengths, NEW_TOKENS) == steps


def test_dflash_generate_makes_the_verify_steps_of_served_as_zlab(sliding):
    run_dir, export = sliding
    result, blocks, loaded = _ours_decoding(run_dir, "zlab", _prompt(_ours(run_dir).target))
    prompt = _prompt(loaded.target)
    model = ZlabDraftModel.from_pretrained(str(export)).float().eval()
    recorder = VerifyRecorder(loaded.target.model)
    # (return_stats times with CUDA events: CPU here, so the steps are read off the target's calls)
    dflash_generate(model, loaded.target.model, torch.tensor([prompt]), NEW_TOKENS + BLOCK, None, block_size=BLOCK)
    _compare(result, blocks, recorder.verify_blocks())
    # our training mask drafts other blocks on this prompt: the comparison above sees the window
    default, default_blocks, _ = _ours_decoding(run_dir, None, prompt)
    assert default_blocks != blocks[:len(default_blocks)] or default.acceptance_lengths != result.acceptance_lengths


def test_spec_generate_makes_the_verify_steps_of_served_as_specforge(sliding):
    run_dir, export = sliding
    loaded = _ours(run_dir)
    prompt = _prompt(loaded.target)
    result, blocks, _ = _ours_decoding(run_dir, "specforge", prompt)
    model = SpecForgeDraftModel.from_pretrained(str(export)).float().eval()
    recorder = VerifyRecorder(loaded.target.model)
    model.spec_generate(loaded.target.model, torch.tensor([prompt]), NEW_TOKENS + BLOCK, None, 0.0)
    _compare(result, blocks, recorder.verify_blocks())
    default, default_blocks, _ = _ours_decoding(run_dir, None, prompt)
    assert default_blocks != blocks[:len(default_blocks)] or default.acceptance_lengths != result.acceptance_lengths


def test_a_full_attention_drafter_decodes_the_same_in_every_loop(full):
    run_dir, export = full
    loaded = _ours(run_dir)
    prompt = _prompt(loaded.target)
    result, blocks, _ = _ours_decoding(run_dir, None, prompt)
    recorder = VerifyRecorder(loaded.target.model)
    dflash_generate(ZlabDraftModel.from_pretrained(str(export)).float().eval(), loaded.target.model,
                    torch.tensor([prompt]), NEW_TOKENS + BLOCK, None, block_size=BLOCK)
    _compare(result, blocks, recorder.verify_blocks())
    recorder = VerifyRecorder(loaded.target.model)
    SpecForgeDraftModel.from_pretrained(str(export)).float().eval().spec_generate(
        loaded.target.model, torch.tensor([prompt]), NEW_TOKENS + BLOCK, None, 0.0)
    _compare(result, blocks, recorder.verify_blocks())
