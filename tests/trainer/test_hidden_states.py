"""Offline hidden states: generation, training from them with the same losses as online, and refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

# The embedded target's small twin and the trainer CLI in a subprocess, shared with the end-to-end tests.
from test_train_e2e import small_target, trainer_cli  # noqa: F401 (small_target is a fixture)


def tiny(target: Path, **changes) -> list[str]:
    sets = {"target": str(target), "seq_len": 64, "batch_size": 2, "block_size": 4, "max_anchors": 4,
            "draft_layers": 5, "eval_every": "null", "eval_prompts": 1, "eval_max_new_tokens": 4, "log_every": 1,
            "checkpoint_every": 5, "warmup_steps": 1,
            **changes}
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def model_rows(run: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["acc"], r["position_acc"], r["streak"], r["eal"]) for r in rows]


def generate_cache(cache: Path, target: Path, preset: str) -> Path:
    made = trainer_cli("hidden-states", "generate", "--out", str(cache), "--preset", preset, *tiny(target),
                       "--rows-per-shard", "8")
    assert made.returncode == 0, made.stderr
    return cache


@pytest.fixture(scope="module")
def fixed_cache(small_target, tmp_path_factory) -> Path:
    """The `fixed` preset's cache, generated once: the [fixed] case trains from it (reading only) and the
    resume test damages a copy of it. `fixed` is the defaults (config.PRESETS), so its inputs are those of a
    generation without --preset, which is what the resume test regenerates with."""
    return generate_cache(tmp_path_factory.mktemp("hs-fixed") / "hs", small_target, "fixed")


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fixed", "v5"])  # v5: teacher logits from an intermediate layer
def test_offline_training_equals_online_on_the_same_batches(small_target, tmp_path, preset, request):
    if preset == "fixed":
        cache = request.getfixturevalue("fixed_cache")
    else:
        cache = generate_cache(tmp_path / "hs", small_target, preset)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["complete"] and manifest["logits_check"]["max_abs_logit_diff"] <= 1e-5
    runs = tmp_path / "runs"
    online = trainer_cli("run", "online", "--preset", preset, *tiny(small_target), "--steps", "5", "--runs-dir", str(runs), "-q")
    assert online.returncode == 0, online.stderr
    offline = trainer_cli("run", "offline", "--preset", preset, *tiny(small_target, hidden_states=str(cache)),
                      "--steps", "5", "--runs-dir", str(runs), "-q")
    assert offline.returncode == 0, offline.stderr
    assert model_rows(runs / "offline") == model_rows(runs / "online")


@pytest.mark.slow
def test_generation_resumes_and_a_cache_for_other_inputs_is_refused(small_target, fixed_cache, tmp_path):
    cache = tmp_path / "hs"
    shutil.copytree(fixed_cache, cache)  # a complete first generation, as `generate` without --preset writes it
    shards = sorted(cache.glob("shard-*.safetensors"))
    assert len(shards) >= 2
    kept = {p.name: p.stat().st_mtime_ns for p in shards[1:]}
    shards[0].unlink()  # as a killed generation leaves it: one shard missing
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["complete"] = False
    (cache / "manifest.json").write_text(json.dumps(manifest))
    again = trainer_cli("hidden-states", "generate", "--out", str(cache), *tiny(small_target), "--rows-per-shard", "8")
    assert again.returncode == 0, again.stderr
    assert shards[0].exists() and {p.name: p.stat().st_mtime_ns for p in shards[1:]} == kept  # only the missing one
    assert json.loads((cache / "manifest.json").read_text())["complete"]

    runs = tmp_path / "runs"
    other_len = trainer_cli("run", "x", *tiny(small_target, seq_len=96, hidden_states=str(cache)), "--steps", "1",
                        "--runs-dir", str(runs), "-q")
    assert other_len.returncode == 2 and "other packed data" in other_len.stderr
    assert "Traceback" not in other_len.stderr and len(other_len.stderr.strip().splitlines()) == 1
    stored = json.loads((cache / "manifest.json").read_text())
    absent = [i for i in range(stored["target"]["num_layers"]) if i not in stored["layers"]]
    assert absent, stored["layers"]
    other_layers = trainer_cli("run", "y", *tiny(small_target, hidden_states=str(cache), draft_layers=1,
                                             target_layer_ids=f"[{absent[0]}]"),
                           "--steps", "1", "--runs-dir", str(runs), "-q")
    assert other_layers.returncode == 2 and "lack layer" in other_layers.stderr
    other_dir = trainer_cli("hidden-states", "generate", "--out", str(cache), *tiny(small_target, seq_len=96))
    assert other_dir.returncode == 2 and "other inputs" in other_dir.stderr
    missing = trainer_cli("run", "z", *tiny(small_target, hidden_states=str(tmp_path / "nothing")), "--steps", "1",
                      "--runs-dir", str(runs), "-q")
    assert missing.returncode == 2 and "not a hidden-state cache" in missing.stderr
