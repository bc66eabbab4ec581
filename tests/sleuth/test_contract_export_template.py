"""dflash.export_contract on exported directories and dflash.chat_template_consistency on run records."""

from __future__ import annotations

import json

import numpy as np
from contract_fixtures import write_run
from safetensors.numpy import load_file, save_file
from test_diagnose_export import write_export

from sleuth.checks import ContractContext
from sleuth.checks.chat_template import check_chat_template_consistency, template_sha256
from sleuth.checks.export_contract import check_export_contract
from sleuth.runs import read_run


def contract(directory) -> object:
    info = read_run(directory)
    return check_export_contract(ContractContext(run=info, config=info.config))


def test_complete_exports_in_both_formats_match(tmp_path):
    assert contract(write_export(tmp_path / "zlab", [1, 3, 5])).status == "match"
    assert contract(write_export(tmp_path / "spec", [1, 3, 5], speculators=True)).status == "match"


def test_a_renamed_tensor_is_missing_for_the_loader_and_unknown_to_it(tmp_path):
    export = write_export(tmp_path / "zlab", [1, 3, 5])
    tensors = load_file(str(export / "model.safetensors"))
    tensors["model.fc.weight"] = tensors.pop("fc.weight")
    save_file(tensors, str(export / "model.safetensors"))
    finding = contract(export)
    assert finding.status == "mismatch"
    assert "missing (left at random init): fc.weight" in finding.observed
    assert "no loader reads (ignored, fail-silent): model.fc.weight" in finding.observed


def test_a_wrong_shape_and_zlab_ids_written_unconverted_into_a_speculators_export(tmp_path):
    export = write_export(tmp_path / "spec", [0, 3, 5], speculators=True)
    config = json.loads((export / "config.json").read_text())
    config["aux_hidden_state_layer_ids"] = [0, 3, 5]  # z-lab ids, not + 1: 0 would be the embeddings
    (export / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(export / "model.safetensors"))
    tensors["fc.weight"] = np.zeros((16, 32), np.float32)
    save_file(tensors, str(export / "model.safetensors"))
    finding = contract(export)
    assert finding.status == "mismatch"
    assert "aux_hidden_state_layer_ids [0, 3, 5] has [0] outside 1..7" in finding.observed
    assert "fc.weight [16, 32] (loader builds [16, 48])" in finding.observed


def test_missing_mask_and_block_size_and_a_reduced_vocab_without_maps(tmp_path):
    export = write_export(tmp_path / "spec", [1, 3, 5], speculators=True)
    config = json.loads((export / "config.json").read_text())
    del config["mask_token_id"], config["block_size"]
    config["draft_vocab_size"] = 32
    (export / "config.json").write_text(json.dumps(config))
    observed = contract(export).observed
    assert "mask_token_id is missing" in observed and "block_size None" in observed
    assert "the d2t map is missing" in observed and "the t2d map is missing" in observed


def test_a_training_run_is_not_an_export(tmp_path):
    assert contract(write_run(tmp_path / "run")).status == "unknown"


TEMPLATE = "{{ messages }}"


def chat_run(tmp_path, data_sha, prompts_sha, prompts_kwargs=None):
    return write_run(tmp_path, data={"chat_template_sha256": data_sha, "chat_template_kwargs": {}},
                     eval_report={"step": 1, "tau": 1.0, "prompts": {"chat_template_sha256": prompts_sha,
                                                                     "chat_template_kwargs": prompts_kwargs or {}}})


def consistency(run_dir):
    return check_chat_template_consistency(ContractContext(run=read_run(run_dir)))


def test_one_template_everywhere_matches(tmp_path):
    sha = template_sha256(TEMPLATE)
    assert consistency(chat_run(tmp_path / "r", sha, sha)).status == "match"


def test_another_template_or_thinking_mode_for_the_prompts_is_flagged(tmp_path):
    sha = template_sha256(TEMPLATE)
    other = consistency(chat_run(tmp_path / "a", sha, template_sha256(TEMPLATE + " ")))
    assert other.status == "mismatch" and "eval prompts template" in other.observed
    thinking = consistency(chat_run(tmp_path / "b", sha, sha, {"enable_thinking": True}))
    assert thinking.status == "mismatch" and "enable_thinking" in thinking.observed


def test_an_exported_drafters_declared_template_is_compared(tmp_path):
    sha = template_sha256(TEMPLATE)
    run = chat_run(tmp_path / "r", sha, sha)
    (run / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE + "x"}))
    finding = consistency(run)
    assert finding.status == "mismatch" and "exported drafter template" in finding.observed


def test_text_data_has_nothing_to_compare(tmp_path):
    assert consistency(write_run(tmp_path / "r")).status == "unknown"
