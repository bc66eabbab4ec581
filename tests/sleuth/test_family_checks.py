"""The DFlash family's variant checks (sleuth/checks/family.py) on tiny exports written as the upstream loaders read
them (tests/sleuth/family_fixtures.py): every planted defect of a reported class is found, the clean exports of each
variant raise no alarm, static agreement is never claimed as a match, and a plain DFlash export gets nothing new."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from family_fixtures import LAYER_CONFIG, SLIDING, B, base_shapes, clean, dflash2_shapes, dspark_shapes, planted, write_export
from typer.testing import CliRunner

from sleuth.checks import ContractContext, apply_contract_checks
from sleuth.evidence.variant import detect_variant
from sleuth.invariants import check_invariants, load_playbook
from sleuth.runs import read_run
from sleuth.trace import Trace

PLAYBOOK = load_playbook("dflash")
RULES = {inv.id: inv for inv in PLAYBOOK.invariants}
FAMILY_IDS = {i for i in RULES if not i.startswith("dflash.")}
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "invariants"


def contract(directory: Path, served_by: str | None = None) -> dict[str, object]:
    info = read_run(directory)
    ctx = ContractContext(run=info, config=info.config, config_source=str(directory / "config.json"),
                          rules=RULES, served_by=served_by)
    return {f.id: f for f in apply_contract_checks([], ctx)}


CLEAN = [("dflash2", "flat"), ("dflash2", "nested"), ("dspark", "flat"), ("dspark", "nested"), ("domino", "nested"),
         ("jetspec", "nested")]


@pytest.mark.parametrize(("variant", "layout"), CLEAN, ids=[f"{v}-{lay}" for v, lay in CLEAN])
def test_a_clean_export_raises_no_alarm_and_claims_no_match(tmp_path, variant, layout):
    findings = contract(write_export(tmp_path / "e", *clean(variant, layout)))
    ours = {i: f for i, f in findings.items() if i in FAMILY_IDS}
    assert ours and all(i.startswith(variant + ".") for i in ours)  # only this variant's invariants run
    assert [f"{i}: {f.observed}" for i, f in findings.items() if f.status == "mismatch"] == []
    assert all(f.status == "unknown" for f in ours.values())  # static reading never makes a match
    assert any(f.static_agreement for f in ours.values())


# The planted defects (one per reported class) are tests/fixtures/invariants/<id>/invalid_*.json, run by
# test_contract_fixtures.py with the words each finding must say.


def test_every_family_invariant_ships_a_planted_defect_and_a_clean_export():
    for invariant in FAMILY_IDS:
        names = [f.name for f in (FIXTURES / invariant).glob("*.json")]
        assert any(n.startswith("invalid_") for n in names) and any(n.startswith("valid_") for n in names), invariant


def test_the_same_export_served_as_trained_is_not_flagged(tmp_path):
    directory = write_export(tmp_path / "e", *planted("dspark", "flat", {"sample_from_anchor": False,
        "speculators_config.proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": B - 1}]}))
    for engine in ("sglang", "vllm", "llama.cpp"):  # each reads a stated speculators-layout field
        finding = contract(directory, engine)["dspark.sample_from_anchor_served"]
        assert finding.status == "unknown" and finding.static_agreement, (engine, finding.observed)
    assert contract(directory, "specforge")["dspark.sample_from_anchor_served"].status == "mismatch"  # ignores it


def test_the_variant_is_read_from_each_marker():
    config, shapes = clean("dspark", "flat")
    assert detect_variant({"drafter_kind": "dflash2", "block_size": 8}).describe().startswith("dflash2 (config.json drafter_kind")
    assert detect_variant(config).kind == "dspark"
    assert detect_variant(clean("dflash2", "nested")[0]).source.endswith("architectures DFlash2DraftModel")
    assert detect_variant(clean("domino", "nested")[0]).kind == "domino"
    assert detect_variant(None, tensor_names=list(shapes)).source == "checkpoint tensors"
    plain = detect_variant({"block_size": 8, "speculators_model_type": "dflash"})
    assert plain.kind == "dflash" and plain.marked
    assert not detect_variant({"block_size": 8}).marked
    conflict = detect_variant({"drafter_kind": "dflash"}, tensor_names=["markov_head.markov_w1.weight"])
    assert conflict.kind == "dflash" and "conflict" in conflict.notes[0] and "dspark" in conflict.notes[0]


ANCHOR_CODE = FIXTURES / "dflash.anchor_slot_untrained"


@pytest.mark.parametrize(("code", "status", "stated"), [
    ("valid_zeroed.py", "mismatch", True), ("invalid_not_zeroed.py", "unknown", True),
    ("valid_zeroed.py", "mismatch", False), ("invalid_not_zeroed.py", "unknown", False),
])
def test_slot_0_zeroed_in_an_anchor_first_dspark_is_a_mismatch(tmp_path, code, status, stated):
    # The same code reads the other way round once the run drafts from the anchor: zeroing slot 0 is the defect.
    # Unstated, DSpark's layout is every reference's: anchor-first.
    config = {"drafter_kind": "dspark", "block_size": 8, **({"sample_from_anchor": True} if stated else {})}
    (tmp_path / "config.json").write_text(json.dumps(config))
    findings = check_invariants(PLAYBOOK, config=config, config_source=str(tmp_path / "config.json"),
                                code=ANCHOR_CODE / code, trace=Trace())
    ctx = ContractContext(config=config, config_source=str(tmp_path / "config.json"), rules=RULES)
    decided = {f.id: f for f in apply_contract_checks(findings, ctx)}
    assert decided["dspark.anchor_slot_trained"].status == status
    assert decided["dflash.anchor_slot_untrained"].status == status
    assert not any(i.startswith(("dflash2.", "domino.", "jetspec.")) for i in decided)


def test_a_plain_dflash_export_gets_nothing_new(tmp_path, monkeypatch):
    from sleuth.commands.diagnose import app

    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "cache"))
    directory = write_export(tmp_path / "plain", *clean("dflash", "nested"))
    result = CliRunner().invoke(app, ["--run", str(directory), "--offline", "--format", "json"])
    report = json.loads(result.stdout)
    ids = {f["id"] for f in report["findings"]}
    assert ids and not ids & FAMILY_IDS
    assert report["inputs"]["variant"].startswith("dflash (no variant marker")
    assert not {rule["id"] for rule in report["rules"]} & FAMILY_IDS  # nor their rules in the report
    assert [f["id"] for f in report["findings"] if f["status"] == "mismatch"] == []


def test_diagnose_names_the_variant_and_finds_the_defect(tmp_path, monkeypatch):
    from sleuth.commands.diagnose import app

    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "cache"))
    directory = write_export(tmp_path / "dspark", *planted("dspark", "flat", {
        "speculators_config.proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": B - 1}]}))
    result = CliRunner().invoke(app, ["--run", str(directory), "--offline", "--format", "json", "--served-by", "vllm"])
    report = json.loads(result.stdout)
    assert result.exit_code == 1
    assert report["inputs"]["variant"].startswith("dspark (") and "speculators_model_type" in report["inputs"]["variant"]
    findings = {f["id"]: f for f in report["findings"]}
    assert findings["dspark.anchor_slot_trained"]["status"] == "mismatch"
    assert not {i for i in findings if i.startswith(("dflash2.", "domino.", "jetspec."))}
    assert "Drafter variant: dspark" in (directory / "diagnosis" / "report.md").read_text()


def write_own_run(path: Path, config: dict, shapes: dict, drafter: dict) -> Path:
    """Our trainer's run directory (run-directory contract): config.json with `drafter_kind`, run.json `drafter`,
    the newest checkpoint's drafter.safetensors."""
    import numpy as np
    from contract_fixtures import write_run
    from safetensors.numpy import save_file

    write_run(path, config=config, drafter=drafter)
    step = path / "checkpoints" / "step-00000040"
    step.mkdir(parents=True)
    save_file({name: np.zeros(shape, np.float32) for name, shape in shapes.items()}, str(step / "drafter.safetensors"))
    (path / "checkpoints" / "latest").write_text("step-00000040")
    return path


def own_run_findings(path: Path) -> dict:
    info = read_run(path)
    ctx = ContractContext(run=info, config=info.config, config_source=str(info.config_path), rules=RULES)
    assert ctx.variant.source.endswith("drafter_kind")
    return {f.id: f for f in apply_contract_checks([], ctx)}


DSPARK_RUN = {"drafter_kind": "dspark", "sample_from_anchor": True, "markov_rank": 4, "confidence_head_with_markov": True}


@pytest.mark.parametrize(("name", "config", "shapes", "invariant"), [
    ("clean", DSPARK_RUN, dspark_shapes(), None),
    ("w1_reduced", DSPARK_RUN, {**dspark_shapes(), "markov_head.markov_w1.weight": [32, 4]}, "dspark.markov_shapes"),
    ("rank_0_with_markov", {**DSPARK_RUN, "markov_rank": 0}, base_shapes(), "dspark.markov_shapes"),
])
def test_our_own_dspark_run_is_read_from_its_config_and_checkpoint(tmp_path, name, config, shapes, invariant):
    found = own_run_findings(write_own_run(tmp_path / name, config, shapes, {"draft_config": dict(LAYER_CONFIG)}))
    mismatches = sorted(i for i, f in found.items() if f.status == "mismatch")
    assert mismatches == ([invariant] if invariant else [])
    assert found["dspark.markov_shapes"].evidence


def test_our_own_dflash2_run_trained_causal_in_sliding_layers(tmp_path):
    layer = {**LAYER_CONFIG, **SLIDING}
    config = {"drafter_kind": "dflash2", "conv_kernel_size": 2, "conv_group_size": 8}
    clean_run = own_run_findings(write_own_run(tmp_path / "clean", config, dflash2_shapes(),
                                               {"draft_config": layer, "sliding_window_non_causal": True}))
    assert [i for i, f in clean_run.items() if f.status == "mismatch"] == []
    causal = own_run_findings(write_own_run(tmp_path / "causal", config, dflash2_shapes(),
                                            {"draft_config": layer, "sliding_window_non_causal": False}))
    assert causal["dflash2.noncausal_swa"].status == "mismatch"


def test_a_named_variant_is_not_overruled_by_default_fields_of_the_others():
    # A resolved config carries every variant's fields at their defaults: drafter_kind decides.
    config = {"drafter_kind": "dflash", "conv_kernel_size": 2, "markov_rank": 256, "selector_top_k": 16}
    variant = detect_variant(config)
    assert variant.kind == "dflash" and variant.marked and not variant.notes
