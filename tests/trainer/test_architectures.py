"""Every causal-LM family transformers ships in a tiny size is a usable target, computed exactly.

For each family (tests/trainer/tiny_targets.py: Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi3, OLMo2,
OLMo3, Gemma2, Gemma3 text, Gemma4 text (per-layer head_dim), gpt-oss, Cohere2, Llama4 text (chunked
attention), DeepSeek-V3 and GLM-4-MoE (MLA / routed experts), Seed-OSS, ERNIE 4.5, Hunyuan dense, GPT-2,
GPT-NeoX, and the recurrent-state hybrids Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Kimi Linear, Granite 4 hybrid
(Mamba-2), MiniMax (lightning attention)), a real model saved with save_pretrained trains two steps,
passes the target-fidelity check (sliding-window families on a held-out document longer than the window),
ends with a lossless eval.json (on recurrent targets through the state rollback of
trainer/eval/target_cache.py, with slowly decaying states so a wrong rollback shows), and exports: the
z-lab export reloads through from_pretrained with the
drafter's own logits, and the speculators export is written, carrying the target's effective embedding
table and lm_head where speculators could not reload them as the drafter saw them (Gemma's scaled
embeddings, GPT-2's / GPT-NeoX's table names). The speculators-side reload is in
tests/parity/test_speculators_export.py (speculators' own venv).

Cost: each family is trained, evaluated, exported and reloaded once (module fixture) and both tests read
that; the data is a hundred documents of the embedded corpus (tokenizing and packing all 3200 was most of a
family's time), the eval one prompt of 8 tokens, enough for losslessness and verify steps.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.tiny_targets import (
    FAMILIES,
    HIDDEN,
    PER_DOCUMENT_FAMILIES,
    RECURRENT_FAMILIES,
    SLIDING_FAMILIES,
    SLIDING_WINDOW,
    save_family_target,
    save_small_corpus,
)

BLOCK = 4
# The small corpus's 5 held-out documents (63-181 tokens), seq_len 48: the fidelity row is at least 48 tokens
# and the held-out document at least window + 16 = 24, three times the sliding window.
RUN = dict(
    steps=2, batch_size=2, seq_len=48, draft_layers=2, block_size=BLOCK, max_anchors=4,
    eval_every=None, eval_prompts=1, eval_max_new_tokens=8, warmup_steps=0, checkpoint_every=2, log_every=1,
)
SCALED_EMBEDDINGS = {"gemma2", "gemma3_text", "gemma4_text"}
# speculators reloads the verifier's embeddings by the name embed_tokens (or a few aliases); z-lab's loop
# reads target.model.embed_tokens and target.lm_head
OTHER_EMBEDDING_NAMES = {"gpt2": "transformer.wte", "gpt_neox": "gpt_neox.embed_in"}
# The families with mixture-of-experts, recurrent states or attention variants take longest (0.3-0.5 s each on
# a quiet core against 0.15-0.25 s); the rest stay in the fast suite. The suite's own run (`make test`) runs
# both: `slow` only lets `-m "not slow"` skip them.
SLOW = {
    "qwen3_moe", "gpt_oss", "gemma3_text", "phi3", "olmo2", "gpt_neox", "cohere2", "llama4_text", "qwen3_next",
    "qwen3_5_moe", "kimi_linear", "minimax", "granitemoehybrid", "deepseek_v3", "gemma4_text",
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    from trainer.target.embedded import build_embedded_tokenizer

    return build_embedded_tokenizer(small=True)


def family_params() -> list:
    return [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in FAMILIES]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return str(save_small_corpus(tmp_path_factory.mktemp("data") / "corpus.txt"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer, data):
    """family -> the trained run (root with target/, runs/r), its exports and the run loaded once."""
    from trainer.config import build_config
    from trainer.export import export_run
    from trainer.run.loop import load_run, train
    from trainer.run.rundir import RunDir

    cache: dict[str, dict] = {}

    def build(family: str) -> dict:
        if family not in cache:
            root = tmp_path_factory.mktemp(family)
            save_family_target(family, root / "target", tokenizer)
            config = build_config(extra={**RUN, "data": data, "target": str(root / "target")})
            run = RunDir(root / "runs" / "r")
            train(run, config, preset=None, device="cpu", progress=False)
            zlab = export_run(run.path, root / "zlab", "zlab")
            speculators = export_run(run.path, root / "speculators", "speculators")
            cache[family] = {"root": root, "run": run.path, "zlab": zlab, "speculators": speculators,
                             "loaded": load_run(run.path, "cpu")}
        return cache[family]

    return build


@pytest.mark.parametrize("family", family_params())
def test_family_trains_with_exact_target_features_and_evaluates_losslessly(trained, family):
    built = trained(family)
    info = json.loads((built["run"] / "run.json").read_text())
    fidelity = info["target_fidelity"]
    assert fidelity["passed"], fidelity
    assert max(fidelity["max_abs_hidden_diff"], fidelity["max_abs_logit_diff"]) <= fidelity["tolerance"] == 1e-3
    if family in PER_DOCUMENT_FAMILIES:  # the packed ways were measured, found wrong, and said so
        assert fidelity["packing"] == "per_document"
        assert fidelity["tried"]["positions"]["max_abs_hidden_diff"] > fidelity["tolerance"]
    else:
        assert fidelity["packing"] in ("positions", "layer_masks")
    if family in SLIDING_FAMILIES:
        assert fidelity["longest_window"] == SLIDING_WINDOW
        assert fidelity["tokens"] > SLIDING_WINDOW * 2  # the window binds inside the checked document
    metrics = [json.loads(line) for line in (built["run"] / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics] == [1, 2] and all(row["loss"] > 0 for row in metrics)
    report = json.loads((built["run"] / "eval.json").read_text())  # eval_every null: still one at the end
    assert report["lossless"] is True and report["output_tokens"] > 0
    if family in RECURRENT_FAMILIES:  # a rejected block restored the recorded state, or the saved one and a replay
        assert (report["target_rollback"] == "state_history" and report["state_replays"] == 0) or (
            report["target_rollback"] == "state_replay" and report["state_replays"] > 0)
    else:
        assert report["target_rollback"] == "crop" and report["state_replays"] == 0


@pytest.mark.parametrize("family", family_params())
def test_family_exports_reload_with_the_drafters_logits(trained, family):
    from safetensors.torch import load_file

    from trainer.export import DFlashDrafterForExport

    built = trained(family)
    original = built["loaded"]
    reloaded = DFlashDrafterForExport.from_pretrained(built["zlab"].path).eval()
    k = len(original.feature_layer_ids)
    generator = torch.Generator().manual_seed(1)
    block_ids = torch.full((1, BLOCK), original.drafter.mask_token_id)
    block_ids[0, 0] = 7
    block_embeds = original.target.embed(block_ids)  # [1, B, H] the target's own (scaled) embeddings
    features = torch.randn(1, 6, k * HIDDEN, generator=generator)  # [1, C, k*H]
    positions = torch.arange(6 + BLOCK)[None]
    with torch.no_grad():
        expected = original.target.logits(original.drafter(block_embeds, features, positions))
        got = original.target.logits(reloaded(block_embeds, features, positions))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)

    speculators = built["speculators"]
    config = json.loads((speculators.path / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in original.feature_layer_ids]
    weights = load_file(speculators.path / "model.safetensors")
    if family in SCALED_EMBEDDINGS or family in OTHER_EMBEDDING_NAMES:
        # speculators would reload other tables from the verifier: the export carries the ones the drafter saw
        assert config["speculators_config"]["verifier"]["name_or_path"] is None
        (note,) = speculators.notes
        assert ("ScaledWordEmbedding" if family in SCALED_EMBEDDINGS else OTHER_EMBEDDING_NAMES[family]) in note
        vocab = original.target.vocab_size
        with torch.no_grad():
            torch.testing.assert_close(weights["embed_tokens.weight"], original.target.embed(torch.arange(vocab)),
                                       rtol=0, atol=0)
        assert torch.equal(weights["lm_head.weight"], original.target.lm_head.weight.detach())
    else:
        assert config["speculators_config"]["verifier"]["name_or_path"] == str((built["root"] / "target").resolve())
        assert not speculators.notes and not [name for name in weights if "embed" in name or "lm_head" in name]
    # z-lab's own decoding loop reads target.model.embed_tokens / target.lm_head: a note where they are missing
    assert bool(built["zlab"].notes) == (family in OTHER_EMBEDDING_NAMES)


def test_drafter_config_reads_each_familys_own_names():
    """Gemma3 nests RoPE per layer type (the drafter takes the full-attention one), GPT-2 names its MLP width
    n_inner (None: 4H) and has no RoPE, GPT-NeoX's partial rotary factor is its own head layout."""
    from transformers import Gemma3TextConfig, GPT2Config, GPTNeoXConfig

    from trainer.model.drafter import draft_config_from_target

    gemma3 = Gemma3TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    rope = draft_config_from_target(gemma3, 1).rope_parameters
    assert rope["rope_theta"] == gemma3.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert draft_config_from_target(gemma3, 1).hidden_act == "gelu_pytorch_tanh"
    gpt2 = draft_config_from_target(GPT2Config(n_embd=64, n_head=4, n_layer=2), 1)
    assert (gpt2.intermediate_size, gpt2.head_dim, gpt2.hidden_act) == (256, 16, "gelu_new")
    assert gpt2.rope_parameters["rope_theta"] == 10000.0 and gpt2.rms_norm_eps == 1e-5
    neox = draft_config_from_target(GPTNeoXConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2), 1)
    assert "partial_rotary_factor" not in neox.rope_parameters


# --- families that cannot be targets: one line each, at the step that finds out -----------------------------


def _tiny(config_name: str, tokenizer, **fields):
    import transformers

    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False, **fields,
    )
    return config


def _saved(tmp_path, tokenizer, config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_families_that_cannot_be_targets_are_refused_in_one_line(tmp_path, tokenizer):
    """Each refusal at the step that finds it out, a TargetError (one line, exit 2 in every command): OPT-350m's
    embeddings are narrower than its hidden states; X-MOD's own forward fails without a language set; GPT-1
    returns no cache, so it cannot be decoded incrementally."""
    from trainer.eval.target_cache import TargetCache
    from trainer.target import FrozenTarget
    from trainer.target.fidelity import choose_packing, token_stream
    from trainer.target.frozen import TargetError

    cpu = torch.device("cpu")
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    opt = _tiny("OPTConfig", tokenizer, hidden_size=32, word_embed_proj_dim=16, num_hidden_layers=2,
                num_attention_heads=2, ffn_dim=64)
    with pytest.raises(TargetError, match="token embeddings 16 wide, hidden states 32") as refused:
        FrozenTarget.load(str(_saved(tmp_path / "opt", tokenizer, opt)), cpu)
    assert "\n" not in str(refused.value)

    xmod = FrozenTarget.load(str(_saved(tmp_path / "xmod", tokenizer, _tiny("XmodConfig", tokenizer, is_decoder=True,
                                                                             **small))), cpu)
    with pytest.raises(TargetError, match="XmodForCausalLM fails in its own forward over one document") as refused:
        choose_packing(xmod, token_stream([list(range(10, 60))], 40), 8)
    assert "Input language unknown" in str(refused.value) and "\n" not in str(refused.value)

    gpt1 = _tiny("OpenAIGPTConfig", tokenizer, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    gpt1 = FrozenTarget.load(str(_saved(tmp_path / "gpt1", tokenizer, gpt1)), cpu)
    with pytest.raises(TargetError, match="returns no cache") as refused:
        TargetCache(gpt1.model).forward(torch.tensor([[5, 6, 7]]))
    assert "\n" not in str(refused.value)


def test_a_target_without_attention_heads_is_refused_in_one_line(tokenizer):
    """Mamba has no attention heads for the drafter to take (trainer/errors.py makes a TargetError one line and
    exit 2 in every command)."""
    from trainer.model.drafter import DFlashDrafter
    from trainer.target.frozen import TargetError

    mamba = _tiny("MambaConfig", tokenizer, hidden_size=32, num_hidden_layers=2, state_size=4)
    with pytest.raises(TargetError, match=r"\(MambaConfig\) has no num_attention_heads") as refused:
        DFlashDrafter.from_target_config(mamba, num_layers=1, num_features=1, block_size=4, mask_token_id=3)
    assert "\n" not in str(refused.value)
