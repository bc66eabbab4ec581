"""The classes of false `match` an outside campaign found, each as a small implementation.

Names over values, any one site as proof, arguments ignored, config over code: each test writes the
defect the way a real trainer would, and checks the finding (status, location, notes), never only that
something was read.
"""

from __future__ import annotations

from pathlib import Path

from sleuth.evidence.source import analyse_texts
from sleuth.invariants import check_invariants, load_playbook
from sleuth.trace import Trace

PLAYBOOK = load_playbook("dflash")


def finding(tmp_path: Path, files: dict[str, str], invariant: str, config: dict | None = None):
    root = tmp_path / "impl"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    findings = check_invariants(PLAYBOOK, config=config, config_source="config.json" if config else None,
                                code=root, trace=Trace())
    return next(f for f in findings if f.id == invariant)


TEACHER = '''
import torch
TARGET_LAYER_IDS = [1, 9, 17, 25, 33]

def teacher(target, final_norm, lm_head, ids):
    out = target(ids, output_hidden_states=True)
    last = out.hidden_states[TARGET_LAYER_IDS[-1] + 1]
    return lm_head(final_norm(last))

def train_step(target, final_norm, lm_head, ids):
    target_logits = teacher(target, final_norm, lm_head, ids)
    return target_logits.argmax(-1)
'''


def test_a_variable_called_last_is_read_by_where_it_comes_from(tmp_path: Path) -> None:
    f = finding(tmp_path, {"train.py": TEACHER}, "dflash.target_logits_source")
    assert f.status == "mismatch" and f.observed == "intermediate"
    assert "hidden_states[TARGET_LAYER_IDS[-1] + 1]" in f.reason  # the origin, not the name, is the evidence


def test_a_parameter_named_last_hidden_with_no_caller_is_unknown_not_final(tmp_path: Path) -> None:
    code = '''
def targets(self, verifier_last_hidden_states):
    target_logits = self.verifier_lm_head(self.verifier_norm(verifier_last_hidden_states))
    return target_logits
'''
    facts = analyse_texts([("spec.py", code, None)])
    assert [r.value for r in facts.readings["dflash.target_logits_source"]] == ["final?"]


def test_a_value_stored_under_a_key_by_one_script_is_traced_in_another(tmp_path: Path) -> None:
    dump = '''
def dump(model, ids):
    hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    return {"verifier_last_hidden_states": hs[-2]}
'''
    train = '''
def step(self, sample):
    final_logits = self.verifier_lm_head(self.verifier_norm(sample["verifier_last_hidden_states"]))
    return final_logits
'''
    facts = analyse_texts([("dump.py", dump, None), ("train.py", train, None)])
    values = [(r.value, r.path) for r in facts.readings["dflash.target_logits_source"]]
    assert ("intermediate", "train.py") in values


FREEZES = '''
from torch import nn

class Drafter(nn.Module):
    def __init__(self, target):
        super().__init__()
        self.fc = nn.Linear(5 * 64, 64, bias=False)
        self.tok_emb = target.get_input_embeddings()
        self.head = target.get_output_embeddings()
        {embed_freeze}
        self.head.weight.requires_grad_(False)

def train(drafter, batch, opt):
    loss = drafter(batch).mean()
    loss.backward()
    opt.step()
'''


def test_one_freeze_site_does_not_prove_both_embed_and_head_frozen(tmp_path: Path) -> None:
    both = finding(tmp_path / "both", {"d.py": FREEZES.format(embed_freeze="self.tok_emb.weight.requires_grad_(False)")},
                   "dflash.frozen_embed_head")
    assert both.static_agreement
    one = finding(tmp_path / "one", {"d.py": FREEZES.format(embed_freeze="pass")}, "dflash.frozen_embed_head")
    assert one.status == "mismatch" and one.observed == "trained"
    assert any(e.line == 8 for e in one.evidence if e.kind == "code")  # the unfrozen holder's own line


def test_a_freeze_through_a_loop_variable_or_a_name_prefix_counts(tmp_path: Path) -> None:
    loop = FREEZES.format(embed_freeze="for t in (self.tok_emb,):\n            t.weight.requires_grad = False")
    assert finding(tmp_path / "loop", {"d.py": loop}, "dflash.frozen_embed_head").static_agreement
    prefixed = FREEZES.format(embed_freeze="pass") + '''
FROZEN = ("tok_emb.",)

def freeze(drafter):
    for name, p in drafter.named_parameters():
        if name.startswith(FROZEN):
            p.requires_grad_(False)
'''
    assert finding(tmp_path / "prefix", {"d.py": prefixed}, "dflash.frozen_embed_head").static_agreement


HELPERS = '''
import torch

class Builder:
    def __init__(self, block_size):
        self.B = block_size

    def arange_from(self, start):
        return start.unsqueeze(-1) + torch.arange(self.B)

    def build_positions(self, start):
        return self.arange_from(start)

    def visible(self, n_ctx, limit):
        kv = torch.arange(n_ctx)
        return kv[None, :] < limit[:, None]

    def __call__(self, anchor_pos, n_ctx):
        position_ids = self.build_positions(anchor_pos{pos_offset})
        mask = self.visible(n_ctx, anchor_pos{mask_offset})
        return position_ids, mask
'''


def test_an_offset_on_a_helper_argument_composes_with_the_helper(tmp_path: Path) -> None:
    right = HELPERS.format(pos_offset="", mask_offset="")
    assert finding(tmp_path / "ok", {"b.py": right}, "dflash.block_position_ids").static_agreement
    assert finding(tmp_path / "ok2", {"b.py": right}, "dflash.context_excludes_anchor").static_agreement
    shifted = HELPERS.format(pos_offset=" + 1", mask_offset=" + 1")
    positions = finding(tmp_path / "bad", {"b.py": shifted}, "dflash.block_position_ids")
    assert positions.status == "mismatch" and positions.observed == "anchor+j+1"
    leak = finding(tmp_path / "bad2", {"b.py": shifted}, "dflash.context_excludes_anchor")
    assert leak.status == "mismatch" and leak.observed == "kv <= anchor"


FLAT = '''
import torch

def position_weights(block_size):
    w = torch.ones(block_size)
    w[0] = 0.0
    return w

class Settings:
    gamma: float = 4.0

def loss(ce, block_size):
    w = position_weights(block_size)
    return (ce * w).sum() / w.sum()
'''


def test_a_gamma_default_left_behind_is_not_a_decay(tmp_path: Path) -> None:
    f = finding(tmp_path, {"loss.py": FLAT}, "dflash.loss_decay_gamma")
    assert f.status == "mismatch" and f.observed == "none"


def test_config_over_code_is_a_conflict_and_the_code_decides(tmp_path: Path) -> None:
    config = {"block_size": 16, "loss_decay_gamma": 7.0}
    f = finding(tmp_path, {"loss.py": FLAT}, "dflash.loss_decay_gamma", config=config)
    assert f.status == "mismatch" and f.observed == "none"
    assert any(n.startswith("conflict:") for n in f.notes), f.notes
    assert f.confidence < 0.75


def test_layer_ids_of_the_zlab_rule_read_at_hidden_states_i_are_one_layer_off(tmp_path: Path) -> None:
    code = '''
import torch

def zlab_layer_ids(num_layers, k):
    if k == 1:
        return [num_layers // 2]
    return [int(round(1 + n * (num_layers - 4) / (k - 1))) for n in range(k)]

def gather_features(hidden_states, layer_ids):
    return torch.cat([hidden_states[i{offset}] for i in layer_ids], dim=-1)

def step(verifier, ids, cfg):
    layer_ids = zlab_layer_ids(verifier.config.num_hidden_layers, 5)
    out = verifier(ids, output_hidden_states=True)
    return gather_features(out.hidden_states, layer_ids)
'''
    right = finding(tmp_path / "ok", {"f.py": code.format(offset=" + 1")}, "dflash.target_layer_ids")
    assert right.static_agreement
    wrong = finding(tmp_path / "bad", {"f.py": code.format(offset="")}, "dflash.target_layer_ids")
    assert wrong.status == "mismatch" and "hidden_states[i+0]" in (wrong.observed or "")
