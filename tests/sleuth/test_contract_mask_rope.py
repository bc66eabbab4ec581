"""dflash.mask_token_distinct and dflash.rope_served_as_trained on real saved targets, run directories and exports."""

from __future__ import annotations

import json

import pytest
from contract_fixtures import save_target, write_run

from sleuth.checks import ContractContext
from sleuth.checks.mask_token import check_mask_token_distinct
from sleuth.checks.rope import check_rope_served_as_trained
from sleuth.probes.exported import served_rope
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


def drafter_record(theta: float = 1e6, partial: float = 1.0, head_dim: int = 8, layout: str | None = "neox",
                   draft_rope: dict | None = None) -> dict:
    """run.json `drafter` as the trainer writes it (README, run-directory contract): the rotation read off the
    module and `draft_config`, the config its exports write."""
    record = {"rope_parameters": {"rope_theta": theta, "rope_type": "default", "partial_rotary_factor": partial},
              "head_dim": head_dim, "rotary_dim": int(head_dim * partial), "num_attention_heads": 2, "hidden_size": 16,
              "draft_config": {"head_dim": head_dim, "num_attention_heads": 2,
                               "rope_parameters": draft_rope or {"rope_type": "default", "rope_theta": theta}}}
    if layout is not None:
        record["rope_layout"] = layout
    return record


def exported_drafter(path, layer: dict, trained: dict | None) -> tuple[dict, str]:
    config = {"speculators_model_type": "dflash", "transformer_layer_config": {"model_type": "qwen3", **layer}}
    if trained is not None:
        config["dflash_training"] = {"drafter": trained}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return config, str(path / "config.json")


def test_served_rope_is_compared_with_the_trained_one_not_with_the_target(tmp_path):
    # The target rotates a quarter of each head; the drafter trained rotating all of it and is served so: a match.
    partial_target = save_target(tmp_path / "partial", partial_rotary_factor=0.25)
    run = write_run(tmp_path / "v", target=partial_target, drafter=drafter_record())
    finding = check_rope_served_as_trained(context_for(run, target_dir=partial_target))
    assert finding.status == "match", (finding.observed, finding.reason)
    assert finding.evidence[1].location.endswith("run.json: drafter")


def test_the_targets_partial_factor_copied_into_the_export_is_flagged(tmp_path):
    partial_target = save_target(tmp_path / "partial", partial_rotary_factor=0.25)
    layer = {"head_dim": 8, "num_attention_heads": 2, "hidden_size": 16,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}}
    config, source = exported_drafter(tmp_path / "export", layer, drafter_record())
    finding = check_rope_served_as_trained(ContractContext(config=config, config_source=source, target_dir=partial_target))
    assert finding.status == "mismatch"
    assert "partial_rotary_factor 0.25 served, 1.0 trained" in finding.observed
    assert any("is the target's own" in note for note in finding.notes)  # the copy signature of speculators #613
    assert "drop partial_rotary_factor" in finding.fix.code_hint


def test_an_export_without_a_training_record_is_unknown(tmp_path):
    layer = {"head_dim": 8, "num_attention_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    config, source = exported_drafter(tmp_path / "export", layer, None)
    finding = check_rope_served_as_trained(ContractContext(config=config, config_source=source))
    assert finding.status == "unknown" and "nothing records" in finding.reason


def test_a_training_run_without_a_drafter_record_is_unknown(tmp_path, target):
    finding = check_rope_served_as_trained(context_for(write_run(tmp_path / "v", target=target)))
    assert finding.status == "unknown" and "run.json `drafter.draft_config`" in finding.reason


def test_a_training_runs_rotation_is_compared_with_the_config_its_exports_write(tmp_path, target):
    same = check_rope_served_as_trained(context_for(write_run(tmp_path / "same", drafter=drafter_record(1e6))))
    assert same.status == "match", same.observed
    other = check_rope_served_as_trained(context_for(write_run(
        tmp_path / "theta", drafter=drafter_record(1e6, draft_rope={"rope_type": "default", "rope_theta": 1e4}))))
    assert other.status == "mismatch" and "rope_theta 10000.0 served, 1000000.0 trained" in other.observed
    half = check_rope_served_as_trained(context_for(write_run(tmp_path / "half", drafter=drafter_record(1e6, partial=0.5))))
    assert half.status == "mismatch" and "partial_rotary_factor 1.0 served, 0.5 trained" in half.observed
    assert "set partial_rotary_factor to 0.5" in half.fix.code_hint
    unrecorded = check_rope_served_as_trained(context_for(write_run(tmp_path / "old", drafter=drafter_record(layout=None))))
    assert unrecorded.status == "match" and "pair layout" in unrecorded.notes[0]


def test_served_rope_reads_both_transformers_layouts():
    v4 = {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "hidden_size": 64,
          "num_attention_heads": 4}
    v5 = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, "head_dim": 16}
    assert served_rope(v4) == served_rope(v5)
    per_layer_type = {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "head_dim": 16}
    assert served_rope(per_layer_type)["rope_theta"] == 1e6
    assert served_rope({"is_neox_style": False, "head_dim": 8})["rope_layout"] == "interleaved"
