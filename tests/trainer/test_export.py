"""`trainer export`: z-lab and speculators serving directories from real (two-step) runs.

References: the run's own drafter as `load_run` rebuilds it (export -> from_pretrained must compute the
same logits), the target's decoder-layer outputs captured with forward hooks (the layer-id conventions),
and hand-written expected configs. The target is a tiny 8-layer Qwen3 with a non-default RoPE theta and
a tokenizer without a mask token, so a wrong RoPE or a wrongly resolved mask token shows.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.tiny_targets import HIDDEN, char_tokenizer, save_tiny_qwen3
from trainer.export import (
    DFlashDrafterForExport,
    DrafterSpec,
    ExportError,
    export_run,
    load_exported_drafter,
    speculators_config,
    vllm_to_zlab_layer_ids,
    zlab_to_vllm_layer_ids,
)

TARGET_LAYERS = 8
ROPE_THETA = 1e6  # not the default 10000: a config that loses it changes the reloaded drafter's output
FIXED_IDS = [1, 5]  # z-lab's rule for k=2 on 8 layers: round(1 + i*(8-4)/1)
V5_SELECTED = [1, 2, 3, 4, 5]
V5_FC_IDS = [1, 2, 3, 4]  # fc over the first 4 of the 5 selected layers (the v5 bug)
BLOCK = 4
DRAFT_VOCAB = 40  # of the target's 106 rows
EVAL_ARGS = ("--prompts", "3", "--max-new-tokens", "24", "--device", "cpu", "--json")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a busy 2-core machine: extra intra-op threads only add synchronisation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """<root>/target (tiny Qwen3) and two finished two-step runs: runs/fixed and runs/v5."""
    from trainer.config import build_config
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir

    root = tmp_path_factory.mktemp("export")
    save_tiny_qwen3(root / "target", char_tokenizer(), layers=TARGET_LAYERS, rope_theta=ROPE_THETA)
    common = dict(
        target=str(root / "target"), steps=2, batch_size=2, seq_len=48, draft_layers=2, block_size=BLOCK,
        max_anchors=4, eval_every=None, eval_prompts=1, eval_max_new_tokens=8, warmup_steps=0, checkpoint_every=2,
    )
    runs_dir = root / "runs"
    train(RunDir(runs_dir / "fixed"), build_config(extra=common), preset=None, device="cpu", progress=False)
    v5 = build_config(preset="v5", extra={**common, "target_layer_ids": V5_SELECTED})
    train(RunDir(runs_dir / "v5"), v5, preset="v5", device="cpu", progress=False)
    vocab = build_config(extra={**common, "draft_vocab_size": DRAFT_VOCAB})
    train(RunDir(runs_dir / "vocab"), vocab, preset=None, device="cpu", progress=False)
    return runs_dir


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("exported")
    paths = {}
    for run in ("fixed", "v5"):
        for layout in ("zlab", "speculators"):
            paths[f"{run}-{layout}"] = export_run(runs / run, out / f"{run}-{layout}", layout).path
    return paths


def header(path: Path) -> dict:
    with open(path, "rb") as handle:
        return json.loads(handle.read(int.from_bytes(handle.read(8), "little")))


# --- the layer-id conventions --------------------------------------------------------------------------------


def test_layer_id_conversion_round_trips_and_rejects_the_embedding():
    assert zlab_to_vllm_layer_ids([1, 16, 31, 46, 61]) == [2, 17, 32, 47, 62]
    assert vllm_to_zlab_layer_ids([2, 17, 32, 47, 62]) == [1, 16, 31, 46, 61]
    for ids in ([0], [1, 9, 17, 25, 33], [3, 4], []):
        assert vllm_to_zlab_layer_ids(zlab_to_vllm_layer_ids(ids)) == ids
        assert zlab_to_vllm_layer_ids(vllm_to_zlab_layer_ids([i + 1 for i in ids])) == [i + 1 for i in ids]
    with pytest.raises(ValueError, match="embedding"):
        vllm_to_zlab_layer_ids([0, 5])
    with pytest.raises(ValueError):
        zlab_to_vllm_layer_ids([-1])


def test_both_conventions_name_the_same_decoder_layer_output(runs):
    """z-lab id i and vLLM id i+1 both address the output of decoder layer i (captured by a hook)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(runs.parent / "target").eval()
    outputs: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(module, args, out):
            outputs[i] = out[0] if isinstance(out, tuple) else out

        return hook

    hooks = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        hidden_states = model(torch.tensor([[5, 9, 13, 2, 7]]), output_hidden_states=True).hidden_states
    for hook in hooks:
        hook.remove()
    zlab_ids = list(range(TARGET_LAYERS - 1))  # the last layer's HF hidden state is the normed one
    for zlab_id, vllm_id in zip(zlab_ids, zlab_to_vllm_layer_ids(zlab_ids)):
        torch.testing.assert_close(hidden_states[zlab_id + 1], outputs[zlab_id])  # z-lab: hidden_states[i+1]
        torch.testing.assert_close(hidden_states[vllm_id], outputs[zlab_id])  # vLLM: hidden_states[i]


# --- z-lab layout ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("run,fc_ids", [("fixed", FIXED_IDS), ("v5", V5_FC_IDS)])
def test_zlab_config_describes_the_layers_fc_reads(exports, run, fc_ids):
    path = exports[f"{run}-zlab"]
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    # the tokenizer has 103 tokens and no mask token: the first unused embedding row
    assert config["dflash_config"] == {"target_layer_ids": fc_ids, "block_size": BLOCK, "mask_token_id": 103}
    assert config["block_size"] == BLOCK and config["num_target_layers"] == TARGET_LAYERS
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == HIDDEN
    assert config["rope_theta"] == ROPE_THETA and config["rope_parameters"]["rope_theta"] == ROPE_THETA
    tensors = {k: v for k, v in header(path / "model.safetensors").items() if k != "__metadata__"}
    assert tensors["fc.weight"]["shape"] == [HIDDEN, len(fc_ids) * HIDDEN]
    assert not [name for name in tensors if "embed" in name or "lm_head" in name]  # the target's, at inference
    assert header(path / "model.safetensors")["__metadata__"]["step"] == "2"


@pytest.mark.parametrize("run", ["fixed", "v5"])
def test_zlab_export_reloads_through_from_pretrained_with_the_same_logits(runs, exports, run):
    from trainer.run.loop import load_run

    reloaded, info = DFlashDrafterForExport.from_pretrained(exports[f"{run}-zlab"], output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    reloaded.eval()
    original = load_run(runs / run, "cpu")
    assert reloaded.target_layer_ids == original.feature_layer_ids
    assert reloaded.mask_token_id == original.drafter.mask_token_id and reloaded.block_size == BLOCK

    n, context, anchors = 2, 6, 2
    generator = torch.Generator().manual_seed(1)
    k = len(original.feature_layer_ids)
    block_ids = torch.full((n, anchors * BLOCK), original.drafter.mask_token_id)
    block_ids[:, ::BLOCK] = torch.randint(3, 100, (n, anchors), generator=generator)  # slot 0 of each block
    block_embeds = original.target.embed(block_ids)  # [N, Q, H]
    features = torch.randn(n, context, k * HIDDEN, generator=generator)  # [N, C, k*H]
    positions = torch.cat([torch.arange(context), context + torch.arange(BLOCK).repeat(anchors)])[None]  # [1, C+Q]
    with torch.no_grad():
        expected = original.target.logits(original.drafter(block_embeds, features, positions))  # [N, Q, V]
        got = original.target.logits(reloaded(block_embeds, features, positions))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert expected.std() > 0.1  # not a degenerate comparison

    assert isinstance(load_exported_drafter(exports[f"{run}-zlab"]), DFlashDrafterForExport)


def test_export_refuses_a_checkpoint_that_does_not_fit_the_config(runs, tmp_path):
    tampered = tmp_path / "tampered"
    shutil.copytree(runs / "fixed", tampered)
    config = json.loads((tampered / "config.json").read_text())
    (tampered / "config.json").write_text(json.dumps({**config, "draft_layers": 3}))
    with pytest.raises(ExportError, match="does not match the run's config"):
        export_run(tampered, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_bfloat16_export(runs, tmp_path):
    path = export_run(runs / "fixed", tmp_path / "bf16", "zlab", dtype="bfloat16").path
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(path / "model.safetensors")
    original = load_file(next((runs / "fixed" / "checkpoints").glob("step-*")) / "drafter.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    torch.testing.assert_close(weights["fc.weight"].float(), original["fc.weight"].to(torch.bfloat16).float())


# --- speculators layout ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("run,fc_ids", [("fixed", FIXED_IDS), ("v5", V5_FC_IDS)])
def test_speculators_config_uses_vllm_ids_and_names_the_verifier(runs, exports, run, fc_ids):
    path = exports[f"{run}-speculators"]
    config = json.loads((path / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in fc_ids]  # vLLM: z-lab id + 1
    assert config["block_size"] == BLOCK and config["mask_token_id"] == 103
    assert config["num_target_layers"] == TARGET_LAYERS
    speculators = config["speculators_config"]
    assert speculators["algorithm"] == "dflash" and speculators["default_proposal_method"] == "greedy"
    assert speculators["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1  # slot 0 is the anchor
    assert speculators["verifier"] == {
        "name_or_path": str((runs.parent / "target").resolve()), "architectures": ["Qwen3ForCausalLM"]
    }
    layer_config = config["transformer_layer_config"]
    assert layer_config["num_hidden_layers"] == 2 and layer_config["model_type"] == "qwen3"
    assert layer_config["rope_parameters"]["rope_theta"] == ROPE_THETA
    assert config["draft_vocab_size"] == layer_config["vocab_size"]  # full vocabulary: no d2t / t2d maps
    # same body, same names as the z-lab export
    zlab = load_file(exports[f"{run}-zlab"] / "model.safetensors")
    ours = load_file(path / "model.safetensors")
    assert ours.keys() == zlab.keys() and all(torch.equal(ours[k], zlab[k]) for k in ours)


def test_speculators_verifier_override(runs, tmp_path):
    result = export_run(runs / "fixed", tmp_path / "s", "speculators", verifier="Qwen/Qwen3-8B")
    assert result.config["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen3-8B"


def test_speculators_layout_refuses_the_last_target_layer():
    """vLLM captures auxiliary states at decoder-layer inputs; z-lab id L-1 (vLLM id L) has no slot there."""
    from transformers import Qwen3Config

    spec = DrafterSpec(
        draft_config=Qwen3Config(hidden_size=HIDDEN, num_attention_heads=4, num_hidden_layers=1),
        target_layer_ids=[3, TARGET_LAYERS - 1], num_target_layers=TARGET_LAYERS, block_size=BLOCK,
        mask_token_id=0, target_path="t", target_architectures=[],
    )
    with pytest.raises(ExportError, match="last layer"):
        speculators_config(spec, torch.float32)
    spec.target_layer_ids = [3, TARGET_LAYERS - 2]
    assert speculators_config(spec, torch.float32)["aux_hidden_state_layer_ids"] == [4, TARGET_LAYERS - 1]


# --- sleuth reads an export: shapes and config alone ------------------------------------------------------------


@pytest.mark.parametrize("layout", ["zlab", "speculators"])
@pytest.mark.parametrize("run,fc_ids", [("fixed", FIXED_IDS), ("v5", V5_FC_IDS)])
def test_sleuth_diagnoses_an_exported_directory(exports, layout, run, fc_ids):
    from sleuth.evidence.checkpoint import draft_layer_count, fc_layer_count, find_fc, read_header
    from sleuth.invariants import check_invariants, load_playbook

    path = exports[f"{run}-{layout}"]
    tensors = read_header(path / "model.safetensors")
    assert fc_layer_count(find_fc(tensors)) == (len(fc_ids), HIDDEN)
    assert draft_layer_count(tensors) == 2

    config = json.loads((path / "config.json").read_text())
    findings = {
        f.id: f
        for f in check_invariants(
            load_playbook("dflash"), config=config, config_source=str(path / "config.json"),
            checkpoint=path / "model.safetensors",
        )
    }
    fc = findings["dflash.fc_input_layers"]
    assert (fc.status, fc.observed) == ("match", "all")  # k from fc.weight == len(the ids in the config)
    assert any(e.location.endswith("model.safetensors:fc.weight") for e in fc.evidence)
    assert findings["dflash.fc_norm"].status == "match"
    assert findings["dflash.frozen_embed_head"].status == "match"
    # an export of the v5 run must never pass the layer-selection rule
    assert run == "fixed" or findings["dflash.target_layer_ids"].status != "match"


@pytest.mark.parametrize("run,expected", [("fixed", "evenly-1-to-L-3"), ("v5", "custom [1, 2, 3, 4]")])
def test_sleuth_reader_flags_the_v5_selection_from_the_export_alone(exports, run, expected):
    """The export carries the target's depth, so the ids can be checked against z-lab's rule for it."""
    from sleuth.evidence.config import RunMeta, read_config

    config = json.loads((exports[f"{run}-zlab"] / "config.json").read_text())
    meta = RunMeta(num_layers=config["num_target_layers"])
    reading = read_config("target_layer_ids", config, ["target_layer_ids", "aux_hidden_state_layer_ids"], meta)
    assert reading.key == "dflash_config.target_layer_ids" and reading.value == expected
    if run == "v5":
        assert "[1, 2, 4, 5]" in reading.detail  # round(1 + i*(8-4)/3) for k = 4


# --- the command ---------------------------------------------------------------------------------------------


def invoke(*args: str):
    import typer
    from typer.testing import CliRunner

    from trainer.commands.export import export_command

    app = typer.Typer()
    app.callback()(lambda: None)  # a group, as in trainer's app: `export` is a subcommand
    app.command("export")(export_command)
    return CliRunner().invoke(app, ["export", *args])


def test_export_command_prints_the_path_on_stdout(runs, tmp_path):
    out = tmp_path / "served"
    result = invoke("fixed", "--runs-dir", str(runs), "--out", str(out), "--format", "speculators")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{out}\n"
    assert "exported run fixed step 2" in result.stderr and "[2, 6]" in result.stderr
    assert json.loads((out / "config.json").read_text())["aux_hidden_state_layer_ids"] == [2, 6]

    (out / "notes.txt").write_text("mine")
    result = invoke(str(runs / "v5"), "--out", str(out), "--force")  # a run path; z-lab layout over the old export
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == V5_FC_IDS
    assert (out / "notes.txt").read_text() == "mine" and "notes.txt" in result.stderr


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing run", "no run named 'nope'"),
        ("no checkpoint", "has no checkpoint yet"),
        ("non-empty out", "is not empty; pass --force"),
        ("verifier with zlab", "--verifier only applies"),
    ],
)
def test_export_command_user_errors_are_one_line_exit_2(runs, tmp_path, case, message):
    out = tmp_path / "out"
    run = "fixed"
    extra: list[str] = []
    if case == "missing run":
        run = "nope"
    elif case == "no checkpoint":
        fresh = tmp_path / "runs" / "fresh"
        fresh.mkdir(parents=True)
        shutil.copy(runs / "fixed" / "config.json", fresh / "config.json")
        run, extra = "fresh", ["--runs-dir", str(tmp_path / "runs")]
    elif case == "non-empty out":
        out.mkdir()
        (out / "config.json").write_text("{}")
    else:
        extra = ["--verifier", "Qwen/Qwen3-8B"]
    result = invoke(run, "--runs-dir", str(runs), *extra, "--out", str(out))
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""
    if case == "non-empty out":
        assert (out / "config.json").read_text() == "{}"
    elif case != "missing run":
        assert not out.exists() or not any(out.iterdir())


# --- a draft-vocabulary run -----------------------------------------------------------------------------------


def test_draft_vocabulary_export_carries_speculators_maps_and_the_reduced_head(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.data.draft_vocab import load_vocab

    result = export_run(runs / "vocab", tmp_path / "s", "speculators")
    ids = load_vocab(runs / "vocab" / "draft_vocab.safetensors")
    config = result.config
    assert config["draft_vocab_size"] == DRAFT_VOCAB < config["transformer_layer_config"]["vocab_size"] == 106
    assert config["speculators_config"]["verifier"]["name_or_path"] == str((runs.parent / "target").resolve())
    weights = load_file(result.path / "model.safetensors")
    assert weights["d2t"].dtype == torch.long and weights["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(DRAFT_VOCAB) + weights["d2t"], ids)  # speculators: target id = i + d2t[i]
    assert weights["t2d"].shape == (106,) and torch.equal(weights["t2d"].nonzero()[:, 0], ids)
    head = AutoModelForCausalLM.from_pretrained(runs.parent / "target").lm_head.weight
    assert torch.equal(weights["lm_head.weight"], head[ids].detach())  # the rows the drafter trained through
    assert "embed_tokens.weight" not in weights  # a plain table: speculators reloads it from the verifier

    with pytest.raises(ExportError, match="d2t") as info:
        export_run(runs / "vocab", tmp_path / "z", "zlab")
    assert "\n" not in str(info.value) and "--format speculators" in str(info.value)


def eval_numbers(*args: str) -> dict:
    from typer.testing import CliRunner

    from trainer.cli import app

    result = CliRunner().invoke(app, ["eval", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_draft_vocabulary_export_evaluated_equals_the_runs_own_eval(runs, tmp_path):
    """tau in the target vocabulary, exactly the run's own: same drafts among the same target ids."""
    exported = export_run(runs / "vocab", tmp_path / "s", "speculators").path
    own = eval_numbers(str(runs / "vocab"), *EVAL_ARGS)
    foreign = eval_numbers(str(exported), "--target", str(runs.parent / "target"), *EVAL_ARGS)
    assert foreign["layout"] == "speculators"
    for key in ("tau", "acceptance_histogram", "per_position_acceptance", "output_tokens", "verify_steps"):
        assert foreign[key] == own[key], key
    assert foreign["lossless"] is True and own["verify_steps"] > 0
    # side by side, the run itself also drafts in its vocabulary (as `trainer eval RUN` does)
    both = eval_numbers(str(exported), "--against", str(runs / "vocab"), "--target", str(runs.parent / "target"),
                        *EVAL_ARGS)["drafters"]
    assert [d["layout"] for d in both] == ["speculators", "run"] and both[1]["tau"] == own["tau"] == both[0]["tau"]


@pytest.mark.parametrize("damage,message", [
    ("foreign head", "not the target's lm_head"), ("one map", "needs both maps"), ("no maps", "no d2t / t2d maps"),
])
def test_foreign_eval_refuses_a_draft_vocabulary_it_cannot_serve_faithfully(runs, tmp_path, damage, message):
    from safetensors.torch import save_file
    from typer.testing import CliRunner

    from trainer.cli import app

    exported = export_run(runs / "vocab", tmp_path / "s", "speculators").path
    weights = load_file(exported / "model.safetensors")
    if damage == "foreign head":
        weights["lm_head.weight"] = weights["lm_head.weight"] + 0.01
    elif damage == "one map":
        del weights["t2d"]
    else:
        del weights["t2d"], weights["d2t"]
    save_file(weights, str(exported / "model.safetensors"))
    result = CliRunner().invoke(app, ["eval", str(exported), "--target", str(runs.parent / "target"), *EVAL_ARGS])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.parametrize("damage,message", [
    (None, None), ("head left out", "lm_head.weight is not saved"),
    ("maps in frequency order", "d2t and t2d name different tokens"), ("one map", "the d2t map is missing"),
])
def test_sleuths_export_contract_reads_a_draft_vocabulary_export(runs, tmp_path, damage, message):
    """The rules speculators' loader needs of a reduced vocabulary (sleuth/probes/exported.py, shared with the
    probes): our own export passes them, and each way of breaking it is named."""
    from safetensors.torch import save_file

    from sleuth.checks.export_contract import contract_problems

    exported = export_run(runs / "vocab", tmp_path / "s", "speculators")
    weights = load_file(exported.path / "model.safetensors")
    if damage == "head left out":
        del weights["lm_head.weight"]
    elif damage == "maps in frequency order":  # d2t offsets for another order of the same ids
        weights["d2t"] = weights["d2t"].flip(0) + torch.arange(DRAFT_VOCAB).flip(0) - torch.arange(DRAFT_VOCAB)
    elif damage == "one map":
        del weights["d2t"]
    save_file(weights, str(exported.path / "model.safetensors"))
    _fmt, problems, _evidence = contract_problems(exported.path, exported.config)
    if damage is None:
        assert problems == []
    else:
        assert any(message in p for p in problems), problems


# --- which targets speculators can reload tables for (config only, meta device) -------------------------------


def test_target_compatibility_follows_speculators_lookup_rules():
    from transformers import Gemma2Config, GPT2Config, GPTNeoXConfig, LlamaConfig, PhiConfig

    from trainer.export import target_compatibility

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    for tied in (False, True):  # tied: speculators' fallback to the embedding table is the lm_head itself
        assert target_compatibility(LlamaConfig(**small, intermediate_size=64, tie_word_embeddings=tied)) == (None, None, None)
    refusal, tables, _ = target_compatibility(Gemma2Config(**small, intermediate_size=64, head_dim=8))
    assert refusal is None and "ScaledWordEmbedding" in tables
    _, tables, zlab = target_compatibility(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64))
    assert "transformer.wte" in tables and "finds nothing" in tables and "transformer.wte" in zlab
    _, tables, zlab = target_compatibility(GPTNeoXConfig(**small, intermediate_size=64))
    assert "gpt_neox.embed_in" in tables and "gpt_neox.embed_in" in zlab
    refusal, _, _ = target_compatibility(PhiConfig(**small, intermediate_size=64))  # Phi-2's lm_head has a bias
    assert "bias" in refusal and "\n" not in refusal
