"""The three ways to probe a trainer, on one trainer (examples/anyprobe/tiny_dflash.py) with a planted defect:
no adapter (its pieces located and called), the entry `sleuth probe init` wrote, and an entry written by hand.
Each must find the defect with probe evidence and report no other mismatch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "anyprobe"


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    code = tmp_path_factory.mktemp("three-ways") / "anyprobe"
    shutil.copytree(EXAMPLE, code)
    source = (code / "tiny_dflash.py").read_text()
    leaking = source.replace("context = torch.arange(s)[None, None, :] < anchor[..., None]",
                             "context = torch.arange(s)[None, None, :] <= anchor[..., None]")
    assert leaking != source
    (code / "tiny_dflash.py").write_text(leaking)
    return code


@pytest.mark.slow
@pytest.mark.parametrize("entry", [None, "probe_entry_scaffolded:subject", "probe_entry_handwritten:subject"],
                         ids=["no-adapter", "scaffolded", "hand-written"])
def test_each_way_finds_the_planted_leak_and_nothing_else(planted: Path, entry: str | None, tmp_path: Path):
    args = ["--code", str(planted), "--offline", "--format", "json", "--out", str(tmp_path / "out")]
    args += ["--probe-entry", entry] if entry else ["--probe"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLEUTH_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", *args], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 1, done.stderr
    findings = {f["id"]: f for f in json.loads(done.stdout)["findings"]}
    leak = findings["dflash.context_excludes_anchor"]
    assert leak["status"] == "mismatch"
    assert leak["evidence"][0]["kind"] == "probe"
    expected_location = "probe:located-mask" if entry is None else "probe:dependence-map"
    assert leak["evidence"][0]["location"] == expected_location
    assert sorted(i for i, f in findings.items() if f["status"] == "mismatch") == ["dflash.context_excludes_anchor"]
