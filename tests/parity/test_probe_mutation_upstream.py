"""The probes under mutation on upstream code: speculators 0.9.0 and SpecForge 0.2.0's DFlash, installed here.

tests/probes/probe_mutation.py applies its generic operators to the functions of each package that hold
the DFlash rules (the site maps below), keeps the mutants that change what the code computes on the
probe's tiny batch under one of the configurations (the others are counted and printed as equivalent or
crashing), and probes each in its own process, the mutated copy first on sys.path. The bar: no mutant that
changes behaviour comes back all-match, and the unmodified packages have no mismatch under any
configuration. Recall is printed. Runs under `make parity`; without speculators it skips (a failure with
SPECULATORS_PARITY_REQUIRED=1). Nothing upstream is copied into the repository.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from speculators_guard import require_speculators

require_speculators()

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.probes.probe_mutation import score_package  # noqa: E402

JOBS = int(os.environ.get("PROBE_MUTATION_JOBS", "2"))
FIXTURES = REPO / "tests" / "fixtures"

SPECULATORS_SITES = {
    "models/dflash/attention.py": ("*",),
    "models/dflash/utils.py": ("*",),
    "models/dflash/core.py": ("DFlashDraftModel._backbone_forward", "DFlashDraftModel._build_attention_mask",
                              "DFlashDraftModel.get_trainer_kwargs", "DFlashDraftModel.forward",
                              "DFlashDraftModel._build_base_config_kwargs"),
    "models/dflash/metrics.py": ("compute_metrics",),
    "models/dflash/model_definitions.py": ("apply_rotary_pos_emb", "Qwen3DFlashAttention.forward"),
    "losses/utils.py": ("dflash_loss_decay", "dpace_loss_decay", "loss_function"),
    "losses/eager.py": ("ce_loss",),
    "models/utils.py": ("resolve_target_layer_ids",),
    "model.py": ("DraftVocabMixin._init_vocab", "DraftVocabMixin._load_verifier_weights"),
    "train/utils.py": ("resolve_mask_token_id",),
}
# A run.yaml with a full-attention layer and a non-default fixed gamma (so a gamma that does not reach the
# loss shows, and so does the bidirectional block), then speculators' own defaults (D-PACE, sliding layers).
SPECULATORS_CONFIGS = [
    {"config": {"train": {"speculator_type": "dflash",
                          "draft": {"num_layers": 2, "full_attention_indices": [0]},
                          "dflash": {"block_size": 8, "per_position_loss_weight": "fixed-exp-decay",
                                     "dflash_decay_gamma": 7.0},
                          "optimizer": {"optimizer": "adamw"}}}},
    {"config": None},
]
SPECFORGE_SITES = {
    "algorithms/common/dflash_family_model.py": (
        "create_dflash_sdpa_mask", "OnlineDFlashModel._sample_anchor_positions", "OnlineDFlashModel._create_position_ids",
        "OnlineDFlashModel._create_noise_embed", "OnlineDFlashModel._dpace_weight",
        "OnlineDFlashModel._forward_draft_blocks", "OnlineDFlashModel._dflash_objective_chunk_terms",
        "OnlineDFlashModel.forward"),
    "modeling/draft/dflash.py": ("apply_rotary_pos_emb", "Qwen3DFlashAttention.forward", "build_target_layer_ids",
                                 "extract_context_feature", "DFlashDraftModel.forward"),
    "training/model_utils.py": ("resolve_mask_token_id",),
    "algorithms/model_providers.py": ("_build_dflash_family_model", "populate_dflash_generated_config"),
}
# The test recipe with gamma 7 and its two-layer draft config, SpecForge's defaults, and D-PACE with a
# three-layer drafter whose ids SpecForge's override path computes (build_target_layer_ids for k = 3).
SPECFORGE_CONFIGS = [
    {"config_path": str(FIXTURES / "specforge" / "recipe-sf-tiny-gamma7.yaml")},
    {"config": None},
    {"config": {"model": {"draft_num_hidden_layers": 3}, "training": {"strategy": "dflash", "loss_type": "dpace"}}},
]


def _installed(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} is not installed here (the reference venv: bench/setup_speculators_env.sh)")
    return Path(next(iter(spec.submodule_search_locations)))


def _with_recipes(configs: list[dict]) -> list[dict]:
    import yaml

    return [{**c, "config": yaml.safe_load(Path(c["config_path"]).read_text())} if c.get("config_path") else c
            for c in configs]


def _check(score) -> None:
    table = score.table()
    print("\n" + table)
    assert not score.baseline_errors, table
    assert score.baseline_mismatches == [], table
    assert score.silent == [], table
    assert len(score.planted) >= 8, table  # enough mutants changed behaviour for the bar to mean something


# ~2 min each on 2 cores: with the probes catalog in `make parity-catalog`, so CI (`make test` + `make parity`)
# stays well under 15 minutes; the example's mutation suite (tests/probes/test_probe_mutation.py) is in CI.
@pytest.mark.catalog
def test_speculators_mutants_are_never_vouched_for():
    package = _installed("speculators")
    _check(score_package("speculators", "speculators", package, SPECULATORS_SITES, SPECULATORS_CONFIGS,
                         sys.executable, per_operator=2, total=24, jobs=JOBS))


@pytest.mark.catalog
def test_specforge_mutants_are_never_vouched_for():
    pytest.importorskip("specforge.algorithms.common.dflash_family_model",
                        reason="SpecForge 0.2.0 is installed by bench/setup_speculators_env.sh")
    package = _installed("specforge")
    _check(score_package("specforge", "specforge", package, SPECFORGE_SITES, _with_recipes(SPECFORGE_CONFIGS),
                         sys.executable, per_operator=3, total=28, jobs=JOBS))
