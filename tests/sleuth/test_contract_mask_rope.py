"""dflash.mask_token_distinct and dflash.rope_matches_target on real saved targets and run directories."""

from __future__ import annotations

import json

import pytest
from contract_fixtures import save_target, write_run

from sleuth.checks import ContractContext
from sleuth.checks.mask_token import check_mask_token_distinct
from sleuth.checks.rope import check_rope_matches_target, rope_settings
from sleuth.runs import read_run


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("target") / "qwen3")


def context_for(run_dir, **kwargs) -> ContractContext:
    info = read_run(run_dir)
    return ContractContext(run=info, config=info.config, config_source=str(info.config_path), **kwargs)


def test_mask_token_equal_to_eos_is_flagged(tmp_path, target):
    run = write_run(tmp_path / "v", target=target, config={"mask_token_id": 0})  # 0 is <|endoftext|>, the eos
    finding = check_mask_token_distinct(context_for(run))
    assert finding.status == "mismatch"
    assert "eos" in finding.observed and "mask_token_id 0" in finding.observed


def test_mask_token_equal_to_pad_is_flagged(tmp_path, target):
    finding = check_mask_token_distinct(context_for(write_run(tmp_path / "v", target=target, config={"mask_token_id": 1})))
    assert finding.status == "mismatch" and "pad" in finding.observed


def test_dedicated_mask_token_matches_and_the_default_resolves_to_the_tokenizers(tmp_path, target):
    run = write_run(tmp_path / "v", target=target, data={"mask_token_count": 0})  # mask_token_id null
    finding = check_mask_token_distinct(context_for(run))
    assert finding.status == "match"
    assert "mask_token_id 5" in finding.observed  # <|mask|>, the tokenizer's mask token
    assert "training tokens" in finding.observed


def test_mask_token_found_in_the_training_data_is_flagged(tmp_path, target):
    run = write_run(tmp_path / "v", target=target, config={"mask_token_id": 5}, data={"mask_token_count": 12})
    finding = check_mask_token_distinct(context_for(run))
    assert finding.status == "mismatch" and "occurs 12 times" in finding.observed


def test_mask_token_without_a_readable_target_is_unknown(tmp_path):
    finding = check_mask_token_distinct(context_for(write_run(tmp_path / "v", target=tmp_path / "gone", config={"mask_token_id": 0})))
    assert finding.status == "unknown" and "not a directory" in finding.reason


def exported_drafter(path, target, **layer_overrides):
    layer = json.loads((target / "config.json").read_text())
    layer.update(num_hidden_layers=1, **layer_overrides)
    config = {"speculators_model_type": "dflash", "transformer_layer_config": layer,
              "speculators_config": {"verifier": {"name_or_path": str(target)}}}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_partial_rotary_factor_differing_from_the_target_is_flagged(tmp_path, target):
    export = exported_drafter(tmp_path / "export", target, partial_rotary_factor=0.5)
    config = json.loads((export / "config.json").read_text())
    finding = check_rope_matches_target(ContractContext(config=config, config_source=str(export / "config.json")))
    assert finding.status == "mismatch"
    assert "partial_rotary_factor 0.5 (target 1.0)" in finding.observed


def test_target_with_partial_rope_and_a_drafter_that_dropped_it(tmp_path):
    partial = save_target(tmp_path / "partial", partial_rotary_factor=0.25)
    layer = json.loads((partial / "config.json").read_text())
    layer.pop("partial_rotary_factor", None)
    layer.get("rope_parameters", {}).pop("partial_rotary_factor", None)
    config = {**layer, "dflash_config": {"target_layer_ids": [1], "mask_token_id": 5}}
    finding = check_rope_matches_target(ContractContext(config=config, target_dir=partial))
    assert finding.status == "mismatch" and "partial_rotary_factor 1.0 (target 0.25)" in finding.observed


def test_same_rope_matches(tmp_path, target):
    export = exported_drafter(tmp_path / "export", target)
    config = json.loads((export / "config.json").read_text())
    assert check_rope_matches_target(ContractContext(config=config)).status == "match"


def test_rope_settings_read_both_transformers_layouts():
    v4 = {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "hidden_size": 64,
          "num_attention_heads": 4}
    v5 = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, "head_dim": 16}
    assert rope_settings(v4) == rope_settings(v5)
    per_layer_type = {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "head_dim": 16}
    assert rope_settings(per_layer_type)["rope_theta"] == 1e6


def test_a_training_run_without_a_drafter_record_is_unknown(tmp_path, target):
    finding = check_rope_matches_target(context_for(write_run(tmp_path / "v", target=target)))
    assert finding.status == "unknown" and "run.json `drafter`" in finding.reason


def drafter_record(theta: float = 1e6, partial: float = 1.0, head_dim: int = 8) -> dict:
    """run.json `drafter` as the trainer writes it (README, run-directory contract)."""
    return {"rope_parameters": {"rope_theta": theta, "rope_type": "default", "partial_rotary_factor": partial},
            "head_dim": head_dim, "rotary_dim": int(head_dim * partial), "num_attention_heads": 2, "hidden_size": 16}


def test_a_training_runs_recorded_rope_is_compared_with_its_target(tmp_path, target):
    theta = json.loads((target / "config.json").read_text())["rope_parameters"]["rope_theta"]
    same = check_rope_matches_target(context_for(write_run(tmp_path / "same", target=target,
                                                           drafter=drafter_record(theta))))
    assert same.status == "match", same.observed
    assert same.evidence[0].location.endswith("run.json: drafter")
    other_theta = check_rope_matches_target(context_for(write_run(tmp_path / "theta", target=target,
                                                                  drafter=drafter_record(theta / 100))))
    assert other_theta.status == "mismatch" and f"rope_theta {theta / 100!r} (target {float(theta)!r})" in other_theta.observed
    half = check_rope_matches_target(context_for(write_run(tmp_path / "half", target=target,
                                                           drafter=drafter_record(theta, partial=0.5))))
    assert half.status == "mismatch" and "partial_rotary_factor 0.5 (target 1.0)" in half.observed
