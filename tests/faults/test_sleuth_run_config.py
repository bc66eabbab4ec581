"""`sleuth diagnose` on a real v5 run whose config.json is damaged: never a clean bill from the code's defaults.

The run is made once by the real trainer (`trainer run v5 --preset v5` on the small embedded target, 2 steps), so
its code/ copy, checkpoint and run.json are exactly what a user has. Each case then damages config.json
(missing, empty, truncated, a list, a string, not UTF-8, a directory, wrongly typed values) and runs the real
CLI in a subprocess. The policy under test (README "When the run's config cannot be read"):

  * every invariant the config decides (the playbook's `observed.config`) is `unknown`, its reason naming
    the problem, never a `match` filled from the code's defaults;
  * the run is not reported clean: exit 1, the report's `input_problems` says why;
  * a config that reads as a mapping but holds a wrongly typed value makes that invariant `unknown`;
  * no traceback; the report files are written.

A file holding a 200,000-term expression in the run's code/ is skipped with its reason; the rest is read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from sleuth.commands.diagnose import app
from tests.timing import scaled_timeout

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# Tiny, so the real run takes seconds: the config keys sleuth checks keep their v5 values.
TINY = ["--steps", "2", "--set", "batch_size=2", "--set", "seq_len=64", "--set", "eval_prompts=1",
        "--set", "eval_max_new_tokens=4", "--set", "warmup_steps=1"]


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("DFLASH_CACHE_DIR", str(tmp / "dflash-cache"))
    env["SLEUTH_CACHE_DIR"] = str(tmp / "sleuth-cache")
    env["SLEUTH_CONFIG_FILE"] = str(tmp / "no-sleuth-config.yaml")
    env.pop("SLEUTH_SPECULATORS_PATH", None)
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def real_v5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.target.embedded import build_embedded_target

    root = tmp_path_factory.mktemp("real-run")
    runs = root / "runs"
    # The embedded target's small twin (same depth, so v5's layer ids are v5's), built in seconds: a fresh
    # cache would otherwise build the full embedded target inside the run (a minute of CPU, many at load 8).
    target = build_embedded_target(root / "target", small=True, steps=1, progress=False)
    done = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "run", "v5", "--preset", "v5", "--runs-dir", str(runs), "-q", *TINY,
         "--set", f"target={target}"],
        cwd=root, env=_env(root), capture_output=True, text=True, timeout=scaled_timeout(240),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    run = runs / "v5"
    assert (run / "config.json").is_file() and (run / "code").is_dir()
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "runs" / run.name
    shutil.copytree(run, target, ignore=shutil.ignore_patterns("diagnosis"))
    return target


def _diagnose(run: Path, tmp_path: Path, *, subprocess_cli: bool = False) -> tuple[int, dict, str]:
    """The CLI on `run`: in process (fast), or as a real subprocess for the exit code a shell sees."""
    args = ["--run", str(run), "--offline", "--format", "json", "--out", str(tmp_path / "diagnosis")]
    if subprocess_cli:
        done = subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", *args], cwd=tmp_path,
                              env=_env(tmp_path), capture_output=True, text=True, timeout=scaled_timeout(300))
        code, out, err = done.returncode, done.stdout, done.stderr
    else:
        result = CliRunner().invoke(app, args)
        code, out, err = result.exit_code, result.stdout, result.stderr
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in out + err, err[-2000:]
    return code, (json.loads(out) if out.strip() else {}), err


@pytest.fixture(autouse=True)
def _isolated_sleuth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "sleuth-cache"))
    monkeypatch.setenv("SLEUTH_CONFIG_FILE", str(tmp_path / "no-sleuth-config.yaml"))
    monkeypatch.delenv("SLEUTH_SPECULATORS_PATH", raising=False)


def _config_level_ids() -> set[str]:
    playbook = yaml.safe_load((REPO / "playbooks" / "dflash.yaml").read_text())
    return {inv["id"] for inv in playbook["invariants"] if (inv.get("observed") or {}).get("config")}


def test_the_intact_run_gives_the_v5_mismatches(real_v5: Path, tmp_path: Path) -> None:
    code, report, stderr = _diagnose(_copy(real_v5, tmp_path), tmp_path)
    assert code == 1, stderr
    mismatches = {f["id"] for f in report["findings"] if f["status"] == "mismatch"}
    assert {"dflash.fc_input_layers", "dflash.target_logits_source", "dflash.loss_decay_gamma"} <= mismatches
    assert report["input_problems"] == []


DAMAGES = {
    "missing": lambda p: p.unlink(),
    "empty": lambda p: p.write_text(""),
    "truncated": lambda p: p.write_text(p.read_text()[: len(p.read_text()) // 2]),
    "a list": lambda p: p.write_text(json.dumps([json.loads(p.read_text())])),
    "a string": lambda p: p.write_text('"v5"'),
    "not UTF-8": lambda p: p.write_bytes(b'{"block_size": 8, "loss_decay_gamma": "\xff\xfe"}'),
    "a directory": lambda p: (p.unlink(), p.mkdir()),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_run_whose_config_cannot_be_read_is_not_reported_clean(damage: str, real_v5: Path, tmp_path: Path) -> None:
    run = _copy(real_v5, tmp_path)
    DAMAGES[damage](run / "config.json")
    # One case through a real subprocess: the exit status a shell or CI sees.
    code, report, stderr = _diagnose(run, tmp_path, subprocess_cli=damage == "missing")
    assert code == 1, f"{damage}: exit {code}, {stderr}"
    assert report["input_problems"] and "config.json" in report["input_problems"][0]
    by_id = {f["id"]: f for f in report["findings"]}
    config_level = _config_level_ids()
    assert config_level and config_level <= set(by_id)
    for inv_id in config_level:
        finding = by_id[inv_id]
        # Code-level violations that no config could change may still be mismatches; never a match.
        assert finding["status"] != "match", f"{damage}: {inv_id} {finding['reason']}"
        if finding["status"] == "unknown":
            assert "config.json" in finding["reason"], finding["reason"]
    assert "No mismatch" not in report["summary"]
    assert (tmp_path / "diagnosis" / "report.md").is_file()


WRONG_TYPES = {
    "loss_decay_gamma": ("seven", "dflash.loss_decay_gamma"),
    "context_includes_anchor": ("no", "dflash.context_excludes_anchor"),
    "fc_layers": ("all of them", "dflash.fc_input_layers"),
    "target_logits_source": ([5], "dflash.target_logits_source"),
    "loss": (3, "dflash.loss_kind"),
}


@pytest.mark.parametrize("key", sorted(WRONG_TYPES))
def test_a_wrongly_typed_config_value_is_unknown_not_the_code_default(key: str, real_v5: Path, tmp_path: Path) -> None:
    run = _copy(real_v5, tmp_path)
    config = json.loads((run / "config.json").read_text())
    value, inv_id = WRONG_TYPES[key]
    config[key] = value
    (run / "config.json").write_text(json.dumps(config))
    code, report, stderr = _diagnose(run, tmp_path)
    assert code in (0, 1), stderr
    finding = next(f for f in report["findings"] if f["id"] == inv_id)
    if any(e.get("kind") == "probe" for e in finding.get("evidence", [])):
        # A probe ran the run's own code on this very config ("no" is False to pydantic): a measurement of what
        # the trainer does with it, not a code default filling a gap; the static reading's doubt stays a note.
        assert any(key in note and "not a valid value" in note for note in finding["notes"] + [finding["reason"]]) \
            or "probe decided" in " ".join(finding["notes"]), finding
    else:
        assert finding["status"] == "unknown", finding
        assert key in finding["reason"] and "not a valid value" in finding["reason"]


def test_a_200000_term_expression_in_the_code_is_skipped_and_the_rest_is_read(real_v5: Path, tmp_path: Path) -> None:
    run = _copy(real_v5, tmp_path)
    (run / "code" / "generated.py").write_text("total = " + " + ".join(["x"] * 200_000) + "\n")
    code, report, stderr = _diagnose(run, tmp_path)
    assert code == 1, stderr  # v5's mismatches are still found from the other files
    step = next(s for s in report["trace"] if s["step"] == "analyse-code")
    assert "generated.py" in step["outcome"] and "nested" in step["outcome"]
    mismatches = {f["id"] for f in report["findings"] if f["status"] == "mismatch"}
    assert "dflash.target_logits_source" in mismatches
    code_matches = [f for f in report["findings"] if (f["status"] == "match" or f["static_agreement"])
                    and any(e["kind"] == "code" for e in f["evidence"])]
    assert code_matches, "the other files must still be analysed"
