"""Where expected values come from: reference source (static), else docs (low confidence), else pinned facts.

The reference here is a tiny source text written for the test (not any real project's code), handed over
as a Resolution-shaped object.
"""

from __future__ import annotations

from types import SimpleNamespace

from sleuth.invariants import check_invariants, load_playbook
from sleuth.trace import Trace

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REF_LOSS = '''import torch
def slot_decay(pos, gamma):
    w = torch.exp(-((pos - 1).clamp(min=0)) / gamma)
    return w * (pos != 0)
def train(batch, gamma: float = 5.0):
    return slot_decay(batch, gamma)
'''
REF_MASK = '''def build(anchors, block_size, S):
    def mask_mod(b, h, q_idx, kv_idx):
        anchor = anchors[q_idx // block_size]
        return ((kv_idx < S) & (kv_idx < anchor)) | ((kv_idx >= S) & ((kv_idx - S) // block_size == q_idx // block_size))
    return mask_mod
'''


def resolution(files=None, docs=None, pinned=None, tier="local"):
    def f(path, text):
        return SimpleNamespace(path=path, tier=tier, source=path, commit=COMMIT, sha256="0", text=text)
    return SimpleNamespace(reference="toy", tier=tier, commit=COMMIT if files else None,
                           files=[f(p, t) for p, t in (files or {}).items()], docs=[f(p, t) for p, t in (docs or {}).items()],
                           pinned=pinned or {}, trace=[])


def findings(ref, config):
    return {f.id: f for f in check_invariants(load_playbook(), reference=ref, config=config, config_source="runs/x/config.json",
                                              checkpoint=None, code=None, trace=Trace())}


def test_expected_gamma_is_read_from_the_reference_source():
    ref = resolution({"src/speculators/losses/utils.py": REF_LOSS, "src/speculators/models/dflash/attention.py": REF_MASK})
    out = findings(ref, {"loss_decay_gamma": 5.0, "block_size": 8, "context_includes_anchor": False})
    gamma = out["dflash.loss_decay_gamma"]
    assert gamma.expected == "5.0" and gamma.status == "match"
    cite = next(e for e in gamma.evidence if e.kind == "reference")
    assert cite.location == f"src/speculators/losses/utils.py:5@{COMMIT[:12]}" and cite.commit == COMMIT
    anchor = out["dflash.context_excludes_anchor"]
    assert anchor.status == "match"
    assert next(e for e in anchor.evidence if e.kind == "reference").location.startswith("src/speculators/models/dflash/attention.py:4@")


def test_missing_reference_file_falls_back_to_pinned_with_lower_confidence():
    ref = resolution({"src/speculators/losses/utils.py": REF_LOSS})  # no attention.py
    anchor = findings(ref, {"context_includes_anchor": True})["dflash.context_excludes_anchor"]
    assert anchor.status == "mismatch"
    assert any(e.kind == "pinned" for e in anchor.evidence)
    assert any("missing" in n for n in anchor.notes)
    assert anchor.confidence < 0.95


def test_docs_only_reference_gives_low_confidence_expected():
    ref = resolution(docs={"https://example.org/dflash": "The decay gamma defaults to 6 for every block size."}, tier="docs")
    gamma = findings(ref, {"loss_decay_gamma": 6.0, "block_size": 8})["dflash.loss_decay_gamma"]
    assert gamma.expected == "6.0" and gamma.status == "match"
    assert any(e.kind == "docs" for e in gamma.evidence) and gamma.confidence <= 0.6


def test_pinned_facts_of_the_resolution_are_used_and_stated():
    pinned = {"dflash.loss_decay_gamma": {"expected": {"weight": "exp", "default_gamma": 4.0},
                                          "location": "src/speculators/losses/utils.py:17-48", "commit": COMMIT}}
    gamma = findings(resolution(pinned=pinned, tier="pinned"), {"loss_decay_gamma": 7.0, "block_size": 8})["dflash.loss_decay_gamma"]
    assert gamma.status == "mismatch" and gamma.expected == "4.0"
    pin = next(e for e in gamma.evidence if e.kind == "pinned")
    assert pin.location == f"src/speculators/losses/utils.py:17-48@{COMMIT[:12]}"
    assert any("pinned" in n for n in gamma.notes)


def test_gamma_seven_needs_the_block_size():
    out = findings(None, {"loss_decay_gamma": 7.0})
    assert out["dflash.loss_decay_gamma"].status == "unknown"
    assert "block size" in out["dflash.loss_decay_gamma"].reason
    assert findings(None, {"loss_decay_gamma": 7.0, "block_size": 16})["dflash.loss_decay_gamma"].status == "match"


def test_works_with_the_real_resolution_model_when_present():
    try:
        from sleuth.reference.model import Resolution, ResolvedFile
    except ImportError:  # the fetch helper's module is optional for the engine
        return
    file = ResolvedFile(path="src/speculators/models/dflash/attention.py", tier="local", source="x", commit=COMMIT,
                        sha256="0", fetched_at="2026-01-01T00:00:00Z", text=REF_MASK)
    ref = Resolution(reference="speculators", tier="local", commit=COMMIT, files=[file], docs=[], pinned={}, trace=[])
    anchor = findings(ref, {"context_includes_anchor": False})["dflash.context_excludes_anchor"]
    assert anchor.status == "match" and any(e.kind == "reference" for e in anchor.evidence)
