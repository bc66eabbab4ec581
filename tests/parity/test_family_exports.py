"""sleuth's variant checks on DFlash2 and DSpark drafters saved by speculators 0.9.0's own classes
(DFlash2DraftModel / DSparkDraftModel.save_pretrained): the clean exports raise no alarm and claim no match, the
variant is read from what speculators writes, and defects of the reported classes planted into those exports are
found (speculators #737's B-1 for DSpark, a layout the engine reads the other way, a flat DFlash2 config served
by an engine that reads nested fields).

Runs in speculators' own venv (`make parity`); skips elsewhere unless SPECULATORS_PARITY_REQUIRED=1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculators_guard import require_speculators

require_speculators()
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig  # noqa: E402
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

from sleuth.checks import ContractContext, apply_contract_checks  # noqa: E402
from sleuth.invariants import load_playbook  # noqa: E402
from sleuth.runs import read_run  # noqa: E402

BLOCK, VOCAB = 8, 64
RULES = {inv.id: inv for inv in load_playbook("dflash").invariants}


def save(directory: Path, kind: str, sample_from_anchor: bool) -> Path:
    """A tiny drafter of `kind`, built and saved by speculators; speculative_tokens as its own builder writes it
    (models/dflash/core.py:259)."""
    layer = Qwen3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    proposals = [GreedyTokenProposalConfig(speculative_tokens=BLOCK if sample_from_anchor else BLOCK - 1)]
    common = dict(transformer_layer_config=layer, draft_vocab_size=VOCAB, block_size=BLOCK,
                  aux_hidden_state_layer_ids=[3], mask_token_id=3, sample_from_anchor=sample_from_anchor,
                  speculators_config=SpeculatorsConfig(
                      algorithm=kind, proposal_methods=proposals, default_proposal_method="greedy",
                      verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])))
    if kind == "dflash2":
        model = DFlash2DraftModel(DFlash2SpeculatorConfig(**common, conv_group_size=8, selector_rank=4, selector_top_k=4))
    else:
        model = DSparkDraftModel(DSparkSpeculatorConfig(**common, markov_rank=4))
    model.save_pretrained(directory)
    return directory


def findings(directory: Path, served_by: str | None = None):
    info = read_run(directory)
    ctx = ContractContext(run=info, config=info.config, config_source=str(directory / "config.json"), rules=RULES,
                          served_by=served_by)
    return ctx.variant, {f.id: f for f in apply_contract_checks([], ctx)}


def edit(directory: Path, change) -> Path:
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(("kind", "anchor_first"), [("dflash2", False), ("dspark", True), ("dspark", False)])
def test_a_speculators_export_is_read_as_its_variant_without_alarm(tmp_path, kind, anchor_first):
    variant, found = findings(save(tmp_path / kind, kind, anchor_first))
    assert variant.kind == kind and variant.source.endswith("speculators_model_type") and not variant.notes
    assert [f"{i}: {f.observed}" for i, f in found.items() if f.status == "mismatch"] == []
    ours = [f for i, f in found.items() if i.startswith(kind + ".")]
    assert ours and all(f.status == "unknown" for f in ours) and any(f.static_agreement for f in ours)
    assert not [i for i in found if i.split(".")[0] in {"dflash2", "dspark", "domino", "jetspec"} - {kind}]


def test_speculators_737_b_minus_1_written_for_dspark(tmp_path):
    directory = edit(save(tmp_path / "dspark", "dspark", True),
                     lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=BLOCK - 1))
    finding = findings(directory)[1]["dspark.anchor_slot_trained"]
    assert finding.status == "mismatch" and "speculators #737" in finding.observed


def test_a_bonus_layout_dspark_served_by_an_engine_that_ignores_the_field(tmp_path):
    # SGLang #30852's class: trained with sample_from_anchor false, read anchor-first by the server.
    directory = save(tmp_path / "dspark", "dspark", False)
    assert findings(directory, "vllm")[1]["dspark.sample_from_anchor_served"].status == "unknown"
    finding = findings(directory, "specforge")[1]["dspark.sample_from_anchor_served"]
    assert finding.status == "mismatch" and "one position early" in finding.observed


def test_speculators_flat_dflash2_fields_served_by_an_engine_that_reads_nested_ones(tmp_path):
    directory = save(tmp_path / "dflash2", "dflash2", False)
    finding = findings(directory, "sglang")[1]["dflash2.served_layout"]
    assert finding.status == "mismatch" and "reads the nested layout" in finding.observed
    assert findings(directory, "vllm-v1")[1]["dflash2.served_layout"].status == "mismatch"
