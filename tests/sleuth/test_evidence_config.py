"""Config evidence: readers turn a run's resolved config into the playbook's canonical values."""

from __future__ import annotations

import json
from pathlib import Path

from sleuth.evidence.config import RunMeta, find_run_meta, lookup, read_config
from sleuth.oracle import target_layer_ids


def test_zlab_rule_matches_known_values():
    assert target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert target_layer_ids(36, 1) == [18]


def test_fc_layers_reader():
    ids = [1, 2, 3, 4, 5]
    assert read_config("fc_layers", {"fc_layers": None, "target_layer_ids": ids}, ["fc_layers"], RunMeta()).value == "all"
    assert read_config("fc_layers", {"fc_layers": [0, 1, 2, 3, 4], "target_layer_ids": ids}, ["fc_layers"], RunMeta()).value == "all"
    assert read_config("fc_layers", {"fc_layers": [0, 1, 2, 3], "target_layer_ids": ids}, ["fc_layers"], RunMeta()).value == "subset"
    assert read_config("fc_layers", {"target_layer_ids": ids}, ["fc_layers"], RunMeta()) is None


def test_logits_source_and_anchor_readers():
    meta = RunMeta(num_layers=8)
    assert read_config("logits_source", {"target_logits_source": "final"}, ["target_logits_source"], meta).value == "final"
    assert read_config("logits_source", {"target_logits_source": 5}, ["target_logits_source"], meta).value == "intermediate"
    assert read_config("context_includes_anchor", {"context_includes_anchor": True}, ["context_includes_anchor"], meta).value == "kv <= anchor"
    assert read_config("context_includes_anchor", {"context_includes_anchor": False}, ["context_includes_anchor"], meta).value == "kv < anchor"


def test_nested_keys_of_other_trainers():
    config = {"training": {"dflash": {"dflash_decay_gamma": 7.0}}}
    assert lookup(config, ["loss_decay_gamma", "dflash_decay_gamma"]) == ("training.dflash.dflash_decay_gamma", 7.0)
    assert read_config("number", config, ["dflash_decay_gamma"], RunMeta()).value == 7.0


def test_a_nested_group_is_not_a_value_but_a_top_level_mapping_is():
    # speculators' own run.yaml (TrainConfig.dump_yaml) groups its settings: `train.loss` is {loss_fn: ce}.
    # Taken as the value of the playbook's `loss` key it was an input problem on every speculators run.yaml.
    grouped = {"train": {"loss": {"loss_fn": "ce"}, "dflash": {"block_size": 16}}}
    assert lookup(grouped, ["loss", "loss_fn"]) == ("train.loss.loss_fn", "ce")
    assert read_config("loss_kind", grouped, ["loss", "loss_fn", "loss_kind"], RunMeta()).value == "ce"
    assert lookup({"train": {"loss": {"loss_implementation": "eager"}}}, ["loss", "loss_fn"]) is None
    # a flat config's wrong-typed value is still found, so it is reported rather than skipped
    assert lookup({"loss": {"kind": "ce"}}, ["loss", "loss_fn"]) == ("loss", {"kind": "ce"})


def test_a_dpace_weighting_is_read_before_any_gamma_beside_it():
    keys = ["loss_decay_gamma", "dflash_decay_gamma", "decay_gamma", "gamma"]
    for config in ({"loss_weighting": "dpace", "loss_decay_gamma": 7.0},  # ours (recipe-2026)
                   {"train": {"dflash": {"per_position_loss_weight": "dpace"}}},  # speculators' run.yaml
                   {"training": {"loss_type": "dpace", "loss_decay_gamma": 7}}):  # SpecForge's recipe
        reading = read_config("decay_gamma", config, keys, RunMeta())
        assert reading.value == "D-PACE" and "gamma is not used" in reading.detail, config
    assert read_config("decay_gamma", {"loss_weighting": "decay", "loss_decay_gamma": 7}, keys, RunMeta()).value == 7.0
    assert read_config("decay_gamma", {"training": {"loss_type": "dflash", "loss_decay_gamma": None}}, keys,
                       RunMeta()).value is None  # SpecForge's no decay stays a value, not "absent"
    assert read_config("decay_gamma", {"block_size": 16}, keys, RunMeta()) is None


def test_a_loss_word_is_read_by_its_parts():
    from sleuth.evidence.config import loss_kind_of_word

    # the spellings of blind trainers' configs (a run_out/config.json beside the code) and of libraries
    assert {w: loss_kind_of_word(w) for w in ("ce_target_argmax", "hard_ce", "CrossEntropyLoss", "nll_loss")} == \
        dict.fromkeys(("ce_target_argmax", "hard_ce", "CrossEntropyLoss", "nll_loss"), "ce")
    assert {w: loss_kind_of_word(w) for w in ("kl_soft_target", "KLDivLoss", "forward_kl", "soft_ce")} == \
        dict.fromkeys(("kl_soft_target", "KLDivLoss", "forward_kl", "soft_ce"), "kl")
    assert loss_kind_of_word("ce_data_tokens") == "ce (data tokens)"
    assert loss_kind_of_word("mse") == "other:mse" and loss_kind_of_word("reverse_kl") == "other:reverse_kl"
    assert loss_kind_of_word("my_loss_v2") is None and loss_kind_of_word("ce+kl") is None
    # a word no rule knows decides nothing (it was "other:<word>", a mismatch)
    reading = read_config("loss_kind", {"loss": "my_loss_v2"}, ["loss"], RunMeta())
    assert reading.value is None and reading.confidence == 0.0


def test_layer_ids_need_the_target_depth():
    reading = read_config("target_layer_ids", {"target_layer_ids": [1, 9, 17, 25, 33]}, ["target_layer_ids"], RunMeta())
    assert reading.value is None and "unknown" in reading.detail
    vllm = read_config("target_layer_ids", {"target_layer_ids": [2, 18, 33]}, ["target_layer_ids"], RunMeta(num_layers=36))
    assert vllm.value.startswith("custom") and "vLLM" in vllm.notes[0]


def test_run_meta_found_beside_config_or_above_checkpoint(tmp_path: Path):
    (tmp_path / "run.json").write_text(json.dumps({"target": {"num_layers": 36, "hidden_size": 64}}))
    assert find_run_meta(str(tmp_path / "config.json"), None).num_layers == 36
    ckpt = tmp_path / "checkpoints" / "step-1" / "drafter.safetensors"
    assert find_run_meta(None, ckpt).num_layers == 36
    assert find_run_meta(None, None).num_layers is None
