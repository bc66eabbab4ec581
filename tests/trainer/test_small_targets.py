"""Small and unusual targets: the layer rule for any depth >= 2, one-line errors that say what to set,
sleuth's `target_layer_ids: null` fix through `trainer run --fixed`, run records that name their inputs
absolutely, and a tokenizer without mask, pad, eos or chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.tiny_targets import save_family_target
from trainer.config import ConfigError, build_config, default_target_layer_ids

TINY = dict(
    steps=1, batch_size=2, seq_len=40, draft_layers=2, block_size=4, max_anchors=2, eval_every=None,
    eval_prompts=1, eval_max_new_tokens=4, warmup_steps=0, checkpoint_every=1,
)


def zlab_rule(num_layers: int, k: int) -> list[int]:
    """z-lab's build_target_layer_ids, written out (dflash/model.py:27-45)."""
    if k == 1:
        return [num_layers // 2]
    return [int(round(1 + i * (num_layers - 4) / (k - 1))) for i in range(k)]


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_layer_rule_is_valid_for_every_depth_and_is_zlabs_where_it_fits(k):
    for depth in range(2, 80):
        ids = default_target_layer_ids(depth, k)
        assert ids == sorted(set(ids)) and 1 <= len(ids) <= k, (depth, k, ids)
        assert 0 <= ids[0] and ids[-1] <= depth - 2, (depth, k, ids)  # never the final-normed last layer
        if depth >= k + 3:
            assert ids == zlab_rule(depth, k), (depth, k, ids)
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert [default_target_layer_ids(d, 5) for d in (6, 5, 4, 3, 2)] == [[1, 2, 3], [1, 2], [2], [1], [0]]
    with pytest.raises(ConfigError, match="at least 2 decoder layers"):
        default_target_layer_ids(1, k)


def test_an_impossible_request_names_the_key_and_a_valid_value():
    config = build_config(extra={"target_layer_ids": [1, 5, 9], "draft_layers": 3})
    with pytest.raises(ConfigError) as info:
        config.resolved_layer_ids(4)
    message = str(info.value)
    assert "target_layer_ids" in message and "null" in message and "[2]" in message and "\n" not in message
    with pytest.raises(ConfigError) as info:
        build_config(extra={"target_layer_ids": [1, 1, 1, 1, 1]})
    message = str(info.value)
    assert message.startswith("invalid config: target_layer_ids:") and message.count("got") == 1, message
    assert "e.g. [1, 3]" in message


def cli(tool: str, *args: str) -> tuple[int, str, str]:
    """The real CLI app, in process (a subprocess per call would spend most of the test importing torch)."""
    from typer.testing import CliRunner

    if tool == "trainer":
        from trainer.cli import app
    else:
        from sleuth.cli import app
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.slow
def test_sleuths_null_layer_fix_runs_on_a_shallow_target_typed_as_a_relative_path(tmp_path, monkeypatch):
    from trainer.target.embedded import build_embedded_tokenizer

    save_family_target("llama", tmp_path / "work" / "target", build_embedded_tokenizer(small=True))  # 4 layers
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    settings = [f"--set={key}={json.dumps(value)}" for key, value in TINY.items()]
    code, _, err = cli("trainer", "run", "r", "--set", "target=target", "--set", "target_layer_ids=[0,1]", *settings,
                       "--runs-dir", "runs", "--quiet")
    assert code == 0, err
    config = json.loads((work / "runs" / "r" / "config.json").read_text())
    info = json.loads((work / "runs" / "r" / "run.json").read_text())
    assert config["target"] == info["target"]["path"] == str(work / "target")  # typed relative, stored absolute

    _, out, _ = cli("sleuth", "diagnose", "--run", "r", "--runs-dir", "runs", "--offline", "--format", "json")
    findings = {f["id"]: f for f in json.loads(out)["findings"]}
    assert findings["dflash.target_layer_ids"]["status"] == "mismatch"
    assert findings["dflash.target_forward_fidelity"]["status"] == "match"
    code, _, err = cli("trainer", "run", "--fixed", "--from", "r", "--runs-dir", "runs", "--quiet")
    assert code == 0, err
    new_run = next(p for p in (work / "runs").iterdir() if p.name != "r")
    assert json.loads((new_run / "config.json").read_text())["target_layer_ids"] == [2]  # the rule for L=4
    _, out, _ = cli("sleuth", "diagnose", "--run", new_run.name, "--runs-dir", "runs", "--offline", "--format", "json")
    findings = {f["id"]: f for f in json.loads(out)["findings"]}
    assert findings["dflash.target_layer_ids"]["status"] == "match", findings["dflash.target_layer_ids"]

    # eval and export work from another directory: the run names its target absolutely
    monkeypatch.chdir(elsewhere)
    code, _, err = cli("trainer", "export", str(work / "runs" / "r"), "--out", str(elsewhere / "out"))
    assert code == 0, err
    code, _, err = cli("trainer", "eval", str(work / "runs" / "r"), "--prompts", "1")
    assert code == 0, err


def bare_tokenizer():
    """Characters only: no mask, pad or eos token and no chat template."""
    import string

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(string.printable)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_a_bare_tokenizer_trains_with_notes_and_chat_data_says_what_is_missing(tmp_path, capfd):
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.data.datasets import DataError
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir
    from trainer.target import FrozenTarget

    tokenizer = bare_tokenizer()
    assert tokenizer.mask_token_id is tokenizer.pad_token_id is tokenizer.eos_token_id is None
    target = tmp_path / "target"
    config = LlamaConfig(vocab_size=len(tokenizer) + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, eos_token_id=None,
                         bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    loaded = FrozenTarget.load(str(target), torch.device("cpu"))
    assert loaded.mask_token_id == len(tokenizer)  # the first embedding row no token maps to
    assert loaded.eos_token_id is None and loaded.pad_token_id == 0

    text = tmp_path / "data.txt"
    text.write_text("\n\n".join(f"document {i}: " + "abcdefghij" * 4 for i in range(30)))
    run = RunDir(tmp_path / "runs" / "bare")
    train(run, build_config(extra={**TINY, "target": str(target), "data": str(text)}), preset=None, device="cpu",
          progress=False)
    assert json.loads((run.path / "eval.json").read_text())["lossless"] is True
    assert "has no eos token" in capfd.readouterr().err

    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    with pytest.raises(DataError, match="chat template") as info:
        train(RunDir(tmp_path / "runs" / "chat"), build_config(extra={**TINY, "target": str(target), "data": str(chat)}),
              preset=None, device="cpu", progress=False)
    assert "\n" not in str(info.value)
