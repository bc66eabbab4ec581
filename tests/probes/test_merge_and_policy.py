"""Verdicts onto findings (the probe decides, the report says so) and when sleuth probes at all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sleuth.findings import Evidence, Finding, Fix
from sleuth.probes.agent import choose_plan, expectations_from_playbook
from sleuth.probes.merge import apply_probes
from sleuth.probes.runner import ProbeError, ProbeOutcome, check_options, plan_for_code, plan_for_run, run_plan
from sleuth.probes.verdict import PROBED_INVARIANTS, Verdict
from sleuth.trace import Trace


def finding(status: str, observed: str = "final", fix: Fix | None = None) -> Finding:
    return Finding(id="dflash.target_logits_source", title="targets", status=status, severity="critical",
                   expected="final", observed=observed, confidence=0.8, fix=fix,
                   evidence=[Evidence(kind="code", location="train.py:12", value=observed)])


def verdict(status: str, observed: str = "", reason: str = "") -> Verdict:
    return Verdict(invariant="dflash.target_logits_source", status=status, experiment="loss-gradient",
                   hypothesis="each slot is trained toward the final logits", perturbed="the drafter's logits",
                   measurement="best teacher explains 100% of trained slots", threshold=">= 90%",
                   observed=observed, reason=reason, fix="Take the teacher from the final output.")


def test_a_probe_overrules_a_static_match_and_says_so():
    trace = Trace()
    merged, changed = apply_probes([finding("match")], ProbeOutcome("run v5", [verdict("mismatch", "layer 5")]), trace)
    result = merged[0]
    assert changed == ["dflash.target_logits_source"]
    assert result.status == "mismatch" and result.observed == "layer 5" and result.confidence == 0.95
    assert result.evidence[0].kind == "probe" and result.evidence[0].location == "probe:loss-gradient"
    assert "best teacher explains 100%" in result.evidence[0].value
    assert result.evidence[1].kind == "code"  # the static reading stays, ranked below
    assert any(n.startswith("probe decided: the static reading said match (final)") for n in result.notes)
    assert result.fix is not None and result.fix.code_hint == "Take the teacher from the final output."
    assert [s.step for s in trace.steps] == ["probe"]
    assert "mismatch" in trace.steps[0].outcome and trace.steps[0].inputs["hypothesis"]


def test_an_agreeing_probe_adds_evidence_and_confidence_and_keeps_the_fix():
    fix = Fix(config_patch={"target_logits_source": "final"})
    merged, changed = apply_probes([finding("mismatch", "intermediate", fix)],
                                   ProbeOutcome("run v5", [verdict("mismatch", "layer 5")]), Trace())
    assert changed == [] and merged[0].status == "mismatch" and merged[0].observed == "intermediate"
    assert merged[0].fix == fix and merged[0].confidence == 0.95
    assert any(n.startswith("probe loss-gradient agrees") for n in merged[0].notes)


def test_an_unknown_probe_leaves_the_status_and_records_why():
    merged, changed = apply_probes([finding("match")], ProbeOutcome("x", [verdict("unknown", reason="no gradient")]),
                                   Trace())
    assert changed == [] and merged[0].status == "match" and merged[0].confidence == 0.8
    assert merged[0].evidence[0].value == "unknown: no gradient; measured best teacher explains 100% of trained slots"


def test_a_run_recorded_before_the_entry_point_gets_unknown_probes(tmp_path: Path):
    (tmp_path / "code" / "trainer").mkdir(parents=True)
    plan = plan_for_run(tmp_path, tmp_path / "code", "old")
    assert plan.spec is None and "recorded before the trainer exposed a probe entry point" in plan.reason
    outcome = run_plan(plan)
    assert {v.invariant for v in outcome.verdicts} == set(PROBED_INVARIANTS)
    assert all(v.status == "unknown" and v.reason == plan.reason for v in outcome.verdicts)
    assert plan_for_run(tmp_path, None, "old").reason == "the run has no code/ copy, so there is no code to run"


def test_policy_runs_probes_by_default_for_runs_and_only_on_request_for_code(tmp_path: Path):
    run = dict(entry=None, run_dir=tmp_path, run_name="v5", run_code=tmp_path / "code", code=None, config=None)
    assert choose_plan(probe=None, **run)[0] is not None
    assert choose_plan(probe=False, **run) == (None, "--no-probe")
    code = dict(run, run_dir=None, run_code=None, code=tmp_path)
    plan, why = choose_plan(probe=None, **code)
    assert plan is None and "only with --probe" in why
    plan, _ = choose_plan(probe=True, **code)
    assert plan.spec is None and "neither speculators nor SpecForge" in plan.reason
    plan, _ = choose_plan(probe=None, **{**code, "entry": "my_trainer.probe:subject"})
    assert plan.spec["entry"] == "my_trainer.probe:subject" and plan.spec["sys_path"] == [str(tmp_path.resolve())]


def test_speculators_layouts_are_recognised(tmp_path: Path):
    package = tmp_path / "src" / "speculators"
    (package / "models" / "dflash").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models" / "dflash" / "core.py").write_text("")
    for given in (tmp_path, package):
        plan = plan_for_code(given, None)
        assert plan.spec == {"subject": "speculators", "package_dir": str(package.resolve()),
                             "sys_path": [str(package.parent.resolve())],
                             "context": {"config": None}}


def test_a_specforge_recipe_hands_its_draft_config_over_by_value(tmp_path: Path):
    # The child sees only its box: the draft config the recipe names beside itself is read here and handed over.
    package = tmp_path / "specforge"
    (package / "modeling" / "draft").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "modeling" / "draft" / "dflash.py").write_text("")
    recipes = tmp_path / "configs"
    recipes.mkdir()
    (recipes / "draft.json").write_text('{"block_size": 16, "num_target_layers": 36}')
    recipe = {"model": {"draft_model_config": "draft.json"}, "training": {"loss_decay_gamma": 7}}
    plan = plan_for_code(package, recipe, recipes / "recipe.yaml")
    assert plan.spec["context"]["draft_config"] == {"block_size": 16, "num_target_layers": 36}
    missing = plan_for_code(package, {"model": {"draft_model_config": "gone.json"}}, recipes / "recipe.yaml")
    assert "gone.json was not found next to the recipe" in missing.spec["context"]["draft_config_problem"]


def test_a_shipped_specforge_recipe_finds_its_draft_config_in_the_checkout(tmp_path: Path, monkeypatch):
    # SpecForge's own layout: examples/configs/x-online.yaml names `configs/x.json`, a path from the checkout's
    # root (where `specforge train` runs), and sleuth is run from anywhere else.
    checkout = tmp_path / "SpecForge"
    package = checkout / "specforge"
    (package / "modeling" / "draft").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "modeling" / "draft" / "dflash.py").write_text("")
    (checkout / "configs").mkdir()
    (checkout / "configs" / "qwen3-8b-dflash.json").write_text('{"block_size": 16}')
    (checkout / "examples" / "configs").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    recipe = {"model": {"draft_model_config": "configs/qwen3-8b-dflash.json"}}
    # found above the recipe ...
    found = plan_for_code(package, recipe, checkout / "examples" / "configs" / "qwen3-8b-dflash-online.yaml")
    assert found.spec["context"]["draft_config"] == {"block_size": 16}
    assert found.spec["context"]["draft_config_from"] == str((checkout / "configs" / "qwen3-8b-dflash.json").resolve())
    # ... and in the checkout that holds --code when the recipe was copied elsewhere
    copied = plan_for_code(package, recipe, elsewhere / "recipe.yaml")
    assert copied.spec["context"]["draft_config"] == {"block_size": 16}
    # an unrelated directory holds nothing: the problem names the places looked in
    (tmp_path / "other" / "specforge" / "modeling" / "draft").mkdir(parents=True)
    lonely = tmp_path / "other" / "specforge"
    (lonely / "__init__.py").write_text("")
    (lonely / "modeling" / "draft" / "dflash.py").write_text("")
    missing = plan_for_code(lonely, recipe, elsewhere / "recipe.yaml")
    problem = missing.spec["context"]["draft_config_problem"]
    assert "configs/qwen3-8b-dflash.json was not found next to the recipe" in problem and str(elsewhere) in problem


@pytest.mark.parametrize(("python", "entry", "message"), [
    ("/nonexistent/python", None, "--probe-python /nonexistent/python does not exist"),
    (None, "no_function", "--probe-entry must be module:function"),
    (None, "a.b:c-d", "--probe-entry must be module:function"),
])
def test_bad_probe_options_are_one_line_errors(python, entry, message):
    with pytest.raises(ProbeError, match=message):
        check_options(python, entry)


def test_expectations_come_from_the_playbook():
    from sleuth.invariants import load_playbook

    expected = expectations_from_playbook(load_playbook("dflash"))
    assert expected.gamma == 4.0 and expected.gamma_by_block_size == {16: 7.0}
    assert set(expected.loss_kinds) == {"ce", "kl"}


def test_a_probe_match_turns_static_agreement_into_a_claim():
    agreement = finding("unknown").model_copy(update={"static_agreement": True, "confidence": 0.0})
    merged, changed = apply_probes([agreement], ProbeOutcome("code", [verdict("match", "final")]), Trace())
    assert changed == ["dflash.target_logits_source"]
    assert merged[0].status == "match" and not merged[0].static_agreement and merged[0].confidence == 0.95
    assert any("the static reading said agreement, not claimed (final)" in n for n in merged[0].notes)


def test_an_unknown_probe_leaves_static_agreement_unclaimed():
    agreement = finding("unknown").model_copy(update={"static_agreement": True, "confidence": 0.0})
    merged, _ = apply_probes([agreement], ProbeOutcome("code", [verdict("unknown", reason="no gradient")]), Trace())
    assert merged[0].status == "unknown" and merged[0].static_agreement


def config_finding(status: str, observed: str) -> Finding:
    return Finding(id="dflash.loss_decay_gamma", title="gamma", status=status, severity="medium", expected="4.0",
                   observed=observed, confidence=0.9,
                   evidence=[Evidence(kind="pinned", location="core.py:247@c05b95b", value="4.0"),
                             Evidence(kind="config", location="config.json:loss_decay_gamma", value=observed)])


def gamma_verdict(status: str, observed: str, config_bound: bool = False) -> Verdict:
    return Verdict(invariant="dflash.loss_decay_gamma", status=status, experiment="loss-gradient",
                   hypothesis="the slot weights are the configured weighting", perturbed="the drafter's logits",
                   measurement="slot weights 1, 0.87, 0.75", threshold="1 %", observed=observed,
                   config_bound=["loss_decay_gamma"] if config_bound else [])


def test_a_probe_match_never_turns_a_config_mismatch_into_a_match():
    merged, changed = apply_probes([config_finding("mismatch", "7.0")],
                                   ProbeOutcome("run", [gamma_verdict("match", "the loss applies gamma 7", True)]), Trace())
    assert changed == [] and merged[0].status == "mismatch" and merged[0].observed == "7.0"
    assert merged[0].evidence[0].kind == "probe"
    assert any("a measurement of the code cannot make it right" in n for n in merged[0].notes)


def test_a_probe_that_disagrees_with_a_config_match_is_a_conflict_naming_both():
    merged, changed = apply_probes([config_finding("match", "7.0")],
                                   ProbeOutcome("run", [gamma_verdict("mismatch", "gamma 4")]), Trace())
    result = merged[0]
    assert changed == ["dflash.loss_decay_gamma"] and result.status == "mismatch"
    assert result.observed == "config: 7.0; measured: gamma 4"
    assert any(n.startswith("conflict: the run's config says '7.0', the probe loss-gradient measured gamma 4")
               for n in result.notes)
    assert result.confidence < 0.95


def test_a_config_bound_match_does_not_decide_a_value_the_config_left_undecided():
    undecided = config_finding("unknown", "7.0").model_copy(update={"confidence": 0.0})
    merged, changed = apply_probes([undecided], ProbeOutcome("run", [gamma_verdict("match", "applies gamma 7", True)]),
                                   Trace())
    assert changed == [] and merged[0].status == "unknown"
    assert any("the code follows the run's config" in n for n in merged[0].notes)


def test_a_forged_all_match_probe_answer_cannot_clean_the_v5_run():
    """The demo's v5 config has three config mismatches; a probe answer saying `match` for everything (what a
    hostile code/ copy could return) leaves every one of them a mismatch. On main the probe decided them."""
    from sleuth.invariants import check_invariants, load_playbook
    from trainer.config import PRESETS, resolve_for_target, validate_config

    config = resolve_for_target(validate_config(dict(PRESETS["v5"])), 36).model_dump()
    findings = check_invariants(load_playbook("dflash"), config=config, config_source="config.json", trace=Trace())
    before = {f.id for f in findings if f.status == "mismatch"}
    assert {"dflash.fc_input_layers", "dflash.target_logits_source", "dflash.loss_decay_gamma"} <= before
    forged = ProbeOutcome("run v5", [Verdict(invariant=i, status="match", experiment="forged", hypothesis="h",
                                             perturbed="p", measurement="m", threshold="t", observed="all good")
                                     for i in PROBED_INVARIANTS])
    merged, changed = apply_probes(findings, forged, Trace())
    after = {f.id for f in merged if f.status == "mismatch"}
    assert before <= after, before - after
    assert not set(changed) & before


def test_the_probe_target_holds_a_recipes_checkpoint_keys_by_their_tensor_not_their_role(tmp_path: Path):
    # SpecForge reads the target's embedding by the recipe's `embedding_key`; a Qwen3.6 target keeps it under
    # model.language_model. The probe's target is a plain Qwen3, so such a name is added, holding the tensor
    # its last components name. A key that names another existing tensor is not "fixed": the defect shows.
    from safetensors.torch import load_file

    from sleuth.probes.adapters.synthetic import write_target_dir
    from sleuth.probes.target import make_target

    target = make_target(2)
    keys = ("model.language_model.embed_tokens.weight", "lm_head.weight", "model.language_model.norm.weight")
    tensors = load_file(str(write_target_dir(target, tmp_path / "t", checkpoint_keys=keys) / "model.safetensors"))
    assert torch.equal(tensors["model.language_model.embed_tokens.weight"], target.embed_weight)
    assert torch.equal(tensors["lm_head.weight"], target.lm_head_weight)
    assert "model.language_model.norm.weight" not in tensors  # neither kind: not invented
    wrong = load_file(str(write_target_dir(target, tmp_path / "w", checkpoint_keys=("lm_head.weight",))
                          / "model.safetensors"))
    assert torch.equal(wrong["lm_head.weight"], target.lm_head_weight)  # an embedding_key of lm_head stays lm_head


def test_a_setup_error_keeps_what_was_wrong_not_only_its_first_line():
    # pydantic's first line is a count ("1 validation error for Config"); the reason is on the next one
    from pydantic import BaseModel, field_validator

    from sleuth.probes.worker import _one_line

    class Config(BaseModel):
        mode: str

        @field_validator("mode")
        @classmethod
        def online_needs_servers(cls, value: str) -> str:
            raise ValueError("online training requires deployment.mode=disaggregated")

    with pytest.raises(Exception) as caught:
        Config(mode="local")
    line = _one_line(caught.value)
    assert "\n" not in line and "For further information" not in line
    assert line.startswith("ValidationError: 1 validation error for Config mode Value error, online training requires")
    assert len(_one_line(RuntimeError("x" * 5000))) <= len("RuntimeError: ") + 400


@pytest.mark.parametrize("name", ["../../.aws/credentials.json", ".docker/config.json", "configs/x.yaml",
                                  "configs/../../secret.json"])
def test_a_recipe_cannot_hand_the_probe_a_file_the_sandbox_keeps_from_it(name: str, tmp_path: Path):
    # the draft config is read by sleuth and handed to the code it runs: a recipe from elsewhere must not
    # name the user's hidden or out-of-tree files (their content would reach the untrusted child by value)
    package = tmp_path / "specforge"
    (package / "modeling" / "draft").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "modeling" / "draft" / "dflash.py").write_text("")
    for secret in (tmp_path / ".docker" / "config.json", tmp_path / "secret.json"):
        secret.parent.mkdir(parents=True, exist_ok=True)
        secret.write_text('{"auths": "token"}')
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    context = plan_for_code(package, {"model": {"draft_model_config": name}}, recipe).spec["context"]
    assert "draft_config" not in context
    assert "is not read: sleuth reads a draft config only as a .json file" in context["draft_config_problem"]


def test_the_draft_config_is_never_looked_for_in_the_home_directory(tmp_path: Path, monkeypatch):
    home = tmp_path / "home"
    (home / "configs").mkdir(parents=True)
    (home / "configs" / "draft.json").write_text('{"block_size": 16}')  # a user's own file, not the recipe's
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    package = home / "proj" / "specforge"
    (package / "modeling" / "draft").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "modeling" / "draft" / "dflash.py").write_text("")
    context = plan_for_code(package, {"model": {"draft_model_config": "configs/draft.json"}},
                            home / "proj" / "r.yaml").spec["context"]
    assert "draft_config" not in context and "was not found" in context["draft_config_problem"]
