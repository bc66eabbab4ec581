"""Code read statically never yields `match` on its own: agreement is reported, not claimed.

A static reading cites one site; on defects planted blind in real upstream code the wrong all-clears came
from a correct-looking site whose value was broken one step earlier. So agreement read from code alone is
`unknown` with `static_agreement`, while a disagreeing reading is still a `mismatch`, and a run's config
(what actually ran) still decides config-level rules.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sleuth.invariants import check_invariants, load_playbook
from sleuth.trace import Trace

PLAYBOOK = load_playbook("dflash")

LOSS = '''
import torch
import torch.nn.functional as F


def decay_weights(block_size, gamma=4.0):
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0  # slot 0 holds the anchor: given, never trained
    return w


def dflash_loss(draft_logits, target_logits, block_size):
    w = decay_weights(block_size)
    ce = F.cross_entropy(draft_logits.flatten(0, 1), target_logits.argmax(-1).flatten(), reduction="none")
    return (ce.view(-1, block_size) * w).sum() / w.sum()
'''


def _findings(code: Path, config: dict | None = None):
    return {f.id: f for f in check_invariants(PLAYBOOK, reference=None, config=config,
                                              config_source="config.json" if config else None, checkpoint=None,
                                              code=code, trace=Trace())}


def test_agreement_from_code_alone_is_reported_not_claimed(tmp_path: Path):
    (tmp_path / "loss.py").write_text(LOSS)
    gamma = _findings(tmp_path)["dflash.loss_decay_gamma"]
    assert gamma.status == "unknown" and gamma.static_agreement and gamma.confidence == 0.0
    assert gamma.observed == "4.0" and "--probe" in gamma.reason
    assert any(e.kind == "code" and e.path and e.path.endswith("loss.py") for e in gamma.evidence)


def test_disagreement_from_code_alone_is_still_a_mismatch(tmp_path: Path):
    (tmp_path / "loss.py").write_text(LOSS.replace("gamma=4.0", "gamma=2.0"))
    gamma = _findings(tmp_path)["dflash.loss_decay_gamma"]
    assert gamma.status == "mismatch" and not gamma.static_agreement and gamma.observed == "2.0"


def test_the_runs_config_still_decides_a_config_level_rule(tmp_path: Path):
    (tmp_path / "loss.py").write_text(LOSS)
    gamma = _findings(tmp_path, {"loss_decay_gamma": 4.0})["dflash.loss_decay_gamma"]
    assert gamma.status == "match" and not gamma.static_agreement


def test_the_cli_marks_static_agreement_and_exits_clean(tmp_path: Path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "loss.py").write_text(LOSS)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", "--code", str(code), "--offline",
                           "--no-probe", "--out", str(out)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
                               "SLEUTH_CACHE_DIR": str(tmp_path / "cache"), "NO_COLOR": "1", "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert "loss_decay_gamma*" in done.stdout and "not claimed" in done.stdout
    report = json.loads((out / "report.json").read_text())
    gamma = next(f for f in report["findings"] if f["id"] == "dflash.loss_decay_gamma")
    assert gamma["status"] == "unknown" and gamma["static_agreement"] is True
    assert "(static agreement, not claimed)" in (out / "report.md").read_text()
