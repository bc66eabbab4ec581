"""The observed step's optimizer and schedule (sleuth/observe/optimization*.py): planted defects are mismatches.

One plain-torch trainer (tests/fixtures/observe/schedules: a frozen token table and head, AdamW with the matrices
decayed and the vectors not, a linear warmup then a cosine over the steps after warmup, clipping) run through
`observe_command` as `sleuth diagnose --probe -- CMD` runs it, the variants in parallel once per module. Each
planted defect is an edit of the trainer's source; the run's configured values come from the config file its
command names.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sleuth.observe.runner import observe_command

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "observe" / "schedules"
CONFIG = {"lr": 5e-4, "weight_decay": 0.01, "max_steps": 40, "warmup_steps": 4, "max_grad_norm": 1.0}
COMMAND = ["python", "train.py", "--config", "run.json"]
VARIANTS: dict[str, tuple[dict, list[tuple[str, str]], list[str]]] = {
    # name: (config changes, plants (old found once -> new), extra arguments)
    "clean_resumed": ({}, [], ["--resume", "ckpt.pt"]),
    # weight decay on the norms and biases too: speculators' own recipe does the same, so no false alarm
    "clean_accumulated": ({"grad_accum": 2}, [('{"params": vectors, "weight_decay": 0.0}',
                                               '{"params": vectors, "weight_decay": cfg["weight_decay"]}')], []),
    "group_warmup_cosine_clip": ({}, [('{"params": vectors, "weight_decay": 0.0}',
                                       '{"params": vectors, "weight_decay": 0.0, "lr": 3e-4}'),
                                      ('warmup, total = cfg["warmup_steps"], cfg["max_steps"]',
                                       'warmup, total = 10, cfg["max_steps"]'),
                                      ("T_max=total - warmup", "T_max=total"),
                                      ('clip_grad_norm_(drafter.parameters(), cfg["max_grad_norm"])',
                                       "clip_grad_norm_(drafter.parameters(), 10.0)")], []),
    "stepped_per_micro_batch": ({"grad_accum": 2}, [("            loss.backward()\n",
                                                     "            loss.backward()\n            schedule.step()\n"),
                                                    ("        schedule.step()\n        print", "        print")], []),
    # two defects that meet in no verdict: the schedule's position not restored, and the scheduler stepped twice
    "resumed_without_schedule_stepped_twice": ({}, [('        schedule.load_state_dict(state["scheduler"])\n', ""),
                                                    ("        schedule.step()\n",
                                                     "        schedule.step()\n        schedule.step()\n")],
                                               ["--resume", "ckpt.pt"]),
}


def _project(root: Path, config: dict, plants: list[tuple[str, str]]) -> Path:
    shutil.copytree(FIXTURE, root)
    text = (root / "train.py").read_text()
    for old, new in plants:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (root / "train.py").write_text(text)
    (root / "run.json").write_text(json.dumps({**CONFIG, **config}))
    return root


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    base = tmp_path_factory.mktemp("optim")
    # A checkpoint five steps into the run, saved by the trainer itself (unobserved), for the resumed variants.
    saver = _project(base / "saver", {"stop_after": 5, "save": "ckpt.pt"}, [])
    subprocess.run([sys.executable, "train.py", "--config", "run.json"], cwd=saver, check=True, capture_output=True,
                   timeout=120)
    roots = {}
    for name, (config, plants, extra) in VARIANTS.items():
        roots[name] = _project(base / name, config, plants)
        shutil.copy(saver / "ckpt.pt", roots[name] / "ckpt.pt")

    def observe(name: str) -> dict:
        outcome = observe_command(COMMAND + VARIANTS[name][2], roots[name], cwd=roots[name], timeout_s=180)
        assert outcome.error is None, (name, outcome.error)
        return {v.invariant: v for v in outcome.verdicts} | {"notes": outcome.notes}

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(VARIANTS, pool.map(observe, VARIANTS)))


def test_clean_runs_match_and_raise_no_false_alarm(verdicts: dict[str, dict]) -> None:
    for name in ("clean_resumed", "clean_accumulated"):
        found = verdicts[name]
        assert found["dflash.optimizer_groups"].status == "match", (name, found["dflash.optimizer_groups"])
        assert found["dflash.schedule_horizon"].status == "match", (name, found["dflash.schedule_horizon"])
        horizon = found["dflash.schedule_horizon"]
        assert "peak 0.0005 is reached at optimizer step 4" in horizon.observed
        assert "floor 0 is reached at the last step (40)" in horizon.observed
        assert found["dflash.optimizer_schedule"].status == "unknown"
        assert not [v for v in found.values() if getattr(v, "status", None) == "mismatch"], name
    resumed = verdicts["clean_resumed"]["dflash.optimizer_schedule"].reason
    assert "resumed: optimizer state at step 5, SequentialLR at step 5" in resumed
    assert "max_norm 1" in resumed
    # decay on the norms is reported with the recipe that does the same, not judged
    notes = " ".join(verdicts["clean_accumulated"]["notes"])
    assert "reaches norms and biases in group 1" in notes and "speculators 0.9.0 train/optimizers.py" in notes
    assert "2 backward call(s) before the observed optimizer step" in verdicts["clean_accumulated"][
        "dflash.optimizer_schedule"].reason


def test_a_group_rate_from_code_a_wrong_warmup_a_long_cosine_and_the_clip_are_mismatches(verdicts: dict) -> None:
    found = verdicts["group_warmup_cosine_clip"]
    groups = found["dflash.optimizer_groups"]
    assert groups.status == "mismatch"
    assert "AdamW group 1 (vectors 2" in groups.observed and "built with lr 0.0003" in groups.observed
    assert "lr 0.0005 (run.json (named by the command))" in groups.observed
    horizon = found["dflash.schedule_horizon"]
    assert horizon.status == "mismatch"
    assert "reaches its peak 0.0005 at optimizer step 10, not at the end of the configured warmup (step 4" in horizon.observed
    assert "at the run's last step 40 the rate is" in horizon.observed and "comes only at optimizer step 50" in horizon.observed
    clip = found["dflash.optimizer_schedule"]
    assert clip.status == "mismatch" and "clipped at max_norm 10; the run configures max_grad_norm 1" in clip.observed


def test_a_scheduler_stepped_twice_or_per_micro_batch_is_a_mismatch(verdicts: dict) -> None:
    twice = verdicts["resumed_without_schedule_stepped_twice"]["dflash.schedule_horizon"]
    assert twice.status == "mismatch"
    assert "advances 2 steps per optimizer step (0 scheduler step(s) before the first optimizer step, 2 after" in twice.observed
    micro = verdicts["stepped_per_micro_batch"]["dflash.schedule_horizon"]
    assert micro.status == "mismatch"
    assert "advances 2 steps per optimizer step" in micro.observed and "2 backward calls before" in micro.observed
    # the groups are as configured in both: no defect there, no mismatch
    assert verdicts["resumed_without_schedule_stepped_twice"]["dflash.optimizer_groups"].status == "match"
    assert verdicts["stepped_per_micro_batch"]["dflash.optimizer_groups"].status == "match"


def test_a_resume_that_restarts_the_schedule_is_a_mismatch(verdicts: dict) -> None:
    found = verdicts["resumed_without_schedule_stepped_twice"]["dflash.optimizer_schedule"]
    assert found.status == "mismatch"
    assert "restored at step 5, but SequentialLR starts the first step at its own step 0" in found.observed
