"""The contract invariants' valid and invalid fixtures (tests/fixtures/invariants/<id>/, JSON specs), run
through their checks in sleuth.checks: valid -> match, invalid -> mismatch (with `expect` in what it says).

Spec keys (all optional): "config" (the run's config.json), "run" (run.json `data` and `drafter`), "eval" (eval.json),
"findings" ({id: status} of the other checks), "target" ({config overrides}: a tiny Qwen3 target is saved),
"export_layer_config" (a speculators export whose layer config is the target's plus these keys),
"export" ({"format", "layer_ids", "rename", "aux_hidden_state_layer_ids"}: an exported directory),
"hidden_states" ({"aux_hidden_state_layer_ids", "stored": HF indices or "final" / "final_normed"}),
"export_config" (an exported drafter's whole config.json, written as is; "target_tensors" then names the
target's weights: a target directory with that config and a model.safetensors.index.json is written),
"export_tensors" (with "export_config": a whole export, {tensor: shape} in model.safetensors; "served_by" the engine;
"static": true on a valid one, which then reads as unknown with static agreement, never a match),
"specforge_run" (a run under tests/fixtures/specforge/outputs, read by sleuth; with "target_rename" its
verifier is copied with those tensors renamed and passed as the target).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from contract_fixtures import save_target, write_run
from family_fixtures import write_export as write_family_export
from safetensors.numpy import load_file, save_file
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file as save_torch
from test_diagnose_export import write_export

from sleuth.checks import CONTRACT_CHECKS, ContractContext
from sleuth.findings import Finding
from sleuth.invariants import load_playbook
from sleuth.runs import read_run

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "invariants"
CASES = [(d.name, f) for d in sorted(FIXTURES.iterdir()) if d.name in CONTRACT_CHECKS
         for f in sorted(d.glob("*.json")) if f.name.startswith(("valid_", "invalid_"))]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("target") / "qwen3", layers=4)


def hidden_state_cache(path: Path, target: Path, stored: list) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    raw_last = []
    model.model.layers[-1].register_forward_hook(lambda _m, _i, o: raw_last.append(o[0] if isinstance(o, tuple) else o))
    (path / "hidden_states").mkdir(parents=True)
    for i, ids in enumerate([[6, 7, 8, 9, 10], [11, 12, 13]]):
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        pick = {"final": raw_last[-1][0], "final_normed": hidden[-1][0]}
        entries = [pick[s] if isinstance(s, str) else hidden[s][0] for s in stored]
        save_torch({"token_ids": torch.tensor(ids), "hidden_states": torch.stack(entries, 1).contiguous()},
                   str(path / "hidden_states" / f"hs_{i}.safetensors"))
    return path


SPECFORGE = Path(__file__).resolve().parents[1] / "fixtures" / "specforge"


def tensor_named_target(path: Path, config: dict, names: list[str]) -> Path:
    """A target directory as a sharded checkpoint describes itself: config.json and the index of its tensors."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    index = {"metadata": {"total_size": 0}, "weight_map": {name: "model-00001-of-00001.safetensors" for name in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def build_context(spec: dict, tmp_path: Path, target: Path) -> ContractContext:
    rules = {inv.id: inv for inv in load_playbook("dflash").invariants}
    findings = [Finding(id=i, title=i, status=s, severity="high", confidence=0.9) for i, s in spec.get("findings", {}).items()]
    target_dir = None
    if "target" in spec:
        target_dir = target
    if "specforge_run" in spec:
        info = read_run(SPECFORGE / "outputs" / spec["specforge_run"])
        if "target_rename" in spec:
            target_dir = tmp_path / "verifier"
            shutil.copytree(SPECFORGE / "verifier", target_dir)
            tensors = load_torch(str(target_dir / "model.safetensors"))  # bf16: torch, not numpy
            for old, new in spec["target_rename"].items():
                tensors[new] = tensors.pop(old)
            save_torch(tensors, str(target_dir / "model.safetensors"))
        return ContractContext(run=info, config=info.config, target_dir=target_dir, findings=findings, rules=rules)
    if "export_config" in spec and "export_tensors" in spec:  # a whole export: config.json and model.safetensors
        directory = write_family_export(tmp_path / "export", spec["export_config"], spec["export_tensors"])
        info = read_run(directory)
        return ContractContext(run=info, config=info.config, config_source=str(directory / "config.json"),
                               findings=findings, rules=rules, served_by=spec.get("served_by"))
    if "export_config" in spec:
        directory = tmp_path / "export"
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(spec["export_config"]))
        if "target_tensors" in spec:
            target_dir = tensor_named_target(tmp_path / "target", spec.get("target_config", {}), spec["target_tensors"])
        return ContractContext(config=spec["export_config"], config_source=str(directory / "config.json"),
                               target_dir=target_dir, findings=findings, rules=rules)
    if "export" in spec:
        export = spec["export"]
        directory = write_export(tmp_path / "export", export["layer_ids"], speculators=export["format"] == "speculators")
        config = json.loads((directory / "config.json").read_text())
        if "aux_hidden_state_layer_ids" in export:
            config["aux_hidden_state_layer_ids"] = export["aux_hidden_state_layer_ids"]
            (directory / "config.json").write_text(json.dumps(config))
        tensors = load_file(str(directory / "model.safetensors"))
        for old, new in export.get("rename", {}).items():
            tensors[new] = tensors.pop(old)
        save_file(tensors, str(directory / "model.safetensors"))
        info = read_run(directory)
        return ContractContext(run=info, config=info.config, findings=findings, rules=rules)
    if "export_layer_config" in spec:
        layer = {**json.loads((target / "config.json").read_text()), **spec["export_layer_config"]}
        config = {"speculators_model_type": "dflash", "transformer_layer_config": layer}
        return ContractContext(config=config, target_dir=target_dir, findings=findings, rules=rules)
    hidden_states = None
    config = dict(spec.get("config", {}))
    if "hidden_states" in spec:
        hs = spec["hidden_states"]
        hidden_states = hidden_state_cache(tmp_path / "cache", target, hs["stored"])
        config["aux_hidden_state_layer_ids"] = hs["aux_hidden_state_layer_ids"]
    run_dir = write_run(tmp_path / "run", target=target_dir, config=config, data=spec.get("run", {}).get("data"),
                        eval_report=spec.get("eval"), drafter=spec.get("run", {}).get("drafter"))
    info = read_run(run_dir)
    return ContractContext(run=info, config=info.config, config_source=str(info.config_path), target_dir=target_dir,
                           hidden_states=hidden_states, findings=findings, rules=rules)


def test_every_contract_invariant_has_valid_and_invalid_fixtures():
    for invariant in CONTRACT_CHECKS:
        names = [f.name for f in (FIXTURES / invariant).iterdir()]
        assert any(n.startswith("valid_") for n in names) and any(n.startswith("invalid_") for n in names), invariant


@pytest.mark.parametrize("invariant, fixture", CASES, ids=[f"{i}/{f.name}" for i, f in CASES])
def test_contract_fixture(invariant, fixture, tmp_path, target):
    spec = json.loads(fixture.read_text())
    finding = CONTRACT_CHECKS[invariant](build_context(spec, tmp_path, target))
    expected = "match" if fixture.name.startswith("valid_") else "mismatch"
    if fixture.name.startswith("valid_") and spec.get("static"):
        # read from a config or a header alone: agreement is reported, never claimed as a match
        assert finding.status == "unknown" and finding.static_agreement, (finding.observed, finding.reason)
        return
    assert finding.status == expected, (finding.observed, finding.reason)
    if "expect" in spec:
        assert spec["expect"] in f"{finding.observed} {finding.reason}"
