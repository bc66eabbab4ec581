"""sleuth on real `speculators train` output (tests/fixtures/speculators, made by
tools/make_speculators_fixture.py with speculators 0.9.0's own train entry point).

Defects are planted in a copy of a real checkpoint's config.json; every expectation below is written
from speculators' conventions (id i = HF hidden_states[i]; default [2, L//2, L-3]; the fixture's verifier
has 8 layers, so the default is [2, 4, 5]), not from sleuth's output.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sleuth.commands.diagnose import app
from sleuth.runs import list_run_dirs, read_run

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "speculators"
SAVE = FIXTURE / "specout"
SECOND = FIXTURE / "specout-gamma7"
DEFAULT_IDS = [2, 4, 5]


@pytest.fixture()
def copy(tmp_path: Path) -> Path:
    """The fixture directory (verifier + both save directories) copied, links kept, to plant defects in."""
    target = tmp_path / "speculators"
    shutil.copytree(FIXTURE, target, symlinks=True, ignore=shutil.ignore_patterns("data"))
    return target


def diagnose(*args: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, dict]:
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(cwd / ".sleuth-cache"))
    result = CliRunner().invoke(app, [*args, "--offline", "--format", "json", "--out", str(cwd / "diagnosis")])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def by_id(report: dict) -> dict[str, dict]:
    return {f["id"]: f for f in report["findings"]}


def plant(save: Path, **changes) -> Path:
    """Edit the best checkpoint's config.json (the one sleuth checks) and return that checkpoint."""
    checkpoint = save / "checkpoint_best"
    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config, indent=2))
    return checkpoint


# --- reading --------------------------------------------------------------------------------------------


def test_a_save_directory_reads_as_a_run_with_every_checkpoint_as_history():
    info = read_run(SAVE)
    run = info.interop
    assert run.kind == "save_dir"
    assert [c.path.name for c in run.checkpoints] == sorted((p.name for p in SAVE.iterdir() if p.name.isdigit()), key=int)
    best = (SAVE / "checkpoint_best").resolve().name
    assert run.chosen.path.name == best and run.links["checkpoint_best"] == best
    assert {name for name in run.links if name.startswith("epoch")} == {p.name for p in SAVE.glob("epoch*_end")}
    # Validation numbers: one row per checkpoint that has val_metrics.json, at its training_state global_step.
    expected = []
    for checkpoint in sorted(SAVE.glob("[0-9]*"), key=lambda p: int(p.name)):
        if (checkpoint / "val_metrics.json").is_file():
            values = json.loads((checkpoint / "val_metrics.json").read_text())
            step = json.loads((checkpoint / "training_state.json").read_text())["global_step"]
            expected.append((step, values["loss_epoch"], values["full_acc_epoch"], values["position_1_acc_epoch"]))
    assert expected, "the fixture must hold validation metrics"
    rows = [r for r in info.metrics if "val_loss" in r]
    assert [(r["step"], r["val_loss"], r["val_acc"], r["val_position_acc"][0]) for r in rows] == expected
    # Training curves: speculators logged every step (--log-freq 1) to tensorboard, read with its reader.
    last = max(json.loads(p.read_text())["global_step"] for p in SAVE.glob("[0-9]*/training_state.json"))
    steps, losses = info.series("loss")
    assert steps == list(range(last)) and all(value > 0 for value in losses)
    assert len(info.series("acc")[0]) == last
    assert info.block_size == json.loads((SAVE / "checkpoint_best" / "config.json").read_text())["block_size"]
    assert info.target_fingerprint == f"verifier:{(FIXTURE / 'verifier').resolve()}" and info.created is not None


def test_the_verifier_depth_comes_from_the_verifier_named_in_the_config(tmp_path, monkeypatch):
    info = read_run(SAVE / "0")
    assert info.interop.kind == "checkpoint"
    verifier = info.interop.verifier
    assert verifier.num_layers == json.loads((FIXTURE / "verifier" / "config.json").read_text())["num_hidden_layers"]
    # From elsewhere (another cwd) the relative name still resolves: beside the save directory.
    monkeypatch.chdir(tmp_path)
    assert read_run(SAVE / "0").interop.verifier.num_layers == verifier.num_layers


def test_save_directories_are_listed_as_runs():
    assert {SAVE, SECOND} <= set(list_run_dirs(FIXTURE))


# --- speculators' own defaults: nothing to fix ----------------------------------------------------------


@pytest.mark.parametrize("which", ["save_dir", "checkpoint"])
def test_speculators_defaults_produce_no_mismatch(which, tmp_path, monkeypatch):
    run = SAVE if which == "save_dir" else SAVE / "checkpoint_best"
    code, report = diagnose("--run", str(run), cwd=tmp_path, monkeypatch=monkeypatch)
    findings = by_id(report)
    assert code == 0, [f for f in report["findings"] if f["status"] == "mismatch"]
    layer_ids = findings["dflash.target_layer_ids"]
    assert layer_ids["status"] == "match" and "speculators' default" in layer_ids["reason"]
    assert findings["dflash.fc_input_layers"]["status"] == "match"
    assert findings["speculators.mask_token_id"]["status"] == "match"
    assert findings["dflash.anchor_slot_untrained"]["status"] == "match"
    assert findings["dflash.loss_kind"]["status"] == "match"
    # "logged no acc ..." no more: the val metrics are read.
    assert "logged no" not in report["regression"]["summary"]


# --- planted config defects: right label, remedy in speculators' terms, evidence quoted exactly ---------


@pytest.mark.parametrize(
    ("ids", "words"),
    [
        ([1, 3, 4], "off by -1"),  # z-lab's numbering used where vLLM's is expected
        ([3, 5, 6], "off by +1"),  # converted twice
        ([2, 4, 9], "outside [1, 8]"),
        ([0, 4, 5], "embeddings"),
    ],
)
def test_planted_layer_id_defects_are_flagged_with_a_speculators_remedy(copy, monkeypatch, ids, words):
    checkpoint = plant(copy / "specout", aux_hidden_state_layer_ids=ids)
    code, report = diagnose("--run", str(checkpoint), cwd=copy, monkeypatch=monkeypatch)
    finding = by_id(report)["dflash.target_layer_ids"]
    assert code == 1 and finding["status"] == "mismatch"
    assert words in finding["reason"]
    assert "--target-layer-ids 2 4 5" in finding["fix"]["code_hint"]
    assert "speculators train" in finding["fix"]["code_hint"]
    assert_evidence_quotes_the_files(finding)


def test_a_shortened_id_list_names_the_list_not_fc(copy, monkeypatch):
    checkpoint = plant(copy / "specout", aux_hidden_state_layer_ids=[2, 4])
    code, report = diagnose("--run", str(checkpoint), cwd=copy, monkeypatch=monkeypatch)
    findings = by_id(report)
    layer_ids = findings["dflash.target_layer_ids"]
    assert code == 1 and layer_ids["status"] == "mismatch"
    assert "names 2 layer(s)" in layer_ids["reason"] and "reads 3" in layer_ids["reason"]
    # The run was launched with --target-layer-ids 2 4 5 (train_command.txt): the config key is the fix.
    assert layer_ids["fix"]["config_patch"] == {"aux_hidden_state_layer_ids": DEFAULT_IDS}
    assert "--target-layer-ids 2 4 5" in layer_ids["fix"]["code_hint"]
    assert findings["dflash.fc_input_layers"]["status"] != "mismatch"
    assert_evidence_quotes_the_files(layer_ids)


def test_a_missing_mask_token_is_flagged(copy, monkeypatch):
    checkpoint = plant(copy / "specout", mask_token_id=None)
    code, report = diagnose("--run", str(checkpoint), cwd=copy, monkeypatch=monkeypatch)
    finding = by_id(report)["speculators.mask_token_id"]
    assert code == 1 and finding["status"] == "mismatch"
    assert finding["evidence"][0]["value"] == "null"
    assert "--mask-token-id" in finding["fix"]["code_hint"]


def test_sample_from_anchor_for_dflash_is_flagged(copy, monkeypatch):
    checkpoint = plant(copy / "specout", sample_from_anchor=True)
    code, report = diagnose("--run", str(checkpoint), cwd=copy, monkeypatch=monkeypatch)
    finding = by_id(report)["dflash.anchor_slot_untrained"]
    assert code == 1 and finding["status"] == "mismatch"
    assert "--no-sample-from-anchor" in finding["fix"]["code_hint"]
    assert_evidence_quotes_the_files(finding)


def test_gamma_is_judged_against_the_loss_weighting_that_ran(tmp_path, monkeypatch):
    # specout ran speculators' DFlash default, D-PACE weights, which do not use gamma.
    code, report = diagnose("--run", str(SAVE), cwd=tmp_path, monkeypatch=monkeypatch)
    gamma = by_id(report)["dflash.loss_decay_gamma"]
    assert gamma["status"] == "match" and "dpace" in gamma["reason"]
    # specout-gamma7 was launched with --per-position-loss-weight fixed-exp-decay --dflash-decay-gamma 7.0 at
    # block size 4: gamma 7 belongs to block size 16.
    code, report = diagnose("--run", str(SECOND), cwd=tmp_path, monkeypatch=monkeypatch)
    gamma = by_id(report)["dflash.loss_decay_gamma"]
    assert code == 1 and gamma["status"] == "mismatch"
    assert "--dflash-decay-gamma 4.0" in gamma["fix"]["code_hint"]
    assert {e["value"] for e in gamma["evidence"]} >= {"7.0", "fixed-exp-decay"}  # as written in the argv


def test_regression_between_two_save_directories(tmp_path, monkeypatch):
    code, report = diagnose("--run", str(SECOND), "--baseline", str(SAVE), cwd=tmp_path, monkeypatch=monkeypatch)
    regression = report["regression"]
    compared = {m["metric"]: m for m in regression["metrics"]}
    assert {"acc", "loss"} <= set(compared)
    assert compared["loss"]["run_points"] == len(read_run(SECOND).series("loss")[0]) > 3
    assert regression["verdict"] in ("regression", "improvement", "no_regression")
    # Found on its own too: the earlier save directory beside it, same verifier, data and block size.
    code, report = diagnose("--run", str(SECOND), cwd=tmp_path, monkeypatch=monkeypatch)
    chosen = [c for c in report["regression"]["candidates"] if c["chosen"]]
    assert [c["name"] for c in chosen] == ["specout"]


def assert_evidence_quotes_the_files(finding: dict) -> None:
    """Each config evidence value is the JSON of what that file holds under that key."""
    for evidence in finding["evidence"]:
        location = evidence["location"]
        if evidence["kind"] != "config" or ".json:" not in location:
            continue
        path, key = location.rsplit(":", 1)
        value = json.loads(Path(path).read_text())
        for part in key.split("."):
            name, _, index = part.partition("[")
            value = value[name]
            if index:  # "proposal_methods[0]"
                value = value[int(index.rstrip("]"))]
        assert json.loads(evidence["value"]) == value, location


# --- damaged save directories: problems and unknowns, never a crash ---------------------------------------


def test_a_dangling_link_and_a_garbled_file_become_problems(copy, monkeypatch):
    save = copy / "specout"
    (save / "checkpoint_best").unlink()
    (save / "checkpoint_best").symlink_to("7")
    (save / "1" / "val_metrics.json").write_text('{"loss_epoch": 1.9')
    info = read_run(save)
    assert any("checkpoint_best -> 7, which does not exist" in p for p in info.problems)
    assert info.interop.chosen.path.name == max((p.name for p in save.iterdir() if p.name.isdigit()), key=int)
    assert not any(r.get("val_source") == "1/val_metrics.json" for r in info.metrics)
    code, report = diagnose("--run", str(save), cwd=copy, monkeypatch=monkeypatch)
    assert code == 0


def test_an_unreadable_checkpoint_config_leaves_the_checks_unknown(copy, monkeypatch):
    best = (copy / "specout" / "checkpoint_best").resolve()
    (best / "config.json").write_text("{not json")
    code, report = diagnose("--run", str(copy / "specout"), cwd=copy, monkeypatch=monkeypatch)
    assert any("config.json cannot be read" in p for p in report["run"]["problems"])
    assert by_id(report)["dflash.target_layer_ids"]["status"] == "unknown"


def test_a_hub_id_resolves_through_the_local_hugging_face_cache_only(tmp_path, monkeypatch):
    """The documented hub cache layout (models--org--name/refs/main -> snapshots/<sha>/config.json)."""
    import huggingface_hub.constants

    from sleuth.interop.verifier import find_verifier

    sha = "0" * 40
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-8B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    (repo / "snapshots" / sha).mkdir(parents=True)
    (repo / "snapshots" / sha / "config.json").write_text(json.dumps({"num_hidden_layers": 36, "hidden_size": 4096}))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    found = find_verifier("Qwen/Qwen3-8B", tmp_path / "run")
    assert (found.num_layers, found.hidden_size) == (36, 4096)
    missing = find_verifier("Qwen/Qwen3-32B", tmp_path / "run")
    assert missing.num_layers is None and "not found offline" in missing.reason

    # A checkpoint naming that verifier, with z-lab's ids for 36 layers where vLLM's are expected.
    shutil.copytree(SAVE, tmp_path / "specout", symlinks=True)
    config_path = tmp_path / "specout" / "checkpoint_best" / "config.json"
    config = json.loads(config_path.read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = "Qwen/Qwen3-8B"
    config["aux_hidden_state_layer_ids"] = [1, 17, 32]
    config_path.write_text(json.dumps(config))
    code, report = diagnose("--run", str(tmp_path / "specout" / "checkpoint_best"), cwd=tmp_path, monkeypatch=monkeypatch)
    finding = by_id(report)["dflash.target_layer_ids"]
    assert finding["status"] == "mismatch" and "off by -1" in finding["reason"]
    assert "--target-layer-ids 2 18 33" in finding["fix"]["code_hint"]
