"""Config validation: the reference values are the defaults, presets encode the seed's history, and
every user mistake is one clear line."""

import json

import pytest

from trainer.config import (
    PRESETS,
    ConfigError,
    TrainConfig,
    build_config,
    default_target_layer_ids,
    resolve_for_target,
)


def test_defaults_are_the_reference_values():
    config = TrainConfig()
    assert config.block_size == 8
    assert config.loss_decay_gamma == 4.0
    assert config.fc_layers is None
    assert config.target_logits_source == "final"
    assert config.context_includes_anchor is False
    assert config.loss == "ce"


@pytest.mark.parametrize(
    ("layers", "k", "expected"),
    [(64, 5, [1, 16, 31, 46, 61]), (36, 5, [1, 9, 17, 25, 33]), (36, 1, [18]), (8, 5, [1, 2, 3, 4, 5])],
)
def test_z_lab_layer_rule(layers, k, expected):
    assert default_target_layer_ids(layers, k) == expected


def test_v5_preset_resolves_to_the_seed_bugs():
    config = resolve_for_target(build_config(preset="v5"), num_target_layers=8)
    assert config.target_layer_ids == [1, 2, 3, 4, 5]
    assert config.fc_layer_ids(8) == [1, 2, 3, 4]  # 4 of the 5 selected layers
    assert config.target_logits_source == 5  # L-3: the last selected layer
    assert config.loss_decay_gamma == 7.0
    assert config.block_size == 8


def test_fixed_preset_is_exactly_the_defaults():
    assert PRESETS["fixed"] == {}
    assert build_config(preset="fixed") == TrainConfig()


def test_v6_only_leaks_the_anchor():
    config = build_config(preset="v6")
    assert config.context_includes_anchor is True
    assert config.model_dump(exclude={"context_includes_anchor"}) == TrainConfig().model_dump(
        exclude={"context_includes_anchor"}
    )


def test_layering_preset_file_set(tmp_path):
    config_file = tmp_path / "c.yaml"
    config_file.write_text("loss_decay_gamma: 5.5\nsteps: 10\n")
    config = build_config(
        preset="v5", config_file=config_file, overrides=["steps=20", "fc_layers=null"], extra={"steps": 15}
    )
    assert config.loss_decay_gamma == 5.5  # file over preset
    assert config.steps == 20  # --set over --steps over file
    assert config.fc_layers is None  # --set null


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"overrides": ["gama=4"]}, "unknown config key 'gama' in --set 'gama=4' (did you mean"),
        ({"overrides": ["block_size"]}, "--set expects key=value"),
        ({"overrides": ["block_size=0"]}, "block_size"),
        ({"overrides": ["loss=mse"]}, "loss"),
        ({"overrides": ["fc_layers=[0,7]"]}, "outside the 5 selected target layers"),
        ({"overrides": ["target_layer_ids=[3,1]"]}, "increasing order"),
        ({"overrides": ["seq_len=8"]}, "must exceed block_size"),
        ({"preset": "v9"}, "unknown preset 'v9'"),
    ],
)
def test_config_errors_are_one_clear_line(kwargs, message):
    with pytest.raises(ConfigError) as excinfo:
        build_config(**kwargs)
    text = str(excinfo.value)
    assert message in text
    assert "\n" not in text


def test_unknown_key_in_file(tmp_path):
    config_file = tmp_path / "c.json"
    config_file.write_text(json.dumps({"loss_decay_gama": 4}))
    with pytest.raises(ConfigError, match="unknown config key 'loss_decay_gama'.*did you mean 'loss_decay_gamma'"):
        build_config(config_file=config_file)


def test_layer_ids_past_the_target_are_refused():
    config = build_config(overrides=["target_layer_ids=[1,2,9]"])
    with pytest.raises(ConfigError, match="past the target's last"):
        resolve_for_target(config, num_target_layers=8)


def test_saved_config_round_trips():
    config = resolve_for_target(build_config(preset="v5"), 8)
    again = TrainConfig(**json.loads(json.dumps(config.model_dump(mode="json"))))
    assert again == config


@pytest.mark.parametrize("override", ["target_logits_source=true", "steps=true", "fc_layers=[true,1]"])
def test_booleans_are_not_layer_ids_or_counts(override):
    # pydantic alone would read `true` as 1 and train toward layer 1's logits without a word.
    with pytest.raises(ConfigError, match="not a boolean"):
        build_config(overrides=[override])


# --- the drafter's own shape -----------------------------------------------------------------------------


def test_draft_config_defaults_to_the_targets_shape():
    config = TrainConfig()
    assert config.draft_config.model_dump() == {
        "num_attention_heads": None, "num_key_value_heads": None, "head_dim": None, "intermediate_size": None,
        "layer_types": None, "sliding_window": None, "sliding_window_non_causal": False, "rope_theta": None,
        "rope_parameters": None,
    }
    assert json.loads(config.model_dump_json())["draft_config"]["layer_types"] is None  # saved in config.json


@pytest.mark.parametrize(("overrides", "message"), [
    (["draft_config.sliding_window=32"], "sliding_window 32 is set but no layer is sliding_attention"),
    (["draft_config.layer_types=[sliding, sliding, sliding, sliding, full]"], "layer_types.0: Input should be 'full_attention' or"),
    (["draft_config={layer_types: [sliding_attention, full_attention], sliding_window: 16}"],
     "names 2 layers but draft_layers is 5"),
    (["draft_layers=1", "draft_config={layer_types: [sliding_attention], sliding_window: 4}"],
     "sliding_window 4 must be at least block_size 8"),
    (["draft_layers=1", "draft_config={layer_types: [sliding_attention]}"], "sliding_attention layers but no sliding_window"),
    (["draft_config.sliding_window_non_causal=true"], "only applies to sliding_attention layers"),
    (["draft_config.num_attention_heads=6", "draft_config.num_key_value_heads=4"], "6 is not divisible by num_key_value_heads 4"),
    (["draft_config.head_dim=7"], "head_dim 7 must be even"),
    (["draft_config.rope_parameters={rope_type: default, partial_rotary_factor: 0.25}"], "rotate the whole head"),
    (["draft_config.rope_parameters={rope_type: default, mrope_section: [11, 11, 10]}"], "1-D text positions"),
    (["draft_config.rope_theta=1e7", "draft_config.rope_parameters={rope_theta: 1e6}"], "both rope_theta and rope_parameters"),
    (["draft_config.num_attention_heads=true"], "not a boolean"),
    (["draft_config.slidng_window=3"], "did you mean 'draft_config.sliding_window'?"),
])
def test_draft_config_mistakes_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        build_config(overrides=overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_config_file_section_merges_over_the_presets(tmp_path):
    config_file = tmp_path / "c.yaml"
    config_file.write_text("draft_config:\n  sliding_window: 64\n")
    config = build_config(preset="zlab-qwen3.6", config_file=config_file, overrides=["draft_config.head_dim=32"])
    assert config.draft_config.sliding_window == 64 and config.draft_config.head_dim == 32
    assert config.draft_config.layer_types == ["sliding_attention"] * 4 + ["full_attention"]  # the preset's
    assert PRESETS["zlab-qwen3.6"]["draft_config"]["sliding_window"] == 32  # the preset itself is untouched
    assert build_config(overrides=["draft_config={}"]).draft_config == TrainConfig().draft_config
