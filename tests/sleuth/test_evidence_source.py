"""Static source analysis: semantic patterns, dataflow-lite, switches, and never importing the code."""

from __future__ import annotations

from pathlib import Path

import pytest

from sleuth.evidence.source import analyse_path, analyse_texts
from sleuth.invariants import check_invariants, load_playbook
from sleuth.trace import Trace


def values(texts: dict[str, str], invariant: str) -> list[tuple[object, str]]:
    facts = analyse_texts((path, text, None) for path, text in texts.items())
    return [(r.value, r.mode) for r in facts.readings[invariant]]


def test_analysed_code_is_never_imported_or_run(tmp_path: Path):
    marker = tmp_path / "ran"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\nraise SystemExit(3)\nimport not_a_module\n")
    facts = analyse_path(tmp_path)
    assert not marker.exists()
    assert facts.files and not facts.errors


def test_unparseable_file_is_reported_and_others_still_analysed(tmp_path: Path):
    (tmp_path / "broken.py").write_text("def mask_mod(b, h, q_idx, kv_idx:\n    return kv_idx <= anchor\n")
    (tmp_path / "ok.py").write_text("def f(anchors, B, S):\n    def mask_mod(b, h, q_idx, kv_idx):\n"
                                    "        return kv_idx < anchors[b, q_idx // B]\n    return mask_mod\n")
    facts = analyse_path(tmp_path)
    assert [e.path for e in facts.errors] == [f"{tmp_path.name}/broken.py"]
    assert [r.value for r in facts.readings["dflash.context_excludes_anchor"]] == ["kv < anchor"]
    findings = {f.id: f for f in check_invariants(load_playbook(), reference=None, config=None, config_source=None,
                                                   checkpoint=None, code=tmp_path, trace=Trace())}
    assert findings["dflash.context_excludes_anchor"].static_agreement
    unknown = findings["dflash.target_shift"]
    assert unknown.status == "unknown" and "broken.py" in unknown.reason


def test_only_broken_code_is_unknown_not_mismatch(tmp_path: Path):
    (tmp_path / "broken.py").write_text("kv_idx <= anchor +\n")
    findings = check_invariants(load_playbook(), reference=None, config=None, config_source=None, checkpoint=None,
                                code=tmp_path, trace=Trace())
    assert {f.status for f in findings} == {"unknown"}


def test_behaviour_behind_a_switch_is_config_driven():
    code = ("def mask(anchors, B, include):\n    def mask_mod(b, h, q_idx, kv_idx):\n"
            "        a = anchors[b, q_idx // B]\n        return (kv_idx <= a) if include else (kv_idx < a)\n    return mask_mod\n")
    assert sorted(values({"m.py": code}, "dflash.context_excludes_anchor")) == [("kv < anchor", "switch"), ("kv <= anchor", "switch")]
    code_offset = "def vis(kv_pos, anchor_pos, include_anchor):\n    return kv_pos < anchor_pos + int(include_anchor)\n"
    assert values({"m.py": code_offset}, "dflash.context_excludes_anchor") == [("kv < anchor", "switch")]


def test_dsparks_variant_branch_is_not_dflash_evidence():
    code = ("import torch\nclass M:\n    def targets(self, logits, anchors, B):\n"
            "        idx = anchors[:, None] + torch.arange(B)\n"
            "        src = idx if self.config.sample_from_anchor else idx - 1\n        return logits[:, src]\n")
    assert values({"m.py": code}, "dflash.target_shift") == [("p+j-1", "hardcoded")]


def test_polarity_of_blocked_regions():
    allowed = "import torch\ndef bias(starts, S):\n    k_pos = torch.arange(S)\n    return torch.where(k_pos[None] < starts[:, None], 0.0, float('-inf'))\n"
    blocked = "import torch\ndef bias(starts, S):\n    k_pos = torch.arange(S)\n    return torch.where(k_pos[None] > starts[:, None], float('-inf'), 0.0)\n"
    via_name = ("import torch\ndef bias(scores, starts, S):\n    key_pos = torch.arange(S)\n"
                "    hide = key_pos[None] >= starts[:, None]\n    return scores.masked_fill(hide, float('-inf'))\n")
    assert values({"a.py": allowed}, "dflash.context_excludes_anchor") == [("kv < anchor", "hardcoded")]
    assert values({"b.py": blocked}, "dflash.context_excludes_anchor") == [("kv <= anchor", "hardcoded")]
    assert values({"c.py": via_name}, "dflash.context_excludes_anchor") == [("kv < anchor", "hardcoded")]


def test_fc_multiplier_resolved_through_call_site_and_slices():
    code = ("from torch import nn\nclass Fusion(nn.Module):\n    def __init__(self, hidden, n_in):\n"
            "        super().__init__()\n        self.mix = nn.Linear(n_in * hidden, hidden)\n"
            "class Drafter(nn.Module):\n    def __init__(self, hidden, taps):\n        super().__init__()\n"
            "        self.fusion = Fusion(hidden, len(taps[:4]))\n")
    assert values({"m.py": code}, "dflash.fc_input_layers") == [("subset", "hardcoded")]
    runtime = "from torch import nn\ndef build(hidden, num_features):\n    return nn.Linear(num_features * hidden, hidden)\n"
    assert values({"m.py": runtime}, "dflash.fc_input_layers") == [("config", "switch")]


def test_gamma_defaults_from_fields_params_and_get():
    dataclass_code = ("from dataclasses import dataclass\nimport torch\n@dataclass\nclass Cfg:\n    decay_gamma: float = 7.0\n"
                      "def w(k, decay_gamma):\n    return torch.exp(-(k - 1) / decay_gamma)\n"
                      "def step(k, cfg: Cfg):\n    return w(k, cfg.decay_gamma)\n")
    assert (7.0, "default") in values({"m.py": dataclass_code}, "dflash.loss_decay_gamma")
    # a field that merely shares the parameter's name is not on the decay's value path
    unrelated = dataclass_code.rsplit("def step", 1)[0]
    assert values({"m.py": unrelated}, "dflash.loss_decay_gamma") == [(None, "switch")]
    get_code = ("import torch\ndef w(k, **kw):\n    gamma = kw.get('gamma', 4.0)\n    return torch.exp(-(k - 1) / gamma)\n")
    assert values({"m.py": get_code}, "dflash.loss_decay_gamma")[0][0] == 4.0


def test_layer_selection_function_is_evaluated_statically():
    code = ("def layer_ids(n_layers, n_draft):\n    if n_draft == 1:\n        return [n_layers // 2]\n"
            "    lo, hi = 1, n_layers - 3\n    return [round(lo + i * (hi - lo) / (n_draft - 1)) for i in range(n_draft)]\n")
    assert values({"m.py": code}, "dflash.target_layer_ids") == [("evenly-1-to-L-3", "default")]
    shifted = "def layer_ids(n_layers, n_draft):\n    return [round(2 + i * (n_layers - 4) / (n_draft - 1)) for i in range(n_draft)]\n"
    assert values({"m.py": shifted}, "dflash.target_layer_ids")[0][0].startswith("other")


def test_target_shift_follows_functions_across_files():
    util = "import torch\ndef block_index(anchors, block_size):\n    return anchors[..., None] + torch.arange(block_size)\n"
    loss = ("from util import block_index\ndef targets(teacher_logits, anchors, B):\n"
            "    return teacher_logits.gather(1, block_index(anchors, B) - 1)\n")
    assert values({"util.py": util, "loss.py": loss}, "dflash.target_shift") == [("p+j-1", "hardcoded")]


@pytest.mark.parametrize("expression, reason", [
    ("+".join(["a"] * 200_000), "too deeply nested for Python's parser"),  # the parser itself gives up
    ("-" * 300 + "1", "nested more than"),  # parses, but deeper than the analysis recurses
])
def test_a_deeply_nested_file_is_left_out_with_its_reason_and_the_rest_is_read(expression: str, reason: str):
    facts = analyse_texts([
        ("generated.py", f"x = {expression}\n", None),
        ("loss.py", "import torch\n\ndef w(k, gamma=7.0):\n    return torch.exp(-(k - 1) / gamma)\n", None),
    ])
    assert [e.path for e in facts.errors] == ["generated.py"] and reason in facts.errors[0].message
    assert facts.files == ["loss.py"]
    assert [r.value for r in facts.readings["dflash.loss_decay_gamma"]] == [7.0]
