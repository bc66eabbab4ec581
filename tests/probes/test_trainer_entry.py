"""The trainer's probe entry point (trainer/probe.py): the trainer's own code, probed with each preset of the
story, gives the verdicts the config says it should; and every run's code/ copy carries the entry point."""

from __future__ import annotations

import functools

import pytest

from tests.probes.lab import verdicts
from trainer.config import PRESETS
from trainer.probe import probe_subject

EMBEDDED_TARGET_LAYERS = 8  # the embedded target's depth: the presets' layer ids are resolved against it


@functools.cache
def preset_verdicts(preset: str):
    subject = probe_subject({"config": dict(PRESETS[preset]), "num_target_layers": EMBEDDED_TARGET_LAYERS})
    return verdicts(subject)


def mismatches(preset: str) -> dict[str, str]:
    return {k: v.observed for k, v in preset_verdicts(preset).items() if v.status == "mismatch"}


def test_fixed_preset_matches_every_probe():
    found = preset_verdicts("fixed")
    assert {k: v.status for k, v in found.items() if v.status != "match"} == {}


def test_v5_mismatches_are_measured_from_the_code():
    found = mismatches("v5")
    assert set(found) == {"dflash.fc_input_layers", "dflash.target_logits_source"}
    assert found["dflash.fc_input_layers"].startswith("4 of 5 selected layers read")
    # last_selected resolves to layer id 5, which is hidden_states[6].
    assert "hidden_states[6]" in found["dflash.target_logits_source"]
    # gamma 7 is what the run's config asks for, and the code applies it: the probe claims only that (the
    # value itself is the config's finding, which the probe can never turn into a match).
    gamma = preset_verdicts("v5")["dflash.loss_decay_gamma"]
    assert gamma.status == "match" and gamma.config_bound == ["loss_decay_gamma"]
    assert gamma.measured["gamma"] == pytest.approx(7.0, rel=1e-3)


def test_v6_anchor_leak_is_measured():
    assert set(mismatches("v6")) == {"dflash.context_excludes_anchor"}


def test_recipe_preset_dpace_is_recognised():
    gamma = preset_verdicts("recipe-2026")["dflash.loss_decay_gamma"]
    assert gamma.status == "match" and "D-PACE" in gamma.observed


def test_every_run_records_the_entry_point(tmp_path):
    from trainer.run.rundir import RunDir

    RunDir(tmp_path / "run").write_code_fingerprint()
    copied = tmp_path / "run" / "code" / "trainer" / "probe.py"
    assert copied.is_file()
    assert "def probe_subject(" in copied.read_text()


def test_subject_needs_a_run_or_a_config():
    with pytest.raises(ValueError, match="needs a run directory"):
        probe_subject({})


def test_the_probe_takes_its_gradients_through_the_runs_chunked_loss(monkeypatch):
    """The loss experiment runs the run's own chunked loss with the chunk size in the run's config: one
    block per chunk here, so the probe batch's blocks go through many chunks, and the verdicts are the
    fixed preset's (match) and v5's (gamma 7 measured) all the same."""
    import trainer.run.step as step

    seen: list[int | None] = []
    real = step.block_loss

    def spy(*args, **kwargs):
        seen.append(args[7] if len(args) > 7 else kwargs.get("chunk_size"))
        return real(*args, **kwargs)

    monkeypatch.setattr(step, "block_loss", spy)
    for preset, expected in (("fixed", "match"), ("v5", "mismatch")):
        config = {**PRESETS[preset], "loss_chunk_size": 8}
        subject = probe_subject({"config": config, "num_target_layers": EMBEDDED_TARGET_LAYERS})
        found = verdicts(subject, "loss-gradient")
        # the gamma the code applies is measured through the chunks: 4 for fixed, the config's 7 for v5 (a
        # config-bound match: the value itself is the config's finding)
        gamma = found["dflash.loss_decay_gamma"]
        assert gamma.status == "match" and gamma.measured["gamma"] == pytest.approx(4.0 if preset == "fixed" else 7.0, rel=1e-3)
        assert found["dflash.target_shift"].status == found["dflash.anchor_slot_untrained"].status == "match"
        assert found["dflash.target_logits_source"].status == expected
    assert seen and set(seen) == {8}
