"""The mutation operators themselves: each plants what it says, where it says, and keeps the file valid."""

from __future__ import annotations

import ast

from mutation_operators import OPERATORS, Source, delete_freeze_line, hoist, remove_shift, strict_flip

CODE = '''
import torch


def mask_mod(b, h, q_idx, kv_idx, anchors, seq_len):
    anchor = anchors[b, q_idx // 8]
    return (kv_idx < seq_len) & (kv_idx < anchor)


def targets(target_logits, anchors, block_size, gamma=4.0):
    slot = torch.arange(block_size)
    idx = (anchors[:, None] + slot - 1).clamp(min=0)
    w = torch.exp(-(slot - 1).clamp(min=0) / gamma)
    return target_logits[idx], w


class Drafter(torch.nn.Module):
    def __init__(self, target):
        super().__init__()
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.embed.requires_grad_(False)
        self.lm_head.requires_grad_(False)
'''


def _source() -> Source:
    src = Source.parse("impl.py", CODE)
    assert src is not None
    return src


def _line(text: str) -> int:
    return next(i for i, line in enumerate(CODE.splitlines(), start=1) if text in line)


def test_strict_flip_touches_the_anchor_comparison_only() -> None:
    src = _source()
    found = list(strict_flip(src, [_line("kv_idx < anchor")]))
    assert len(found) == 1
    _node, edit, _ = found[0]
    from mutation_operators import apply_edit

    mutated = apply_edit(CODE, edit)
    assert "(kv_idx <= anchor)" in mutated and "(kv_idx < seq_len)" in mutated
    ast.parse(mutated)


def test_remove_shift_leaves_the_decay_alone() -> None:
    src = _source()
    from mutation_operators import apply_edit

    found = list(remove_shift(src, [_line("idx = (anchors")]))
    assert len(found) == 1
    mutated = apply_edit(CODE, found[0][1])
    assert "(anchors[:, None] + slot)" in mutated and "-(slot - 1)" in mutated


def test_hoisting_moves_the_expression_into_a_misleading_variable() -> None:
    src = _source()
    from mutation_operators import apply_edit

    node, edit, _ = next(iter(remove_shift(src, [_line("idx = (anchors")])))
    hoisted = hoist(src, node, edit.text, "shifted_index")
    assert hoisted is not None
    mutated = apply_edit(CODE, hoisted)
    assert "    shifted_index = (anchors[:, None] + slot)\n    idx = (shifted_index).clamp(min=0)\n" in mutated
    ast.parse(mutated)


def test_delete_one_freeze_needs_several_freeze_lines() -> None:
    src = _source()
    sites = list(delete_freeze_line([src]))
    assert [s[3] for s in sites] == ["deleted `self.embed.requires_grad_(False)`",
                                     "deleted `self.lm_head.requires_grad_(False)`"]
    single = Source.parse("one.py", "target.requires_grad_(False)\n")
    assert single is not None and not list(delete_freeze_line([single]))


def test_every_operator_names_the_invariant_it_breaks() -> None:
    assert all(op.breaks and op.breaks.startswith("dflash.") for op in OPERATORS)
    assert len({op.name for op in OPERATORS}) == len(OPERATORS)
