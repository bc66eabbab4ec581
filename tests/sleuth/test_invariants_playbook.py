"""Playbooks are data: the DFlash playbook has every invariant of DFLASH.md, each fully documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from sleuth.checks import CONTRACT_CHECKS
from sleuth.invariants import PlaybookError, load_playbook
from sleuth.observe.optimization_judge import OPTIMIZATION_INVARIANTS
from sleuth.probes.verdict import PATH_CHECK_INVARIANTS

DFLASH_IDS = [
    "dflash.target_layer_ids", "dflash.fc_input_layers", "dflash.fc_norm", "dflash.kv_injection",
    "dflash.context_excludes_anchor", "dflash.block_bidirectional", "dflash.blocks_isolated",
    "dflash.block_position_ids", "dflash.target_logits_source", "dflash.target_shift",
    "dflash.anchor_slot_untrained", "dflash.loss_decay_gamma", "dflash.loss_kind", "dflash.frozen_embed_head",
    "dflash.anchor_sampling",
    # not a reference-code rule but a trainer-side one: the packed target forward equals the model's own
    "dflash.target_forward_fidelity",
]


# The train-to-serve contract (issue 16): checked by sleuth.checks from the run's records and the target.
CONTRACT_IDS = sorted(CONTRACT_CHECKS)
# Decided only by the probes' path checks (the trainers' own optimizer builders, run): no static reading.
PROBE_ONLY_IDS = sorted(set(PATH_CHECK_INVARIANTS) - set(CONTRACT_CHECKS))
# Decided only by the user's own command, observed (sleuth/observe): the real optimizer and scheduler.
OBSERVED_ONLY_IDS = sorted(set(OPTIMIZATION_INVARIANTS) - set(PATH_CHECK_INVARIANTS))


def test_dflash_playbook_has_exactly_the_reference_ids():
    playbook = load_playbook()
    assert sorted(playbook.ids) == sorted(DFLASH_IDS + CONTRACT_IDS + PROBE_ONLY_IDS + OBSERVED_ONLY_IDS)
    assert PROBE_ONLY_IDS == ["dflash.optimizer_schedule"]
    assert OBSERVED_ONLY_IDS == ["dflash.optimizer_groups", "dflash.schedule_horizon"]
    assert sorted(i.rank for i in playbook.invariants) == list(range(1, len(playbook.invariants) + 1))


def test_every_invariant_is_documented_and_fixable():
    for inv in load_playbook().invariants:
        assert inv.why.what and inv.why.why and inv.why.example, inv.id
        if inv.id in PROBE_ONLY_IDS + OBSERVED_ONLY_IDS:
            # The trainers' builders are run by the probes, not read: the note names them.
            assert any(note.startswith("from: ") for note in inv.notes), inv.id
            assert inv.fix.code_hint and inv.observed.code is None and inv.observed.config is None, inv.id
            continue
        if inv.id in CONTRACT_CHECKS:
            # No reference source states these; the public issue they come from is named instead.
            assert any(note.startswith("from: ") for note in inv.notes), inv.id
            assert inv.fix.code_hint or inv.fix.config_patch, inv.id
            continue
        assert inv.expected.pinned is not None and inv.expected.pinned.commit, inv.id
        assert inv.observed.code or inv.observed.config, inv.id
        assert inv.fix.code_hint or inv.fix.config_patch, inv.id
        if inv.fix.applicability == "unsafe":
            assert inv.fix.why_unsafe, inv.id


def test_gamma_disagreement_is_written_down():
    gamma = load_playbook().get("dflash.loss_decay_gamma")
    assert gamma.expected.value == 4.0
    assert [(c.value, c.block_size) for c in gamma.expected.conditional_accept] == [(7.0, 16)]
    assert any("4.0" in n and "7" in n and "SpecForge" in n for n in gamma.notes)


def test_load_by_path_and_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    source = load_playbook().path
    copy = tmp_path / "mine.yaml"
    copy.write_text(Path(source).read_text())
    assert load_playbook(copy).name == "dflash"
    monkeypatch.setenv("SLEUTH_PLAYBOOKS_DIR", str(tmp_path))
    assert load_playbook("mine").path == str(copy)
    with pytest.raises(PlaybookError, match="unknown playbook 'dflash'.*mine"):
        load_playbook("dflash")


@pytest.mark.parametrize("text, message", [
    ("name: x\nreference: r\ninvariants: [{id: a}]\n", "invalid at invariants.0"),
    ("[1, 2", "cannot be read"),
    ("- just a list\n", "must be a mapping"),
])
def test_invalid_playbooks_give_one_line_errors(tmp_path: Path, text: str, message: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(PlaybookError, match=message) as info:
        load_playbook(path)
    assert "\n" not in str(info.value)


def test_duplicate_ids_are_refused(tmp_path: Path):
    import yaml

    data = yaml.safe_load(Path(load_playbook().path).read_text())
    data["invariants"].append(data["invariants"][0])
    path = tmp_path / "dup.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlaybookError, match="repeats"):
        load_playbook(path)
