"""The attention mask: the anchor cut (context_excludes_anchor), block isolation and bidirectionality."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from sleuth.evidence.ast_index import (
    Analyzer,
    BLOCKED_TOKENS,
    CONTEXT_TOKENS,
    CodeReading,
    LOGITS_TOKENS,
    Mode,
    PRESERVING_METHODS,
    in_draft_class,
    mentions_window,
    reading_at,
    scope_mentions_block,
    nodes_of,
    call_name,
    const_number,
    is_blocksize_name,
    is_neg_inf,
    kwarg,
    leaf_name,
    name_tags,
    tokens,
)
from sleuth.evidence.origins import Leg, anchor_legs, reaching_definitions
from sleuth.evidence.registry import detector


# --- the anchor comparison: context_excludes_anchor ---------------------------------------------------


def _polarity(an: Analyzer, node: ast.AST) -> str:
    """'allowed' when the comparison says where attention may look, 'blocked' when it says where it may not."""
    flips = 0
    child, current = node, an.parents.get(node)
    while current is not None and not isinstance(current, ast.stmt):
        if isinstance(current, ast.UnaryOp) and isinstance(current.op, (ast.Invert, ast.Not)):
            flips += 1
        if isinstance(current, ast.Call):
            name = call_name(current)
            if name == "logical_not":
                flips += 1
            verdict = _call_polarity(current, child)
            if verdict is not None:
                return _flip(verdict, flips)
        child, current = current, an.parents.get(current)
    # assigned to a name: look where that name (or a name built from it) is used
    if isinstance(current, (ast.Assign, ast.AnnAssign)):
        targets = current.targets if isinstance(current, ast.Assign) else [current.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        for name in names:
            if set(tokens(name)) & BLOCKED_TOKENS:
                return _flip("blocked", flips)
            verdict = _name_polarity(an, current, name, 0)
            if verdict is not None:
                return _flip(verdict, flips)
    return _flip("allowed", flips)


def _flip(verdict: str, flips: int) -> str:
    if flips % 2:
        return "blocked" if verdict == "allowed" else "allowed"
    return verdict


def _call_polarity(call: ast.Call, child: ast.AST) -> str | None:
    name = call_name(call)
    if name in {"masked_fill", "masked_fill_"}:
        args = call.args
        if len(args) >= 2 and args[0] is child:
            # masked_fill(cond, True) marks where attention is allowed; -inf / False / 0 where it is not
            fill = args[1]
            return "allowed" if isinstance(fill, ast.Constant) and fill.value is True else "blocked"
    if name == "where" and len(call.args) >= 3 and call.args[0] is child:
        if is_neg_inf(call.args[1]):
            return "blocked"
        if is_neg_inf(call.args[2]):
            return "allowed"
    return None


def _name_polarity(an: Analyzer, stmt: ast.AST, name: str, depth: int) -> str | None:
    if depth > 3:
        return None
    func = an.enclosing_function(stmt) or an.unit(stmt).tree
    for node in ast.walk(func):
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load):
            flips = 0
            child, current = node, an.parents.get(node)
            while current is not None and not isinstance(current, ast.stmt):
                if isinstance(current, ast.UnaryOp) and isinstance(current.op, (ast.Invert, ast.Not)):
                    flips += 1
                if isinstance(current, ast.Call):
                    if call_name(current) == "logical_not":
                        flips += 1
                    verdict = _call_polarity(current, child)
                    if verdict is not None:
                        return _flip(verdict, flips)
                child, current = current, an.parents.get(current)
            if isinstance(current, ast.Assign) and current is not stmt:
                for target in current.targets:
                    if isinstance(target, ast.Name) and target.id != name:
                        if set(tokens(target.id)) & BLOCKED_TOKENS:
                            return _flip("blocked", flips)
                        verdict = _name_polarity(an, current, target.id, depth + 1)
                        if verdict is not None:
                            return _flip(verdict, flips)
    return None


_FLIP_OP = {ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE}


def _anchor_comparisons(an: Analyzer) -> Iterator[tuple[ast.AST, str, int, ast.expr | None, str, float, Leg]]:
    """(node, op as 'kv OP anchor' with op in < <= > >=, constant offset on the anchor side, non-constant
    term, polarity, confidence) for every comparison of a key position against an anchor."""
    for node in nodes_of(an, ast.Compare):
        if len(node.ops) != 1 or type(node.ops[0]) not in _FLIP_OP:
            continue
        left, right, op = node.left, node.comparators[0], type(node.ops[0])
        lt, rt = an.tags(left), an.tags(right)
        if "blockid" in lt or "blockid" in rt:
            continue
        if "anchor" in rt and "anchor" not in lt:
            kv_side, anchor_side = left, right
        elif "anchor" in lt and "anchor" not in rt:
            kv_side, anchor_side, op = right, left, _FLIP_OP[op]
        else:
            continue
        kv_tags = an.tags(kv_side)
        if "kv" in kv_tags:
            confidence = 0.9
        elif "arange" in kv_tags or isinstance(kv_side, (ast.Name, ast.Subscript)) and _scope_mentions_mask(an, node):
            confidence = 0.65
        else:
            continue
        if "q" in kv_tags and "kv" not in kv_tags:
            continue
        # a slice bound like seq_len - block_size is about sampling, not visibility
        if any(is_blocksize_name(leaf_name(n)) for n in ast.walk(kv_side) if isinstance(n, (ast.Name, ast.Attribute))):
            continue
        symbol = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}[op]
        # kv + 1 <= anchor is kv <= anchor - 1: a constant on the key side moves to the anchor side
        kv_offset = an.const_offset(kv_side)
        polarity = _polarity(an, node)
        nonconst = an.nonconst_offset(anchor_side)
        # the anchor side's value is what reaches it, not what it is called: every path from the sampled anchors
        # (an offset in a repeat, at a caller, in a helper's argument) counts, one reading per path
        for leg in _unique_legs(anchor_legs(an, anchor_side)):
            yield node, symbol, leg.offset - kv_offset, nonconst, polarity, confidence, leg


def _unique_legs(legs: list[Leg]) -> list[Leg]:
    """One leg per (offset, complete, switch): the same path reached through several call sites reads once."""
    seen: dict[tuple, Leg] = {}
    for leg in legs:
        seen.setdefault((leg.offset, leg.complete, leg.switch), leg)
    return list(seen.values())


def _leg_note(an: Analyzer, leg: Leg) -> str:
    if not leg.complete:
        return f"; the anchor's path is not traced: {leg.missing}"
    if leg.offset and leg.entered is not None:
        unit = an.unit(leg.entered)
        return f"; the anchor arrives as `{ast.unparse(leg.entered)[:60]}` ({unit.path}:{getattr(leg.entered, 'lineno', 0)})"
    return ""


def _scope_mentions_mask(an: Analyzer, node: ast.AST) -> bool:
    func = an.outermost_function(node)
    if func is None:
        return False
    name = getattr(func, "name", "").lower()
    return any(word in name for word in ("mask", "attn", "attention", "visible", "bias"))


def _visible_upper_bound(symbol: str, offset: int, polarity: str) -> str | None:
    """Reduce a comparison to the visible region's upper bound: 'strict' (kv < anchor) or 'inclusive'."""
    if polarity == "blocked":
        # kv >= a + c blocked  ->  visible kv < a + c ;  kv > a + c blocked -> visible kv <= a + c
        symbol = {">=": "<", ">": "<="}.get(symbol)
        if symbol is None:
            return None
    if symbol == "<":
        last_visible = offset - 1
    elif symbol == "<=":
        last_visible = offset
    else:
        return None  # a lower bound (sliding window), not the anchor cut
    return "kv < anchor" if last_visible <= -1 else "kv <= anchor" if last_visible == 0 else f"kv <= anchor{last_visible:+d}"


def _split_offset(node: ast.AST) -> tuple[str, int]:
    """(text of the non-constant part, constant) of `x + c` / `x - c` / `c + x` (nested)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        c = const_number(node.right)
        if c is not None and float(c).is_integer():
            base, inner = _split_offset(node.left)
            return base, inner + int(c) * (1 if isinstance(node.op, ast.Add) else -1)
        c = const_number(node.left)
        if c is not None and isinstance(node.op, ast.Add) and float(c).is_integer():
            base, inner = _split_offset(node.right)
            return base, inner + int(c)
    return ast.unparse(node), 0


def _advances(an: Analyzer, loop: ast.AST) -> list[tuple[ast.AST, str, int]]:
    """`start += acc + 1` / `start = start + acc + 1` on an anchor-like name in a decoding loop: (node, base, c)."""
    out = []
    # the block's start: an anchor-like name, or whatever the loop slices a block from (`x[:, p : p + B]`)
    block_starts = {n.lower.id for n in ast.walk(loop) if isinstance(n, ast.Slice) and isinstance(n.lower, ast.Name)
                    and n.upper is not None and _split_offset(n.upper)[0].startswith(n.lower.id + " + ")}
    for node in ast.walk(loop):
        if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and isinstance(node.target, ast.Name) \
                and ("anchor" in name_tags(node.target.id) or node.target.id in block_starts):
            base, c = _split_offset(node.value)
            if const_number(node.value) is None:
                out.append((node, base, c))
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and "anchor" in name_tags(node.targets[0].id) and isinstance(node.value, ast.BinOp) \
                and isinstance(node.value.op, ast.Add) and isinstance(node.value.left, ast.Name) \
                and node.value.left.id == node.targets[0].id:
            base, c = _split_offset(node.value.right)
            out.append((node, base, c))
    return out


def _inference_context_readings(an: Analyzer) -> list[CodeReading]:
    """Serving: after a verify pass the anchor advances by `acc + 1` (the accepted tokens and the bonus token);
    the new context kept from that pass must be exactly those positions, `[:acc + 1]`: one more keeps the new
    anchor's own position (`kv <= anchor`), the label leak at inference."""
    readings = []
    for loop in nodes_of(an, ast.While) + nodes_of(an, ast.For):
        advances = _advances(an, loop)
        if not advances:
            continue
        for node in ast.walk(loop):
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Subscript)):
                continue
            target_tokens = set(tokens(leaf_name(node.targets[0])))
            if not target_tokens & (CONTEXT_TOKENS | {"hidden", "hiddens"}) or target_tokens & {"ids", "logits", "tokens", "labels"}:
                continue
            parts = node.value.slice.elts if isinstance(node.value.slice, ast.Tuple) else [node.value.slice]
            for part in parts:
                if not (isinstance(part, ast.Slice) and part.lower is None and part.upper is not None):
                    continue
                base, kept = _split_offset(part.upper)
                for advance, adv_base, step in advances:
                    if adv_base != base or base.lstrip("-").isdigit():
                        continue
                    extra = kept - step
                    value = "kv < anchor" if extra <= 0 else "kv <= anchor" if extra == 1 else f"kv <= anchor{extra - 1:+d}"
                    # serving is a site of its own: a correct training mask elsewhere does not vouch for it
                    readings.append(reading_at(
                        an, "dflash.context_excludes_anchor", value, node, 0.7 if extra <= 0 else 0.9,
                        detail=f"the context kept after a verify pass is `[:{ast.unparse(part.upper)}]` while the anchor "
                               f"advances by `{ast.unparse(advance.value)}` (line {advance.lineno}): "
                               + ("the new anchor's position stays out of the context" if extra <= 0 else
                                  f"{extra} position(s) past the last accepted one, the new anchor's own included")))
    return readings


def _same_document_atom(an: Analyzer, atom: ast.AST) -> bool:
    """`doc[q_anchor] == doc[kv]` (through names): one tensor read at two places, compared for equality."""
    if not isinstance(atom, ast.Compare) or len(atom.ops) != 1 or not isinstance(atom.ops[0], ast.Eq):
        return False

    def base(node: ast.AST, depth: int = 0) -> str | None:
        if isinstance(node, ast.Subscript):
            return ast.unparse(node.value)
        if isinstance(node, ast.Name) and depth < 3:
            reached = reaching_definitions(an, node)
            if reached and len(reached[0]) == 1 and not reached[1]:
                return base(reached[0][0], depth + 1)
        return None
    left, right = base(atom.left), base(atom.comparators[0])
    return left is not None and left == right


def _document_readings(an: Analyzer) -> list[CodeReading]:
    """Packed rows: a mask function that computes the same-document condition must require it wherever it lets
    a context key through by the anchor rule; a conjunction without it shows other documents' context."""
    readings: list[CodeReading] = []
    done: set[int] = set()
    for atom in nodes_of(an, ast.Compare):
        if _anchor_side_of(an, atom) is None:
            continue
        outer = an.outermost_function(atom)
        if outer is None or id(outer) in done:
            continue
        done.add(id(outer))
        if not any(_same_document_atom(an, c) for c in ast.walk(outer) if isinstance(c, ast.Compare)):
            continue  # this code has no same-document rule to lose
        func = an.enclosing_function(atom)
        starts = _combinator_uses(an, func) or _returns_of(an, func)
        for start in starts:
            formula = _conjunctions(an, start)
            for conjunction in formula or []:
                if not any(_anchor_side_of(an, a) is not None for a in conjunction):
                    continue
                regions = {_key_region(an, a) for a in conjunction}
                if {"block", "context"} <= regions or any(
                        not isinstance(a, ast.Compare) and (an.tags(a) & {"kv"} or isinstance(a, ast.Call)) for a in conjunction):
                    continue
                if not any(_same_document_atom(an, a) for a in conjunction):
                    where = next(a for a in conjunction if _anchor_side_of(an, a) is not None)
                    readings.append(reading_at(an, "dflash.context_excludes_anchor", "kv < anchor, any document", where, 0.9,
                                               detail="the code computes the same-document condition but this part of the "
                                               "mask lets context keys through without it: other documents of the packed "
                                               "row are visible"))
    return readings


@detector("dflash.context_excludes_anchor")
def detect_context_excludes_anchor(an: Analyzer) -> list[CodeReading]:
    readings: list[CodeReading] = _inference_context_readings(an) + _document_readings(an)
    by_function: dict[int, list[CodeReading]] = {}
    for node, symbol, offset, nonconst, polarity, confidence, leg in _anchor_comparisons(an):
        value = _visible_upper_bound(symbol, offset, polarity)
        if value is None:
            continue
        switch = an.switch_of(node)
        mode: Mode = "hardcoded"
        detail = f"visible context: {value} ({polarity} region written as kv {symbol} anchor{offset:+d})" + _leg_note(an, leg)
        if nonconst is not None:
            mode, switch = "switch", ast.unparse(nonconst)
        elif switch is not None and not re.search(r"window|sliding", switch):
            mode = "switch"
        elif switch is not None:
            continue
        elif leg.switch is not None:
            mode, switch = "switch", leg.switch
        if not leg.complete:
            value += "?"  # what the anchor is here was not established: no claim either way
        reading = reading_at(an, "dflash.context_excludes_anchor", value, node, confidence, mode=mode, switch=switch, detail=detail)
        readings.append(reading)
        by_function.setdefault(id(an.outermost_function(node)), []).append(reading)
    # both cuts in one function: the choice is a runtime switch even if the if/else was not recognised
    # (two different comparisons; one comparison reached by anchors from different call sites is not a switch:
    # every call site must be right)
    for group in by_function.values():
        if len({r.value for r in group}) > 1 and len({r.line for r in group}) > 1:
            for r in group:
                if r.mode == "hardcoded":
                    r.mode, r.switch = "switch", r.switch or "two cuts in one function"
    # mask filled by slices: mask[rows, :anchor] = True (strict) / [:anchor + 1]; bias[rows, anchor:] = -inf
    for node in nodes_of(an, ast.Assign):
        if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Subscript):
            continue
        target = node.targets[0]
        value = node.value
        if not set(tokens(leaf_name(target.value))) & {"mask", "allowed", "visible", "attend", "bias", "attn", "vis", "can", "see", "seen", "visibility"}:
            continue
        if is_neg_inf(value):
            polarity = "blocked"
        elif (isinstance(value, ast.Constant) and value.value is True) or const_number(value) in (0, 1):
            polarity = "allowed" if not (const_number(value) == 0 and set(tokens(leaf_name(target.value))) & {"mask", "allowed", "visible", "can", "attend"}) else "blocked"
        else:
            continue
        parts = target.slice.elts if isinstance(target.slice, ast.Tuple) else [target.slice]
        for part in parts:
            if not isinstance(part, ast.Slice):
                continue
            if polarity == "allowed" and part.upper is not None and (part.lower is None or const_number(part.lower) == 0) and "anchor" in an.tags(part.upper):
                offset = an.const_offset(part.upper)
            elif polarity == "blocked" and part.lower is not None and "anchor" in an.tags(part.lower) and part.upper is None:
                offset = an.const_offset(part.lower)
            else:
                continue
            value_text = "kv < anchor" if offset <= 0 else "kv <= anchor" if offset == 1 else f"kv <= anchor{offset - 1:+d}"
            switch = an.switch_of(node)
            nonconst = an.nonconst_offset(part.upper if polarity == "allowed" else part.lower)
            mode = "switch" if (switch or nonconst is not None) else "hardcoded"
            readings.append(reading_at(an, "dflash.context_excludes_anchor", value_text, node, 0.75, mode=mode,
                                     switch=switch or (ast.unparse(nonconst) if nonconst is not None else None),
                                     detail=f"mask filled by slice ({polarity}): {ast.unparse(target)[:60]}"))
    # slicing the context up to the anchor: ctx[:, :anchor] (strict) vs ctx[:, :anchor + 1]
    for node in nodes_of(an, ast.Slice):
        if node.upper is None or (node.lower is not None and const_number(node.lower) != 0):
            continue
        if "anchor" not in an.tags(node.upper) or not scope_mentions_block(an, node):
            continue
        sub = an.parents.get(node)
        while sub is not None and not isinstance(sub, ast.Subscript):
            sub = an.parents.get(sub)
        sub_tokens = set(tokens(leaf_name(sub.value))) if sub is not None else set()
        if sub is None or not (sub_tokens & (CONTEXT_TOKENS | {"hidden", "hiddens", "states"})) or sub_tokens & (LOGITS_TOKENS - {"hidden", "hiddens"}) - {"teacher", "verifier"} or sub_tokens & {"logits", "logit", "labels", "ids"}:
            continue
        offset = an.const_offset(node.upper)
        value = "kv < anchor" if offset <= 0 else "kv <= anchor" if offset == 1 else f"kv <= anchor{offset - 1:+d}"
        nonconst = an.nonconst_offset(node.upper)
        mode = "switch" if nonconst is not None else "hardcoded"
        readings.append(reading_at(an, "dflash.context_excludes_anchor", value, node, 0.7, mode=mode,
                                 switch=ast.unparse(nonconst) if nonconst is not None else None,
                                 detail=f"context sliced up to {ast.unparse(node.upper)}"))
    return readings


# --- block structure: bidirectional, isolated ---------------------------------------------------------


def _floordiv_divisors(an: Analyzer, node: ast.AST, depth: int = 0) -> set[str]:
    """Divisors X of `... // X` that an expression is built from (through subscripts, methods, names)."""
    if depth > 5:
        return set()
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
        return {ast.unparse(node.right)}
    if isinstance(node, ast.Call):
        # floor division spelled as a call: torch.div(a, X, rounding_mode="floor"), a.div(X, rounding_mode=
        # "floor"), floor_divide(a, X), a.floor_divide(X)
        name = call_name(node)
        mode = kwarg(node, "rounding_mode")
        floor = name in {"floor_divide", "floor_divide_"} or (
            name in {"div", "divide", "true_divide"} and isinstance(mode, ast.Constant) and mode.value == "floor")
        if floor and node.args:
            return {ast.unparse(node.args[-1])}
    if isinstance(node, ast.Subscript):
        return _floordiv_divisors(an, node.value, depth + 1)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and call_name(node) in PRESERVING_METHODS:
        return _floordiv_divisors(an, node.func.value, depth + 1)
    if isinstance(node, ast.Name):
        found = an.defs_of(node)
        if found and len(found[0]) == 1:
            return _floordiv_divisors(an, found[0][0], depth + 1)
    return set()


def _block_comparisons(an: Analyzer) -> Iterator[tuple[ast.Compare, str]]:
    for node in nodes_of(an, ast.Compare):
        if len(node.ops) != 1:
            continue
        lt, rt = an.tags(node.left), an.tags(node.comparators[0])
        if "blockid" in lt and "blockid" in rt:
            yield node, type(node.ops[0]).__name__
        elif _floordiv_divisors(an, node.left) & _floordiv_divisors(an, node.comparators[0]) and scope_mentions_block(an, node):
            # both sides divided by the same quantity: block indices, whatever the block size is called
            yield node, type(node.ops[0]).__name__


# --- the mask as a formula: which conjunctions of conditions let a key through ---------------------------

MAX_TERMS = 32
_OPAQUE = "opaque"


def _conjunctions(an: Analyzer, node: ast.AST, depth: int = 0) -> list[list[ast.AST]] | None:
    """The mask expression as an OR of ANDs of its conditions (atoms: comparisons, or `opaque` nodes), through
    names (the definitions that reach the use: `m = m & extra` under an `if` gives both alternatives),
    `or_masks` / `and_masks` of mask functions (into their returns) and & | ~-free boolean algebra.
    None when it grows past MAX_TERMS."""
    if depth > 12:
        return [[node]]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)) or isinstance(node, ast.BoolOp):
        parts = [node.left, node.right] if isinstance(node, ast.BinOp) else node.values
        conj = isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitAnd) or isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And)
        return _combine([_conjunctions(an, p, depth + 1) for p in parts], conj)
    if isinstance(node, ast.Call):
        name = call_name(node)
        if name in {"logical_and", "logical_or", "and_masks", "or_masks", "bitwise_and", "bitwise_or"} and node.args:
            parts = [_mask_function_body(an, a) or a for a in node.args]
            return _combine([_conjunctions(an, p, depth + 1) for p in parts], "and" in name)
        if isinstance(node.func, ast.Attribute) and name in {"bool", "to", "contiguous", "clone", "expand", "view", "reshape"}:
            return _conjunctions(an, node.func.value, depth + 1)
    if isinstance(node, ast.Name):
        reached = reaching_definitions(an, node)
        if reached and reached[0] and not reached[1]:
            out: list[list[ast.AST]] = []
            for definition in reached[0][-3:]:
                inner = _conjunctions(an, definition, depth + 1)
                if inner is None:
                    return None
                out += inner
            return out if len(out) <= MAX_TERMS else None
    if isinstance(node, ast.IfExp):
        # either branch may be the one that runs (a window term that is `True` for full attention)
        return _combine([_conjunctions(an, node.body, depth + 1), _conjunctions(an, node.orelse, depth + 1)], False)
    if isinstance(node, ast.Constant) and node.value is True:
        return [[]]
    return [[node]]


def _combine(parts: list[list[list[ast.AST]] | None], conj: bool) -> list[list[ast.AST]] | None:
    if any(p is None for p in parts):
        return None
    if not conj:
        out = [c for p in parts for c in p]  # type: ignore[union-attr]
        return out if len(out) <= MAX_TERMS else None
    out = [[]]
    for p in parts:
        out = [a + b for a in out for b in p]  # type: ignore[union-attr]
        if len(out) > MAX_TERMS:
            return None
    return out


def _mask_function_body(an: Analyzer, node: ast.AST) -> ast.expr | None:
    """The returned expression of a mask function passed by name (`or_masks(prefix_mod, block_mod)`)."""
    if not isinstance(node, ast.Name):
        return None
    # nested mask functions (closures over the anchors) are found by name as well as top-level ones
    found = [f for f in nodes_of(an, ast.FunctionDef) if f.name == node.id]
    if len(found) != 1:
        return None
    returns = _returns_of(an, found[0])
    return returns[0] if len(returns) == 1 else None


def _key_region(an: Analyzer, atom: ast.AST) -> str | None:
    """'block' for `kv >= S` (a key among the block tokens), 'context' for `kv < S`; the raw key index only."""
    if not isinstance(atom, ast.Compare) or len(atom.ops) != 1 or type(atom.ops[0]) not in _FLIP_OP:
        return None
    left, right, op = atom.left, atom.comparators[0], type(atom.ops[0])
    lt, rt = an.tags(left), an.tags(right)
    if "kv" in rt and "kv" not in lt:
        left, right, op, lt, rt = right, left, _FLIP_OP[op], rt, lt
    if "kv" not in lt or rt & {"kv", "q", "anchor", "blockid", "arange"} or lt & {"blockid", "slot", "anchor"}:
        return None
    if _wrapped(an, left) or not isinstance(left, (ast.Name, ast.Subscript, ast.Attribute)):
        return None
    return "block" if op in (ast.Gt, ast.GtE) else "context"


def _wrapped(an: Analyzer, node: ast.AST, depth: int = 0) -> str | None:
    """The modulus when a key index is wrapped (`remainder(kv, S)`, `kv % S`): every block key then aliases a
    context position."""
    if depth > 4:
        return None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return ast.unparse(node.right)
    if isinstance(node, ast.Call) and call_name(node) in {"remainder", "fmod"} and node.args:
        return ast.unparse(node.args[-1])
    if isinstance(node, ast.Name):
        reached = reaching_definitions(an, node)
        if reached and len(reached[0]) == 1:
            return _wrapped(an, reached[0][0], depth + 1)
    return None


def _context_bound_excess(an: Analyzer, atom: ast.Compare, modulus: str | None) -> int | None:
    """How many key indices past `kv < modulus` a context bound lets through (0 for exactly `kv < M` /
    `kv <= M - 1`), None when the bound is not written against the modulus."""
    left, right, op = atom.left, atom.comparators[0], type(atom.ops[0])
    if "kv" in an.tags(right) and "kv" not in an.tags(left):
        left, right, op = right, left, _FLIP_OP[op]
    base, c = _split_offset(right)
    if modulus is None or base != modulus:
        return None
    last_visible = c - 1 if op is ast.Lt else c if op is ast.LtE else None
    return None if last_visible is None else last_visible + 1


def _is_block_equality(an: Analyzer, atom: ast.AST) -> bool:
    if not isinstance(atom, ast.Compare) or len(atom.ops) != 1 or not isinstance(atom.ops[0], ast.Eq):
        return False
    left, right = atom.left, atom.comparators[0]
    return ("blockid" in an.tags(left) and "blockid" in an.tags(right)) or bool(
        _floordiv_divisors(an, left) & _floordiv_divisors(an, right))


def _mask_formula_readings(an: Analyzer) -> list[CodeReading]:
    """Blocks isolated, read from the whole mask a function returns (i11-attn): every conjunction that lets a
    block key through (`kv >= S`) must also require the same block; every conjunction that lets a context key
    through by comparing a WRAPPED key index with the anchor must also require `kv < S`, or other blocks'
    tokens alias into the context. A conjunction with a condition not understood says nothing."""
    readings: list[CodeReading] = []
    done: set[int] = set()
    for atom in nodes_of(an, ast.Compare):
        if _key_region(an, atom) != "block" and not (_anchor_side_of(an, atom) and _wrapped(an, _anchor_side_of(an, atom))):
            continue
        func = an.enclosing_function(atom)
        if func is None or id(func) in done:
            continue
        done.add(id(func))
        composed = _combinator_uses(an, func)
        if composed:
            # a mask piece (`doc_mod` in `and_masks(ctx_mod, doc_mod)`) is read inside the mask it composes
            starts = composed
        else:
            starts = _returns_of(an, func)
        for ret in starts:
            if id(ret) in done:
                continue
            done.add(id(ret))
            formula = _conjunctions(an, ret)
            if formula is None:
                continue
            for conjunction in formula:
                if any(not isinstance(a, ast.Compare) and (an.tags(a) & {"kv"} or isinstance(a, ast.Call)) for a in conjunction):
                    continue  # a condition on the keys not understood: no claim from this conjunction
                regions = {_key_region(an, a) for a in conjunction}
                if "block" in regions and not any(_is_block_equality(an, a) for a in conjunction):
                    if any(_anchor_side_of(an, a) for a in conjunction) or "context" in regions:
                        continue  # an empty region (kv >= S and kv < S / kv < anchor): nothing gets through
                    where = next(a for a in conjunction if _key_region(an, a) == "block")
                    readings.append(reading_at(an, "dflash.blocks_isolated", "cross-block", where, 0.85,
                                               detail="a block query sees every block's tokens: the mask lets "
                                               f"`{ast.unparse(where)}` through with no same-block condition"))
                wrapped = [a for a in conjunction if _anchor_side_of(an, a) is not None and _wrapped(an, _anchor_side_of(an, a))]
                if wrapped and "context" in regions:
                    modulus = _wrapped(an, _anchor_side_of(an, wrapped[0]))
                    bounds = [a for a in conjunction if _key_region(an, a) == "context"]
                    loose = [a for a in bounds if _context_bound_excess(an, a, modulus) not in (0, None)]
                    if loose and len(loose) == len(bounds):
                        readings.append(reading_at(an, "dflash.blocks_isolated", "cross-block", loose[0], 0.85,
                                                   detail=f"the context bound `{ast.unparse(loose[0])}` lets key indices at or "
                                                   f"past {modulus} through, and the wrapped index `{ast.unparse(_anchor_side_of(an, wrapped[0]))}` "
                                                   "maps those block tokens onto context positions"))
                if wrapped and "context" not in regions and not any(_is_block_equality(an, a) for a in conjunction):
                    kv = _anchor_side_of(an, wrapped[0])
                    readings.append(reading_at(an, "dflash.blocks_isolated", "cross-block", wrapped[0], 0.85,
                                               detail=f"the context rule compares a wrapped key index (`{ast.unparse(kv)}` "
                                               f"wraps modulo {_wrapped(an, kv)}) with the anchor and never requires the key "
                                               "to be a context key: other blocks' tokens alias into the context"))
    return readings


_COMBINATORS = {"and_masks", "or_masks"}


def _combinator_uses(an: Analyzer, func: ast.AST) -> list[ast.Call]:
    """The outermost `or_masks(...)` / `and_masks(...)` calls that take this mask function as a piece."""
    name = getattr(func, "name", None)
    out = []
    for combinator in _COMBINATORS:
        for call in an.calls_named(combinator):
            if not any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(call)):
                continue
            outer = call
            parent = an.parents.get(outer)
            while isinstance(parent, ast.Call) and call_name(parent) in _COMBINATORS:
                outer, parent = parent, an.parents.get(parent)
            if outer not in out:
                out.append(outer)
    return out


def _returns_of(an: Analyzer, func: ast.AST) -> list[ast.expr]:
    return [r.value for r in ast.walk(func) if isinstance(r, ast.Return) and r.value is not None
            and an.enclosing_function(r) is func]


def _anchor_side_of(an: Analyzer, atom: ast.AST) -> ast.expr | None:
    """The key side of a key-vs-anchor comparison."""
    if not isinstance(atom, ast.Compare) or len(atom.ops) != 1 or type(atom.ops[0]) not in _FLIP_OP:
        return None
    left, right = atom.left, atom.comparators[0]
    lt, rt = an.tags(left), an.tags(right)
    if "anchor" in rt and "anchor" not in lt and "kv" in lt:
        return left
    if "anchor" in lt and "anchor" not in rt and "kv" in rt:
        return right
    return None


def _block_id_shift(an: Analyzer, node: ast.Compare) -> int:
    """A constant added to one block id and not the other (`q // B == (kv - S) // B + 1`): those compare
    different blocks. Offsets inside the division (`(kv - S) // B`) are how key indices map to blocks, not a shift."""
    def outer_offset(side: ast.AST, depth: int = 0) -> int:
        if isinstance(side, ast.BinOp) and isinstance(side.op, (ast.Add, ast.Sub)):
            c = const_number(side.right)
            if c is not None and float(c).is_integer():
                return outer_offset(side.left, depth + 1) + int(c) * (1 if isinstance(side.op, ast.Add) else -1)
        if isinstance(side, ast.Name) and depth < 4:
            reached = reaching_definitions(an, side)
            if reached and len(reached[0]) == 1 and not reached[1]:
                return outer_offset(reached[0][0], depth + 1)
        if isinstance(side, ast.Call) and isinstance(side.func, ast.Attribute) and call_name(side) in PRESERVING_METHODS:
            return outer_offset(side.func.value, depth + 1)
        return 0
    return outer_offset(node.left) - outer_offset(node.comparators[0])


@detector("dflash.blocks_isolated")
def detect_blocks_isolated(an: Analyzer) -> list[CodeReading]:
    readings = _mask_formula_readings(an)
    for node, op in _block_comparisons(an):
        switch = an.switch_of(node)
        shift = _block_id_shift(an, node)
        if op == "Eq" and shift:
            value, detail = "cross-block", (f"the block ids compared are {shift:+d} apart: a block sees another block's "
                                            "tokens instead of its own")
        elif op == "Eq":
            value, detail = "isolated", "a block's keys are restricted to its own block (same block id)"
        elif op in {"Lt", "LtE", "Gt", "GtE"}:
            value, detail = "cross-block", "block tokens see other blocks (block ids compared with an order, not ==)"
        elif op == "NotEq" and _polarity(an, node) == "blocked":
            value, detail = "isolated", "keys of other blocks are masked out"
        else:
            continue
        mode = "switch" if switch and not re.search(r"window|sliding", switch) else "hardcoded"
        readings.append(reading_at(an, "dflash.blocks_isolated", value, node, 0.8, mode=mode, switch=switch, detail=detail))
    return readings


_UNKNOWN = object()


def _feeds_context(an: Analyzer, call: ast.Call) -> bool:
    """The call passes the drafter's context (target hidden states / fused features) as an argument."""
    for value in [kw.value for kw in call.keywords if kw.arg] + list(call.args):
        names = [leaf_name(n) for n in ast.walk(value) if isinstance(n, (ast.Name, ast.Attribute))]
        if any(set(tokens(n)) & (CONTEXT_TOKENS - {"prefix", "cond"}) and set(tokens(n)) & {"hidden", "hiddens", "feature", "features", "feat", "feats", "ctx", "context"} for n in names):
            return True
    return any(kw.arg and set(tokens(kw.arg)) & {"target", "ctx", "context"} and set(tokens(kw.arg)) & {"hidden", "features", "feats", "ctx", "context"}
               for kw in call.keywords)


def _full_attention_reading(an: Analyzer, node: ast.AST, switch: str) -> CodeReading:
    """A causal restriction under a runtime condition: whether it applies to a FULL-attention layer is what the
    rule is about. The condition is evaluated with the window size None (what a full-attention layer has),
    through the names it is built from and into every caller (a flag a caller passes, or leaves at its default,
    decides; a config field's default counts as a default): `non_causal = window is None or flag` keeps full
    attention bidirectional whatever the flag says; `non_causal = flag` makes it causal wherever the flag is
    left False. The name of a flag decides nothing. Any caller path that makes it causal is causal."""
    test, in_body = _enclosing_test(an, node)
    flags: dict[str, object] = {}
    values = _evaluate(an, test, flags, 0, {}) if test is not None else {_UNKNOWN}
    truths = {(_UNKNOWN if v is _UNKNOWN else bool(v) == in_body) for v in values}
    defaults = ", ".join(f"{k}={v!r}" for k, v in flags.items())
    mode = "default" if flags else "hardcoded"
    if True in truths:
        return reading_at(an, "dflash.block_bidirectional", "causal", node, 0.75, mode=mode,
                          detail=f"causal in the block for full-attention layers too: `{switch}` holds with no sliding "
                          f"window" + (f" (at {defaults})" if defaults else ""))
    if truths == {False}:
        return reading_at(an, "dflash.block_bidirectional", "bidirectional", node, 0.5, mode=mode,
                          detail=f"causal only for sliding-window layers (`{switch}` is false with no window"
                          + (f", at {defaults})" if defaults else ")"))
    return reading_at(an, "dflash.block_bidirectional", "causal", node, 0.5, mode="switch", switch=switch,
                      detail=f"causal under `{switch}`: whether that holds for full-attention layers was not established")


def _enclosing_test(an: Analyzer, node: ast.AST) -> tuple[ast.expr | None, bool]:
    child, current = node, an.parents.get(node)
    while current is not None and not isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Module)):
        if isinstance(current, (ast.If, ast.IfExp)) and child is not current.test:
            in_body = child is current.body or (isinstance(current.body, list) and child in current.body)
            return current.test, in_body
        child, current = current, an.parents.get(current)
    return None, True


def _is_window_size(name: str, default: ast.expr | None) -> bool:
    toks = set(tokens(name))
    if not toks & {"window", "sliding", "swa"}:
        return False
    return not (isinstance(default, ast.Constant) and isinstance(default.value, bool))


def _evaluate(an: Analyzer, node: ast.AST, flags: dict[str, object], depth: int,
              bindings: dict[str, ast.expr]) -> set[object]:
    """The values a condition can take for a full-attention layer (window None), over every caller path;
    _UNKNOWN stands for a value not established."""
    if depth > 10:
        return {_UNKNOWN}
    if isinstance(node, ast.Constant):
        return {node.value}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return {v if v is _UNKNOWN else not v for v in _evaluate(an, node.operand, flags, depth + 1, bindings)}
    if isinstance(node, ast.BoolOp):
        out: set[object] = set()
        combos: list[list[object]] = [[]]
        for value in node.values:
            combos = [c + [v] for c in combos for v in _evaluate(an, value, flags, depth + 1, bindings)][:64]
        for combo in combos:
            out.add(_bool_op(isinstance(node.op, ast.Or), combo))
        return out
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)):
        out = set()
        for left in _evaluate(an, node.left, flags, depth + 1, bindings):
            for right in _evaluate(an, node.comparators[0], flags, depth + 1, bindings):
                if left is _UNKNOWN or right is _UNKNOWN:
                    out.add(_UNKNOWN)
                    continue
                # only None identity is decided: `x is None` with x a window (None) or a known constant
                if left is not None and right is not None:
                    out.add(_UNKNOWN)
                    continue
                same = left is None and right is None
                out.add(same if isinstance(node.ops[0], ast.Is) else not same)
        return out
    if isinstance(node, ast.Name):
        if node.id in bindings:
            return _evaluate(an, bindings[node.id], flags, depth + 1, {})
        reached = reaching_definitions(an, node)
        if reached and reached[0] and not reached[1]:
            out = set()
            for definition in reached[0][-2:]:
                out |= _evaluate(an, definition, flags, depth + 1, bindings)
            return out
        owner = _owning_parameter(an, node)
        if owner is None:
            return {_UNKNOWN}
        func, default = owner
        return _parameter_values(an, func, node.id, default, flags, depth)
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            found = an.defs_of(node)
            if found and found[0]:
                out = set()
                for definition in found[0][-2:]:
                    out |= _evaluate(an, definition, flags, depth + 1, {})
                return out
            return {_UNKNOWN}
        # a config field (`config.flag`): its declared default, when the field is declared once
        entries = an.field_defaults.get(node.attr, [])
        literals = {an.literal(v) for v, _u, _s in entries}
        if len(literals) == 1:
            value = literals.pop()
            if isinstance(value, bool) or value is None:
                flags[node.attr] = value
                return {value}
        return {_UNKNOWN}
    return {_UNKNOWN}


def _bool_op(is_or: bool, values: list[object]) -> object:
    if is_or:
        if any(v is not _UNKNOWN and v for v in values):
            return True
        return _UNKNOWN if any(v is _UNKNOWN for v in values) else False
    if any(v is not _UNKNOWN and not v for v in values):
        return False
    return _UNKNOWN if any(v is _UNKNOWN for v in values) else True


def _parameter_values(an: Analyzer, func: ast.AST, name: str, default: ast.expr | None, flags: dict[str, object],
                      depth: int) -> set[object]:
    if _is_window_size(name, default):
        return {None}  # a full-attention layer: no window
    callee = func.name if not (func.name == "__init__" and isinstance(an.parents.get(func), ast.ClassDef)) \
        else an.parents[func].name
    calls = an.calls_named(callee)
    positional = [a.arg for a in func.args.posonlyargs + func.args.args]
    if positional and positional[0] in {"self", "cls"}:
        positional = positional[1:]
    index = positional.index(name) if name in positional else None
    out: set[object] = set()
    for call in calls[:6]:
        arg = kwarg(call, name)
        if arg is None and index is not None and index < len(call.args) and not any(
                isinstance(a, ast.Starred) for a in call.args[: index + 1]):
            arg = call.args[index]
        if arg is not None:
            out |= _evaluate(an, arg, flags, depth + 1, {})
        elif call.keywords and any(kw.arg is None for kw in call.keywords):
            out.add(_UNKNOWN)  # **kwargs may carry it
        else:
            out |= _default_value(name, default, flags)
    if not calls:
        out |= _default_value(name, default, flags)
    return out or {_UNKNOWN}


def _default_value(name: str, default: ast.expr | None, flags: dict[str, object]) -> set[object]:
    if isinstance(default, ast.Constant) and (isinstance(default.value, bool) or default.value is None):
        flags[name] = default.value
        return {default.value}
    return {_UNKNOWN}


def _owning_parameter(an: Analyzer, node: ast.Name) -> tuple[ast.AST, ast.expr | None] | None:
    """(function, default) for a name that is a parameter of its function or of an enclosing one (a closure)."""
    func = an.enclosing_function(node)
    while func is not None:
        args = func.args
        positional = args.posonlyargs + args.args
        defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        for arg, default in list(zip(positional, defaults)) + list(zip(args.kwonlyargs, args.kw_defaults)):
            if arg.arg == node.id:
                return func, default
        func = an.enclosing_function(func)
    return None


@detector("dflash.block_bidirectional")
def detect_block_bidirectional(an: Analyzer) -> list[CodeReading]:
    readings = []
    for node in nodes_of(an, ast.Compare):
        if len(node.ops) != 1 or type(node.ops[0]) not in _FLIP_OP:
            continue
        left, right = node.left, node.comparators[0]
        lt, rt = an.tags(left), an.tags(right)
        if "anchor" in lt or "anchor" in rt or "blockid" in lt or "blockid" in rt:
            continue
        if _floordiv_divisors(an, left) & _floordiv_divisors(an, right):
            continue  # block indices (both divided by the same size) compared: a block-level rule, not slot order
        q_kv = ("q" in lt and "kv" in rt and "kv" not in lt) or ("kv" in lt and "q" in rt and "q" not in lt)
        if not q_kv or not scope_mentions_block(an, node):
            continue
        switch = an.switch_of(node)
        if switch:
            # what the switch is for a full-attention layer with the flags as the callers / defaults set them
            evaluated = _full_attention_reading(an, node, switch)
            if evaluated.mode != "switch" or mentions_window(an, node, switch):
                readings.append(evaluated)
                continue
        mode = "switch" if switch else "hardcoded"
        readings.append(reading_at(an, "dflash.block_bidirectional", "causal", node, 0.75, mode=mode, switch=switch,
                                 detail="queries of a block see only earlier block tokens (query/key order compared)"))
    for node in nodes_of(an, ast.Call):
        name = call_name(node)
        causal = kwarg(node, "is_causal")
        scope_ok = scope_mentions_block(an, node) or in_draft_class(an, node)
        is_attention_call = bool(re.search(r"attention|attn|sdpa", name, re.I))
        # Evidence both ways or neither: a flag that counts when it says False must count when it says True
        # (a drafter pass switched to is_causal=True must not fall back to other readings). On a call that is not
        # an attention function, the flag is about the drafter only when the call feeds it the context features
        # (a target model call may pass is_causal=True legitimately).
        drafter_call = not is_attention_call and _feeds_context(an, node)
        if causal is not None and isinstance(causal, ast.Constant) and isinstance(causal.value, bool) and scope_ok and (
                is_attention_call or drafter_call or causal.value is False):
            value = "causal" if causal.value is True else "bidirectional"
            what = "attention call" if is_attention_call else "drafter call" if drafter_call else "call"
            readings.append(reading_at(an, "dflash.block_bidirectional", value, node, 0.6,
                                     detail=f"{what} with is_causal={causal.value}"))
        if name in {"tril", "tril_"} and scope_ok and _scope_mentions_mask(an, node):
            readings.append(reading_at(an, "dflash.block_bidirectional", "causal", node, 0.55,
                                     detail="a lower-triangular (causal) mask in the block attention"))
    # same-block equality with no causal restriction is bidirectional within the block
    if not any(r.value == "causal" for r in readings):
        for node, op in _block_comparisons(an):
            # kv_block <= q_block also shows a block all of its own tokens (the cross-block part is its own finding)
            if op in {"Eq", "LtE", "GtE"} and not an.switch_of(node):
                readings.append(reading_at(an, "dflash.block_bidirectional", "bidirectional", node, 0.7,
                                         detail="block tokens see every token of their block (no order restriction)"))
    return readings
