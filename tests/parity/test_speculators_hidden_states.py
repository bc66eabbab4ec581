"""speculators' offline hidden states (hs_<i>.safetensors) as a trainer run's `hidden_states: DIR`.

The directory is made by tools/make_speculators_hidden_states_fixture.py: speculators' own `prepare-data`
over the trainer's training documents, the states at vLLM's extraction points, each file read back
through speculators' own ArrowDataset. The trainer must then compute from it what the online target
computes, and refuse a run that reads a layer the files lack.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speculators_guard import require_speculators

require_speculators()

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "make_speculators_hidden_states_fixture.py"
DOCS = "\n\n".join(
    " ".join(words[(i * 3 + j) % len(words)] for j in range(12 + i))
    for i, words in enumerate([("the cat sat on the mat and the dog ran to the park".split())] * 8)
)
VLLM_IDS = [2, 4, 5]  # speculators' default [2, L//2, L-3] for the 8-layer small target
ZLAB_IDS = [i - 1 for i in VLLM_IDS]  # the trainer's convention: id i is HF hidden_states[i + 1]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    from trainer.target.embedded import build_embedded_target

    root = tmp_path_factory.mktemp("spec_hs")
    target = build_embedded_target(root / "small", small=True, progress=False)
    docs = root / "docs.txt"
    docs.write_text(DOCS)
    out = {}
    for name, extra in (("bf16", []), ("fp8", ["--fp8"])):
        result = subprocess.run([sys.executable, str(TOOL), str(root / name), "--target", str(target),
                                 "--data", str(docs), *extra],
                                env=_env(), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        out[name] = root / name
    return {"target": target, "docs": docs, **out}


def _rows(made: dict, seq_len: int = 64):
    from trainer.data.datasets import load_documents, pack_documents
    from trainer.target.frozen import FrozenTarget

    online = FrozenTarget.load(str(made["target"]), torch.device("cpu"))
    packed = pack_documents(load_documents(str(made["docs"]), online.tokenizer, split="train"), seq_len,
                            online.pad_token_id)
    return online, packed


@pytest.mark.parametrize("variant, atol", [("bf16", 1e-5), ("fp8", None)])
def test_speculators_hidden_states_give_the_online_features_and_logits(made, variant, atol):
    from trainer.hidden_states.offline import OfflineTarget

    online, packed = _rows(made)
    offline = OfflineTarget.load(str(made[variant]), str(made["target"]), torch.device("cpu"), torch.float32,
                                 speculators_layer_ids=VLLM_IDS)
    offline.cache.check_serves(target_fingerprint=online.fingerprint, data_fingerprint=packed.fingerprint,
                               seq_len=64, layers=ZLAB_IDS + [online.num_layers - 1])
    args = (packed.input_ids, packed.position_ids, packed.doc_ids, ZLAB_IDS, "final")
    want_features, want_logits = online.forward_packed(*args)
    got_features, got_logits = offline.forward_packed(*args)
    real = (packed.doc_ids >= 0)[..., None]  # padding carries no loss and no anchor
    if atol is not None:
        torch.testing.assert_close(got_features * real, want_features * real, atol=atol, rtol=1e-5)
        torch.testing.assert_close(got_logits * real, want_logits * real, atol=1e-4, rtol=1e-4)
    else:  # fp8 e4m3 (3 mantissa bits, per-token scale): the teacher's argmax mostly survives
        relative = ((got_features - want_features) * real).abs().amax() / want_features.abs().amax()
        assert float(relative) < 0.07
        agree = (got_logits.argmax(-1) == want_logits.argmax(-1))[packed.doc_ids >= 0].float().mean()
        assert float(agree) > 0.9


def _config(path: Path, made: dict, **changes) -> Path:
    config = {"target": str(made["target"]), "data": str(made["docs"]), "seq_len": 64, "batch_size": 2,
              "block_size": 4, "max_anchors": 6, "draft_layers": 3, "target_layer_ids": ZLAB_IDS, "lr": 3e-3,
              "warmup_steps": 0, "steps": 3, "log_every": 1, "eval_every": None, "eval_prompts": 1,
              "eval_max_new_tokens": 4, "checkpoint_every": 3, **changes}
    path.write_text(json.dumps(config))
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.cli", *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=600)


def test_training_from_speculators_hidden_states_matches_online(made, tmp_path):
    runs = tmp_path / "runs"
    online = _run("run", "online", "--config", str(_config(tmp_path / "a.json", made)), "--runs-dir", str(runs),
                  "--quiet")
    assert online.returncode == 0, online.stderr[-3000:]
    offline_config = _config(tmp_path / "b.json", made, hidden_states=str(made["bf16"]),
                             hidden_states_layers=VLLM_IDS)
    offline = _run("run", "offline", "--config", str(offline_config), "--runs-dir", str(runs), "--quiet")
    assert offline.returncode == 0, offline.stderr[-3000:]
    rows = [[json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("online", "offline")]
    assert [r["step"] for r in rows[1]] == [1, 2, 3]
    for a, b in zip(*rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5), (a, b)
        assert b["acc"] == pytest.approx(a["acc"], abs=1e-6)


def test_a_layer_the_files_lack_is_refused_in_one_line(made, tmp_path):
    config = _config(tmp_path / "c.json", made, hidden_states=str(made["bf16"]), hidden_states_layers=VLLM_IDS,
                     target_layer_ids=[1, 2, 4])
    result = _run("run", "lacking", "--config", str(config), "--runs-dir", str(tmp_path / "runs"), "--quiet")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "lack layer(s) [2]" in result.stderr and "Traceback" not in result.stderr
    wrong_count = _config(tmp_path / "d.json", made, hidden_states=str(made["bf16"]), hidden_states_layers=[2, 4])
    result = _run("run", "count", "--config", str(wrong_count), "--runs-dir", str(tmp_path / "runs"), "--quiet")
    assert result.returncode == 2 and "stores 4 layers" in result.stderr, result.stderr[-3000:]
