"""sleuth on real `specforge train` output (tests/fixtures/specforge, made by tools/make_specforge_fixture.py
with SpecForge a6b6b02's own trainer on CPU: `outputs/sf-tiny/`, its draft config `draft-dflash.json`, its
target `verifier/`, SpecForge's own HF export `export-hf/`).

Defects are planted in a copy of the draft config JSON, checked against the real checkpoint with `--config`.
Expectations are written from SpecForge's conventions (`specforge/modeling/draft/dflash.py`: id i reads HF
`hidden_states[i + 1]`; `build_target_layer_ids(8, 2)` = [1, 5] for the fixture's 8-layer target and 2 draft
layers), not from sleuth's output.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sleuth.commands.diagnose import app
from sleuth.interop.verifier import find_verifier
from sleuth.runs import list_run_dirs, read_run

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "specforge"
OUT = FIXTURE / "outputs" / "sf-tiny"
DRAFT_CONFIG = FIXTURE / "draft-dflash.json"
RULE_IDS = [1, 5]  # round(1 + i*(8-4)/(2-1)) for i in 0, 1


def diagnose(*args: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, dict]:
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(cwd / ".sleuth-cache"))
    result = CliRunner().invoke(app, [*args, "--offline", "--format", "json", "--out", str(cwd / "diagnosis")])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def by_id(report: dict) -> dict[str, dict]:
    return {f["id"]: f for f in report["findings"]}


def planted(tmp_path: Path, edit) -> Path:
    config = json.loads(DRAFT_CONFIG.read_text())
    edit(config)
    path = tmp_path / "draft-planted.json"
    path.write_text(json.dumps(config, indent=2))
    return path


# --- reading --------------------------------------------------------------------------------------------


def test_an_output_directory_reads_as_a_run_with_every_checkpoint_as_history():
    info = read_run(OUT)
    run = info.interop
    assert run.kind == "output_dir" and run.trainer == "specforge"
    steps = sorted(int(p.name.rsplit("step", 1)[1]) for p in OUT.glob("sf-tiny-step*"))
    assert [c.step for c in run.checkpoints] == steps
    best_meta = json.loads((OUT / "sf-tiny.best_meta.json").read_text())
    assert run.chosen.path.name == (OUT / "sf-tiny-best").resolve().name == f"sf-tiny-step{best_meta['step']}"
    assert info.checkpoint_step == best_meta["step"]
    assert info.name == "sf-tiny"
    # Curves: SpecForge logged train/* every step (log_interval 1) and eval/* every eval_interval to runs/.
    recipe = (FIXTURE / "recipe.yaml").read_text()
    assert "log_interval: 1" in recipe and "max_steps: 12" in recipe
    steps_logged, losses = info.series("loss")
    assert steps_logged == list(range(1, 13)) and all(loss > 0 for loss in losses)
    row = next(r for r in info.metrics if r["step"] == best_meta["step"])
    assert row["val_loss"] == pytest.approx(best_meta["metrics"]["eval/avg_loss"], rel=1e-6)
    assert row["val_acc"] == pytest.approx(best_meta["metrics"]["eval/avg_acc"], rel=1e-6)
    # The draft config and the target come from the paths SpecForge recorded in the checkpoint.
    assert run.draft_config == json.loads(DRAFT_CONFIG.read_text())
    assert run.verifier.num_layers == json.loads((FIXTURE / "verifier" / "config.json").read_text())["num_hidden_layers"]
    assert list_run_dirs(OUT) == []  # its children are checkpoints of one run, not runs


def test_one_checkpoint_reads_as_a_run():
    info = read_run(OUT / "sf-tiny-step8")
    assert info.interop.kind == "checkpoint" and info.checkpoint_step == 8
    assert info.interop.chosen.get("dflash_target_layer_ids") == tuple(RULE_IDS)
    assert info.interop.chosen.fc_shape == [32, 64]


def test_a_moved_run_finds_its_target_by_the_recorded_paths_tail(tmp_path):
    moved = tmp_path / "elsewhere" / "specforge"
    shutil.copytree(FIXTURE / "verifier", moved / "verifier")
    (moved / "outputs").mkdir()
    verifier = find_verifier("/machine/that/trained/specforge/verifier", moved / "outputs", relocatable=True)
    assert verifier.config_path == moved / "verifier" / "config.json" and verifier.num_layers == 8
    assert find_verifier("/machine/that/trained/specforge/verifier", moved / "outputs").num_layers is None


def test_a_torn_checkpoint_is_a_problem_not_a_crash(tmp_path):
    copy = tmp_path / "sf-tiny"
    shutil.copytree(OUT, copy, symlinks=True)
    state = copy / "sf-tiny-step4" / "training_state.pt"
    state.write_bytes(state.read_bytes()[:200])
    info = read_run(copy)
    assert any("sf-tiny-step4/training_state.pt: cannot be read" in p for p in info.problems)
    assert info.interop.chosen.step == 12


# --- checks in SpecForge's conventions --------------------------------------------------------------------


@pytest.mark.parametrize("where", [OUT, OUT / "sf-tiny-step8"])
def test_specforge_defaults_produce_no_mismatch(where, tmp_path, monkeypatch):
    code, report = diagnose("--run", str(where), cwd=tmp_path, monkeypatch=monkeypatch)
    found = by_id(report)
    assert code == 0, [f["id"] for f in report["findings"] if f["status"] == "mismatch"]
    for invariant in ("dflash.target_layer_ids", "dflash.fc_input_layers", "specforge.mask_token_id",
                      "specforge.block_size", "dflash.loss_decay_gamma", "dflash.loss_kind"):
        assert found[invariant]["status"] == "match", (invariant, found[invariant]["reason"])


def _ids(ids):
    return lambda config: config["dflash_config"].update(target_layer_ids=ids)


@pytest.mark.parametrize(
    ("edit", "invariant", "words"),
    [
        (_ids([2, 6]), "dflash.target_layer_ids", "off by +1"),           # vLLM numbering in a SpecForge config
        (_ids([0, 4]), "dflash.target_layer_ids", "off by -1"),
        (_ids([1, 8]), "dflash.target_layer_ids", "outside [0, 7]"),       # id 8 would read hidden_states[9]
        (_ids([1]), "dflash.target_layer_ids", "reads 2"),                 # shortened: fc.weight [32, 64] reads 2
        (lambda c: c["dflash_config"].pop("mask_token_id"), "specforge.mask_token_id", "no dflash_config.mask_token_id"),
        (lambda c: c["dflash_config"].update(mask_token_id=7), "specforge.mask_token_id", "trained with 300"),
        (lambda c: c.update(block_size=8), "specforge.block_size", "trained with 4"),
    ],
    ids=["ids+1", "ids-1", "out-of-range", "shortened", "mask-missing", "mask-differs", "block-size"],
)
def test_planted_config_defects_are_flagged_with_specforges_remedy(edit, invariant, words, tmp_path, monkeypatch):
    config = planted(tmp_path, edit)
    code, report = diagnose("--run", str(OUT / "sf-tiny-step8"), "--config", str(config), cwd=tmp_path,
                            monkeypatch=monkeypatch)
    assert code == 1
    finding = by_id(report)[invariant]
    assert finding["status"] == "mismatch" and words in finding["reason"], finding["reason"]
    mismatched = {f["id"] for f in report["findings"] if f["status"] == "mismatch"}
    assert mismatched == {invariant}
    fix = finding["fix"]
    assert str(config) in fix["code_hint"]
    if invariant == "dflash.target_layer_ids":
        # The weights were trained on the rule's ids (the checkpoint's dflash_target_layer_ids): restore them.
        assert fix["config_patch"] == {"dflash_config": {"target_layer_ids": RULE_IDS}}
    elif invariant == "specforge.mask_token_id":
        trained = json.loads(DRAFT_CONFIG.read_text())["dflash_config"]["mask_token_id"]
        assert fix["config_patch"] == {"dflash_config": {"mask_token_id": trained}}
    else:
        assert fix["config_patch"] == {"block_size": 4}


# --- a second real run: gamma 7 at block size 4 ------------------------------------------------------------

SECOND = FIXTURE / "outputs" / "sf-tiny-gamma7"


def test_a_run_trained_with_gamma_7_at_block_4_is_flagged_from_its_resume_contract(tmp_path, monkeypatch):
    recipe = (FIXTURE / "recipe-sf-tiny-gamma7.yaml").read_text()
    assert "loss_decay_gamma: 7.0" in recipe  # what the run was launched with
    code, report = diagnose("--run", str(SECOND), cwd=tmp_path, monkeypatch=monkeypatch)
    assert code == 1
    gamma = by_id(report)["dflash.loss_decay_gamma"]
    assert gamma["status"] == "mismatch" and "gamma 7.0 with block_size 4" in gamma["reason"]
    assert gamma["fix"]["config_patch"] == {"training.loss_decay_gamma": 4.0}
    assert "training.loss_decay_gamma" in gamma["fix"]["code_hint"]
    assert {e["value"] for e in gamma["evidence"] if e["kind"] == "checkpoint"} == {"7.0", "4"}  # gamma, block as stored
    assert [f["id"] for f in report["findings"] if f["status"] == "mismatch"] == ["dflash.loss_decay_gamma"]


def test_regression_between_two_output_directories(tmp_path, monkeypatch):
    code, report = diagnose("--run", str(SECOND), "--baseline", str(OUT), cwd=tmp_path, monkeypatch=monkeypatch)
    regression = report["regression"]
    compared = {m["metric"]: m for m in regression["metrics"]}
    assert {"acc", "loss"} <= set(compared)
    assert compared["loss"]["run_points"] == len(read_run(SECOND).series("loss")[0]) == 12
    assert regression["verdict"] in ("regression", "improvement", "no_regression")


def test_a_run_copied_off_the_training_machine_reads_its_config_and_target_beside_it(tmp_path, monkeypatch):
    """SpecForge records absolute paths; on another machine they are gone. The copy keeps the layout."""
    from sleuth.interop.specforge import SpecForgeRun

    moved = tmp_path / "elsewhere" / "specforge"
    shutil.copytree(OUT, moved / "outputs" / "sf-tiny", symlinks=True)
    shutil.copy(DRAFT_CONFIG, moved / "draft-dflash.json")
    shutil.copytree(FIXTURE / "verifier", moved / "verifier")
    real = SpecForgeRun.recorded_path
    # the paths as the machine that trained recorded them (this checkout's paths exist here, so they are replaced)
    monkeypatch.setattr(SpecForgeRun, "recorded_path",
                        lambda self, key: "/machine/that/trained/specforge/" + Path(real(self, key)).name)
    info = read_run(moved / "outputs" / "sf-tiny")
    assert info.interop.draft_config_path == moved / "draft-dflash.json"
    assert info.interop.verifier.config_path == moved / "verifier" / "config.json"
    assert sum("(the run has moved)" in p for p in info.problems) == 2


class _RunsCodeWhenUnpickled:
    """A training_state.pt that would run code if loaded with weights_only=False (torch.load's old default)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_training_state_that_carries_code_is_refused_not_run(tmp_path):
    import torch

    copy = tmp_path / "sf-tiny"
    shutil.copytree(OUT, copy, symlinks=True)
    marker = tmp_path / "code-ran"
    torch.save({"draft_state_dict": {}, "payload": _RunsCodeWhenUnpickled(marker)}, copy / "sf-tiny-step4" / "training_state.pt")
    info = read_run(copy)
    assert not marker.exists()
    assert any(p.startswith("sf-tiny-step4/training_state.pt: cannot be read") for p in info.problems)


def test_two_runs_in_one_output_dir_read_as_the_linked_one(tmp_path):
    copy = tmp_path / "outputs"
    shutil.copytree(OUT, copy, symlinks=True)
    shutil.copytree(OUT / "sf-tiny-step4", copy / "other-run-step40")
    info = read_run(copy)
    assert [c.path.name for c in info.interop.checkpoints] == sorted(
        (p.name for p in OUT.glob("sf-tiny-step*")), key=lambda name: int(name.rsplit("step", 1)[1]))
    assert any("2 runs share this output_dir (other-run, sf-tiny)" in p for p in info.problems)
    assert info.interop.best_meta == json.loads((OUT / "sf-tiny.best_meta.json").read_text())
