"""Attention / fusion readings that follow the value, not one site or one name (issue 11, second round).

Each class of silent false match found on real upstream code, written in several small styles that are not
copies of any upstream text: an offset that reaches the anchor comparison through a repeat, a reassignment or a
caller; block positions built by a helper from a shifted argument or from a packed index; a mask whose block
clause lost its same-block condition, or whose context clause compares a wrapped key index; a causal switch
that reaches full-attention layers; a norm module that is `nn.Identity`; one fusion definition broken next to
a correct copy; values projected with the key projection; a serving loop that keeps one context slot too
many. Every broken style must be a `mismatch`; every correct twin a `match` (or, where the path is cut, never
a `match`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sleuth.invariants import check_invariants, load_playbook
from sleuth.trace import Trace

PLAYBOOK = load_playbook("dflash")


def status(tmp_path: Path, files: dict[str, str], invariant: str) -> tuple[str, str]:
    root = tmp_path / "impl"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    findings = check_invariants(PLAYBOOK, config=None, config_source=None, code=root, trace=Trace())
    found = next(f for f in findings if f.id == invariant)
    # What the reader reads: agreement from code alone is reported unknown (static_agreement), not claimed.
    return ("match" if found.static_agreement else found.status), found.reason


# --- the anchor's path into the comparison --------------------------------------------------------------

FLEX_REPEAT = '''
import torch

def make_mask_mod(seq_len, starts, blk):
    per_query = torch.repeat_interleave(starts{shift}, blk)

    def mod(b, h, q_idx, kv_idx):
        a = per_query[q_idx]
        return (kv_idx < seq_len) & (kv_idx < a)
    return mod
'''

DENSE_REASSIGNED = '''
import torch

def visibility(n_ctx, anchors, B):
    kv = torch.arange(n_ctx)[None, :]
    anchors = anchors.long().view(-1, 1)
    anchors = anchors{shift}
    return kv < anchors.repeat_interleave(B, dim=0)
'''


@pytest.mark.parametrize("template", [FLEX_REPEAT, DENSE_REASSIGNED], ids=["flex-repeat", "dense-reassigned"])
@pytest.mark.parametrize("shift,expected", [("", "match"), (" + 1", "mismatch")])
def test_an_offset_on_the_way_to_the_anchor_comparison_counts(tmp_path, template, shift, expected):
    got, reason = status(tmp_path, {"mask.py": template.format(shift=shift)}, "dflash.context_excludes_anchor")
    assert got == expected, reason


BUILDER = '''
import torch

def build(n_ctx, anchor_pos, B):
    kv = torch.arange(n_ctx)[None, :]
    return kv < anchor_pos.repeat_interleave(B)[:, None]
'''

CALLERS = '''
from mask import build

class Drafter:
    def masks(self, n_ctx, picked, B):
        full = build(n_ctx, anchor_pos=picked, B=B)
        other = build(n_ctx, {second}, B)
        return full, other
'''


@pytest.mark.parametrize("second,expected", [("picked", "match"), ("picked + 1", "mismatch")])
def test_every_call_site_of_the_mask_builder_counts(tmp_path, second, expected):
    files = {"mask.py": BUILDER, "model.py": CALLERS.format(second=second)}
    got, reason = status(tmp_path, files, "dflash.context_excludes_anchor")
    assert got == expected, reason
    if expected == "mismatch":
        assert "picked + 1" in reason  # the report says where the offset enters


def test_a_call_site_that_does_not_pass_the_anchors_is_not_a_match(tmp_path):
    caller = '''
from mask import build

def step(n_ctx, B, **extra):
    return build(n_ctx, B=B, **extra)
'''
    got, _ = status(tmp_path, {"mask.py": BUILDER, "step.py": caller}, "dflash.context_excludes_anchor")
    assert got != "match"


# --- block positions ---------------------------------------------------------------------------------------

POSITIONS = '''
import torch

def block_positions(first, size):
    first = first.reshape(-1)
    return (first[:, None] + torch.arange(size)[None, :]).reshape(-1)

def same_document(doc, q_anchor, kv):
    return doc[q_anchor] == doc[kv]

def forward(pos, anchors, doc, size):
    blk = block_positions({arg}, size)
    rope_positions = torch.cat([pos, blk[None]], dim=1)
    return rope_positions
'''


@pytest.mark.parametrize("arg,expected", [
    ("pos[0, anchors]", "match"),
    ("pos[0, anchors] + 1", "mismatch"),   # an offset on the helper's argument
    ("pos.gather(1, anchors[None])[0]", "match"),
    ("anchors", "mismatch"),               # the packed index, where packed documents restart their positions
])
def test_block_positions_follow_the_helper_argument(tmp_path, arg, expected):
    got, reason = status(tmp_path, {"pos.py": POSITIONS.format(arg=arg)}, "dflash.block_position_ids")
    assert got == expected, reason


# --- block isolation read from the whole mask ----------------------------------------------------------

DENSE_BLOCKS = '''
import torch

def dense_mask(anchors, S, B):
    n = anchors.numel() * B
    q = torch.arange(n)[:, None]
    kv = torch.arange(S + n)[None, :]
    ctx = (kv < S) & (kv < anchors.repeat_interleave(B)[:, None])
    in_blocks = kv >= S
    blk = {block_rule}
    return ctx | blk
'''


@pytest.mark.parametrize("block_rule,expected", [
    ("in_blocks & ((kv - S) // B == q // B)", "match"),
    ("in_blocks", "mismatch"),
])
def test_a_block_clause_without_the_same_block_condition_is_cross_block(tmp_path, block_rule, expected):
    got, reason = status(tmp_path, {"m.py": DENSE_BLOCKS.format(block_rule=block_rule)}, "dflash.blocks_isolated")
    assert got == expected, reason


FLEX_PIECES = '''
import torch
from torch.nn.attention.flex_attention import and_masks, or_masks

def block_mask(anchors, doc, S, B):
    def ctx_piece(b, h, q, kv):
        pos = kv % S
        return {ctx_rule}

    def doc_piece(b, h, q, kv):
        return (kv >= S) | (doc[kv.clamp(max=S - 1)] == doc[anchors[q // B]])

    def own_piece(b, h, q, kv):
        return (kv >= S) & ((kv - S) // B == q // B)

    return or_masks(and_masks(ctx_piece, doc_piece), own_piece)
'''


@pytest.mark.parametrize("ctx_rule,expected", [
    ("(kv < S) & (pos < anchors[q // B])", "match"),
    ("pos < anchors[q // B]", "mismatch"),  # the wrapped index lets other blocks' tokens alias into the context
    ("(kv <= S) & (pos < anchors[q // B])", "mismatch"),  # the bound one too loose: the first block token aliases
    ("(kv <= S - 1) & (pos < anchors[q // B])", "match"),
])
def test_a_wrapped_key_index_needs_the_context_bound(tmp_path, ctx_rule, expected):
    got, reason = status(tmp_path, {"m.py": FLEX_PIECES.format(ctx_rule=ctx_rule)}, "dflash.blocks_isolated")
    assert got == expected, reason


# --- bidirectional within the block for full-attention layers ------------------------------------------

CAUSAL_SWITCH = '''
import torch

def block_rule(q_idx, kv_idx, n_ctx, block_len, window: int | None = None, swa_bidirectional: bool = False):
    bidirectional = {rule}
    same = (q_idx // block_len) == ((kv_idx - n_ctx) // block_len)
    if not bidirectional:
        same = same & (kv_idx - n_ctx <= q_idx)
    return same
'''


@pytest.mark.parametrize("rule,expected", [
    ("window is None or swa_bidirectional", "match"),
    ("swa_bidirectional", "mismatch"),  # full-attention layers (window None) turn causal at the default
])
def test_a_causal_switch_is_evaluated_for_full_attention(tmp_path, rule, expected):
    got, reason = status(tmp_path, {"m.py": CAUSAL_SWITCH.format(rule=rule)}, "dflash.block_bidirectional")
    assert got == expected, reason


DRAFT_LOOP = '''
import torch

def generate(drafter, verifier, ids, feats, B):
    out = verifier(ids, is_causal=True)
    draft = drafter(block_embeds=ids, context_hidden=feats, is_causal={flag})
    return out, draft
'''


@pytest.mark.parametrize("flag,expected", [("False", "match"), ("True", "mismatch")])
def test_is_causal_on_the_drafter_call_counts_both_ways(tmp_path, flag, expected):
    got, reason = status(tmp_path, {"gen.py": DRAFT_LOOP.format(flag=flag)}, "dflash.block_bidirectional")
    assert got == expected, reason


# --- the fusion path -------------------------------------------------------------------------------------

NORM_MODULE = '''
import torch
from torch import nn

class Fuse(nn.Module):
    def __init__(self, k, d):
        super().__init__()
        self.proj = nn.Linear(k * d, d, bias=False)
        self.post_norm = {module}

    def forward(self, feats):
        return self.layers(self.post_norm(self.proj(feats)))
'''


@pytest.mark.parametrize("module,expected", [
    ("nn.RMSNorm(d)", "match"),
    ("nn.Identity()", "mismatch"),
    ("lambda x: x", "mismatch"),
])
def test_a_norm_is_what_the_module_is_not_what_it_is_called(tmp_path, module, expected):
    got, reason = status(tmp_path, {"f.py": NORM_MODULE.format(module=module)}, "dflash.fc_norm")
    assert got == expected, reason


def test_a_norm_chosen_at_run_time_is_not_a_match(tmp_path):
    got, _ = status(tmp_path, {"f.py": NORM_MODULE.format(module="nn.RMSNorm(d) if k > 1 else nn.Identity()")},
                    "dflash.fc_norm")
    assert got != "match"


TORCH_FC = '''
import torch
from torch import nn

class TorchDraft(nn.Module):
    def __init__(self, ids, hidden):
        super().__init__()
        self.fuse = nn.Linear({count} * hidden, hidden, bias=False)
        self.fuse_norm = nn.RMSNorm(hidden)

    def forward(self, x):
        return self.fuse_norm(self.fuse(x))
'''

OTHER_BACKEND_FC = '''
import mlx.nn as nn

class PortDraft(nn.Module):
    def __init__(self, ids, hidden):
        self.fuse = nn.Linear(len(ids) * hidden, hidden, bias=False)
        self.fuse_norm = nn.RMSNorm(hidden)

    def __call__(self, x):
        return self.fuse_norm(self.fuse(x))
'''


@pytest.mark.parametrize("count,expected", [("len(ids)", "match"), ("(len(ids) - 1)", "mismatch")])
def test_a_correct_copy_does_not_vouch_for_a_broken_definition(tmp_path, count, expected):
    files = {"torch_model.py": TORCH_FC.format(count=count), "port_model.py": OTHER_BACKEND_FC}
    got, reason = status(tmp_path, files, "dflash.fc_input_layers")
    assert got == expected, reason


KV_MODULES = '''
import torch

class Attn(torch.nn.Module):
    def forward(self, x, ctx):
        q = self.q_proj(x)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], dim=1)
        v_c = self.{ctx_v}(ctx)
        v = torch.cat([v_c, self.v_proj(x)], dim=1)
        return q, k, v
'''

KV_WEIGHTS = '''
import jax.numpy as jnp

def attend(params, x, ctx):
    q = x @ params["wq"]
    k = jnp.concatenate([ctx @ params["wk"], x @ params["wk"]], axis=1)
    v = jnp.concatenate([ctx @ params["{ctx_w}"], x @ params["{blk_w}"]], axis=1)
    return q, k, v
'''


@pytest.mark.parametrize("files,expected", [
    ({"a.py": KV_MODULES.format(ctx_v="v_proj")}, "match"),
    ({"a.py": KV_MODULES.format(ctx_v="k_proj")}, "mismatch"),
    ({"a.py": KV_WEIGHTS.format(ctx_w="wv", blk_w="wv")}, "match"),
    ({"a.py": KV_WEIGHTS.format(ctx_w="wk", blk_w="wk")}, "mismatch"),  # values built with the key weights
], ids=["modules", "modules-v-through-k", "weights", "weights-v-through-k"])
def test_keys_and_values_go_through_their_own_projection(tmp_path, files, expected):
    got, reason = status(tmp_path, files, "dflash.kv_injection")
    assert got == expected, reason


# --- serving: the context kept after a verify pass -----------------------------------------------------

SERVE = '''
import torch

def serve(draft, target, ids, layer_ids, B, max_len):
    pos = ids.shape[1]
    feats = None
    while pos < max_len:
        block = ids[:, pos:pos + B]
        out = target(block, output_hidden_states=True)
        n_ok = int((block[:, 1:] == out.logits.argmax(-1)[:, :-1]).cumprod(1).sum())
        ctx_hidden = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)[:, :n_ok {kept}]
        feats = ctx_hidden
        pos += n_ok + 1
    return feats
'''


@pytest.mark.parametrize("kept,expected", [("+ 1", "match"), ("+ 2", "mismatch")])
def test_serving_keeps_exactly_the_positions_the_anchor_advances_past(tmp_path, kept, expected):
    got, reason = status(tmp_path, {"serve.py": SERVE.format(kept=kept)}, "dflash.context_excludes_anchor")
    assert got == expected, reason


def test_context_keys_projected_from_the_block_itself_are_not_context(tmp_path):
    text = KV_MODULES.format(ctx_v="v_proj").replace("self.k_proj(ctx), self.k_proj(x)", "self.k_proj(x), self.k_proj(x)")
    got, reason = status(tmp_path, {"a.py": text}, "dflash.kv_injection")
    assert got == "mismatch", reason


SERVE_POSITIONS = '''
import torch

def decode(drafter, ids, feats, block_size, max_len):
    positions = torch.arange(max_len + block_size)[None]
    start = ids.shape[1]
    while start < max_len:
        draft = drafter(ids[:, start:start + block_size], feats, position_ids=positions[:, {cut}])
        start += 1
    return draft
'''


@pytest.mark.parametrize("cut,expected", [
    ("start:start + block_size", "match"),
    ("start + 1:start + block_size + 1", "mismatch"),
])
def test_serving_block_positions_cut_from_the_position_range(tmp_path, cut, expected):
    got, reason = status(tmp_path, {"d.py": SERVE_POSITIONS.format(cut=cut)}, "dflash.block_position_ids")
    assert got == expected, reason


NORM_THEN_USE = '''
import torch
from torch import nn

class Fuse(nn.Module):
    def __init__(self, k, d):
        super().__init__()
        self.proj = nn.Linear(k * d, d, bias=False)
        self.post_norm = nn.RMSNorm(d)

    def forward(self, feats, x):
        fused = self.proj(feats)
        fused_n = self.post_norm(fused)
        return self.layers(x, context={used})
'''


@pytest.mark.parametrize("used,expected", [("fused_n", "match"), ("fused", "mismatch")])
def test_the_normed_fc_output_must_be_the_one_used(tmp_path, used, expected):
    got, reason = status(tmp_path, {"f.py": NORM_THEN_USE.format(used=used)}, "dflash.fc_norm")
    assert got == expected, reason


@pytest.mark.parametrize("rule,expected", [
    ("in_blocks & ((kv - S) // B == q // B)", "match"),
    ("in_blocks & ((kv - S) // B + 1 == q // B)", "mismatch"),  # each block sees the previous one, not its own
])
def test_block_ids_compared_with_a_shift_are_different_blocks(tmp_path, rule, expected):
    got, reason = status(tmp_path, {"m.py": DENSE_BLOCKS.format(block_rule=rule)}, "dflash.blocks_isolated")
    assert got == expected, reason


PACKED_CONTEXT = '''
import torch

def context_rule(doc, anchors, S, B):
    def mod(b, h, q_idx, kv_idx):
        a = anchors[q_idx // B]
        same = doc[a] == doc[kv_idx.clamp(max=S - 1)]
        return {rule}
    return mod
'''


@pytest.mark.parametrize("rule,expected", [
    ("(kv_idx < S) & same & (kv_idx < a)", "match"),
    ("(kv_idx < S) & (kv_idx < a)", "mismatch"),  # the same-document condition computed, then left out
])
def test_a_packed_context_rule_keeps_its_same_document_condition(tmp_path, rule, expected):
    got, reason = status(tmp_path, {"m.py": PACKED_CONTEXT.format(rule=rule)}, "dflash.context_excludes_anchor")
    assert got == expected, reason
