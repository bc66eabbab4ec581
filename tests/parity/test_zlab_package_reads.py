"""z-lab's own package (dflash 0.1.0) and SpecForge 0.2.0 build the published Qwen3.6-27B drafter
(tests/fixtures/published/) and our real-size `zlab-qwen3.6-27b` export config into the same modules: per-layer
window and causality, heads, taps, block, mask token, rotary. Their constructors run (on the meta device: no
27B-sized weights are allocated); nothing of their reading is re-implemented here.

Runs in the reference venv (`make parity`); skips elsewhere unless SPECULATORS_PARITY_REQUIRED=1.
"""

from __future__ import annotations

import pytest
import torch

from speculators_guard import REQUIRED

try:
    from dflash.model import DFlashDraftModel as ZlabDraftModel
    from specforge.modeling.draft.dflash import DFlashDraftModel as SpecForgeDraftModel
except Exception as exc:  # ImportError, or a broken install
    if REQUIRED:
        pytest.fail(f"SPECULATORS_PARITY_REQUIRED=1 but dflash / specforge do not import: {exc!r}", pytrace=False)
    pytest.skip(f"dflash 0.1.0 / SpecForge are not importable here ({type(exc).__name__})", allow_module_level=True)

from transformers import Qwen3Config  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding  # noqa: E402

from tests.trainer.test_published_drafter import PUBLISHED, exported_config, real_target_config  # noqa: E402


def built(model_class, config_json: dict) -> dict:
    """What the package's DFlashDraftModel builds from a config.json (as from_pretrained reads it)."""
    config = Qwen3Config.from_dict(dict(config_json))
    with torch.device("meta"):
        model = model_class(config)
    attention = [layer.self_attn for layer in model.layers]
    return {
        "layer_windows": [a.sliding_window for a in attention],
        "layer_causal": [bool(getattr(a, "is_causal", False)) for a in attention],
        "heads": [(a.q_proj.out_features // a.head_dim, a.k_proj.out_features // a.head_dim, a.head_dim)
                  for a in attention],
        "target_layer_ids": list(model.target_layer_ids),
        "fc_in": model.fc.in_features,
        "block_size": model.block_size,
        "mask_token_id": model.mask_token_id,
        # the package's own config object, through the rotary class its model uses
        "inv_freq": Qwen3RotaryEmbedding(model.config).inv_freq,
    }


@pytest.mark.parametrize("model_class", [ZlabDraftModel, SpecForgeDraftModel], ids=["zlab-0.1.0", "specforge-0.2.0"])
def test_the_package_builds_the_published_drafter_from_our_export(model_class):
    published = PUBLISHED["drafter"]
    ours = exported_config("zlab-qwen3.6-27b", real_target_config(), published["dflash_config"]["mask_token_id"])
    theirs, read = built(model_class, published), built(model_class, ours)
    assert read["layer_windows"] == [2048] * 4 + [None]
    assert read["heads"] == [(32, 8, 128)] * 5 and read["inv_freq"].numel() * 2 == 128  # the whole head rotates
    for key in set(theirs) - {"inv_freq"}:
        assert read[key] == theirs[key], key
    torch.testing.assert_close(read["inv_freq"], theirs["inv_freq"], rtol=0, atol=0)


def test_zlab_0_1_0_makes_the_sliding_layers_causal_and_specforge_does_not():
    mask = PUBLISHED["drafter"]["dflash_config"]["mask_token_id"]
    ours = exported_config("zlab-qwen3.6-27b", real_target_config(), mask)
    assert built(ZlabDraftModel, ours)["layer_causal"] == [True] * 4 + [False]
    assert built(SpecForgeDraftModel, ours)["layer_causal"] == [False] * 5


def test_a_window_without_use_sliding_window_is_built_full_attention():
    # The gate that serves a sliding drafter as full attention: the same config without the flag (z-lab then
    # builds no window; SpecForge refuses a sliding layer without one).
    published = {k: v for k, v in PUBLISHED["drafter"].items() if k != "use_sliding_window"}
    assert built(ZlabDraftModel, published)["layer_windows"] == [None] * 5
    with pytest.raises(ValueError, match="use_sliding_window=true"):
        built(SpecForgeDraftModel, published)
