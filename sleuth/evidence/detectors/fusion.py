"""The context path: fc over the selected layers, the norm after it, K/V injection into every layer."""

from __future__ import annotations

import ast
import re

from sleuth.evidence.source import (
    Analyzer,
    CONTEXT_TOKENS,
    CodeReading,
    Mode,
    PRESERVING_METHODS,
    Scope,
    _in_draft_class,
    _reading,
    _walk_all,
    call_name,
    const_number,
    kwarg,
    leaf_name,
    tokens,
)


# --- fc ------------------------------------------------------------------------------------------------


def _linear_dims(an: Analyzer, node: ast.Call) -> tuple[ast.expr, ast.expr] | None:
    name = call_name(node)
    if name == "Linear":
        in_f = node.args[0] if node.args else kwarg(node, "in_features")
        out_f = node.args[1] if len(node.args) >= 2 else kwarg(node, "out_features")
        if in_f is not None and out_f is not None:
            return in_f, out_f
    if name == "Parameter" and node.args and isinstance(node.args[0], ast.Call):
        inner = node.args[0]
        if call_name(inner) in {"empty", "zeros", "randn", "rand", "ones"} and len(inner.args) == 2:
            return inner.args[1], inner.args[0]
    return None


def _is_width_name(name: str) -> bool:
    return bool(re.search(r"hidden|d_model|n_embd|model_dim|embed_dim|width", name, re.I)) or name in {"dim", "H", "d", "D"}


def _multiplier(an: Analyzer, in_f: ast.expr, out_f: ast.expr, depth: int = 0) -> ast.expr | None:
    """M in in_features = M * hidden, where hidden is the output width (same text or both width names)."""
    if isinstance(in_f, ast.BinOp) and isinstance(in_f.op, ast.Mult):
        out_text, out_leaf = ast.unparse(out_f), leaf_name(out_f)
        for factor, other in ((in_f.left, in_f.right), (in_f.right, in_f.left)):
            text, leaf = ast.unparse(other), leaf_name(other)
            if text == out_text or (leaf and leaf == out_leaf) or (_is_width_name(leaf) and _is_width_name(out_leaf)):
                return factor
    if isinstance(in_f, (ast.Name, ast.Attribute)) and depth < 3:
        found = an.defs_of(in_f)
        if found and len(found[0]) == 1:
            return _multiplier(an, found[0][0], out_f, depth + 1)
    return None


def _classify_layer_count(an: Analyzer, node: ast.expr, depth: int = 0) -> tuple[str, str, float, Mode]:
    """('all' | 'subset' | 'count:<n>' | 'config', detail, confidence, mode) for the fc multiplier."""
    if depth > 4:
        return "config", "not resolved", 0.3, "switch"
    if isinstance(node, ast.Call) and call_name(node) == "len" and node.args:
        arg = node.args[0]
        if isinstance(arg, ast.Subscript) and isinstance(arg.slice, ast.Slice):
            return "subset", f"len({ast.unparse(arg)}): a slice of the selected layers", 0.85, "hardcoded"
        if isinstance(arg, (ast.Name, ast.Attribute)):
            found = an.defs_of(arg)
            if found and len(found[0]) == 1 and isinstance(found[0][0], ast.Subscript) and isinstance(found[0][0].slice, ast.Slice):
                return "subset", f"{ast.unparse(arg)} = {ast.unparse(found[0][0])}: a slice of the selected layers", 0.8, "hardcoded"
        return "all", f"len({ast.unparse(arg)}) * hidden: every selected layer", 0.85, "hardcoded"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and const_number(node.right):
        inner, detail, conf, mode = _classify_layer_count(an, node.left, depth + 1)
        if inner == "all" or (inner == "config" and re.search(r"layer|num|^n_|^k$|feat|aux|tap|count", leaf_name(node.left), re.I)):
            return "subset", f"{ast.unparse(node)}: fewer than the selected layers", 0.8, "hardcoded"
    number = const_number(node)
    if number is not None:
        return f"count:{int(number)}", f"a hard-coded {int(number)} layers", 0.6, "hardcoded"
    if isinstance(node, (ast.Name, ast.Attribute)):
        found = an.defs_of(node)
        if found and found[0]:
            if len(found[0]) == 1:
                return _classify_layer_count(an, found[0][0], depth + 1)
            return "config", f"{ast.unparse(node)} has several definitions", 0.3, "switch"
        default = an.scope(node).param_default(leaf_name(node)) if isinstance(node, ast.Name) else None
        if default is not None and default[1] is not None and not (isinstance(default[1], ast.Constant) and default[1].value is None):
            value, detail, conf, _ = _classify_layer_count(an, default[1], depth + 1)
            return value, f"default of parameter {leaf_name(node)}: {detail}", min(conf, 0.5), "default"
        if default is not None:
            args = _call_site_arguments(an, default[2], leaf_name(node))
            if args:
                classified = [_classify_layer_count(an, arg, depth + 1) for arg in args]
                values = {c[0] for c in classified}
                if len(values) == 1 and "config" not in values:
                    value, detail, conf, mode = classified[0]
                    return value, f"{leaf_name(node)} = {ast.unparse(args[0])} at its call site: {detail}", conf - 0.1, mode
        return "config", f"{ast.unparse(node)} is passed in at run time (a config-driven count)", 0.3, "switch"
    return "config", f"{ast.unparse(node)} not resolved statically", 0.3, "switch"


def _call_site_arguments(an: Analyzer, scope: Scope, param: str) -> list[ast.expr]:
    """The arguments passed for `param` where the function owning `scope` is called (a class for __init__)."""
    func = scope.node
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    positional = [a.arg for a in func.args.posonlyargs + func.args.args]
    callee = func.name
    if callee == "__init__":
        cls = an.parents.get(func)
        if not isinstance(cls, ast.ClassDef):
            return []
        callee = cls.name
    if positional and positional[0] in {"self", "cls"}:
        positional = positional[1:]
    index = positional.index(param) if param in positional else None
    found = []
    for call in _walk_all(an, ast.Call):
        if call_name(call) != callee:
            continue
        arg = kwarg(call, param)
        if arg is None and index is not None and index < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[: index + 1]):
            arg = call.args[index]
        if arg is not None:
            found.append(arg)
    return found


def _layer_list_lengths(an: Analyzer) -> set[int]:
    """Lengths of literal lists of target layer ids in the code (defaults, fields, assignments)."""
    lengths: set[int] = set()
    for node in _walk_all(an, (ast.Assign, ast.AnnAssign, ast.arg, ast.keyword)):
        name, value = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name, value = leaf_name(node.targets[0]), node.value
        elif isinstance(node, ast.AnnAssign):
            name, value = leaf_name(node.target), node.value
        elif isinstance(node, ast.keyword):
            name, value = node.arg, node.value
        if not name or value is None or not re.search(r"layer", name, re.I) or not re.search(r"id|idx|indices|select|aux|tap", name, re.I):
            continue
        if isinstance(value, ast.Call) and call_name(value) in {"Field", "field"}:
            value = kwarg(value, "default") or (kwarg(value, "default_factory") or None)
            if isinstance(value, ast.Lambda):
                value = value.body
        if isinstance(value, (ast.List, ast.Tuple)) and value.elts and all(const_number(e) is not None for e in value.elts):
            lengths.add(len(value.elts))
    return lengths


def detect_fc(an: Analyzer) -> tuple[list[CodeReading], list[str]]:
    """Readings for dflash.fc_input_layers, and the attribute names of the fusion projection(s)."""
    readings: list[CodeReading] = []
    names: list[str] = []
    for node in _walk_all(an, ast.Call):
        dims = _linear_dims(an, node)
        if dims is None:
            continue
        multiplier = _multiplier(an, *dims)
        if multiplier is None:
            continue
        parent = an.parents.get(node)
        if isinstance(parent, ast.Assign) and parent.targets:
            names.append(leaf_name(parent.targets[0]))
        elif isinstance(parent, ast.AnnAssign):
            names.append(leaf_name(parent.target))
        elif isinstance(parent, ast.Dict):
            for key, value in zip(parent.keys, parent.values):
                if value is node and isinstance(key, ast.Constant) and isinstance(key.value, str):
                    names.append(key.value)
        elif isinstance(parent, ast.keyword) and parent.arg:
            names.append(parent.arg)
        value, detail, confidence, mode = _classify_layer_count(an, multiplier)
        if value.startswith("count:"):
            lengths = _layer_list_lengths(an)
            if len(lengths) == 1:
                selected = lengths.pop()
                value = "all" if int(value.split(":")[1]) == selected else "subset"
                detail += f"; the code's layer-id list has {selected} entries"
        readings.append(_reading(an, "dflash.fc_input_layers", value, node, confidence, mode=mode,
                                 switch=ast.unparse(multiplier) if mode == "switch" else None, detail=detail))
    # the feature concatenation: cat([hs[i + 1] for i in layer_ids[:-1]], -1)
    for node in _walk_all(an, ast.Call):
        if call_name(node) not in {"cat", "concat", "concatenate"} or not node.args:
            continue
        comp = node.args[0]
        if not isinstance(comp, (ast.ListComp, ast.GeneratorExp)) or not comp.generators:
            continue
        iterable = comp.generators[0].iter
        if isinstance(iterable, ast.Subscript) and isinstance(iterable.slice, ast.Slice) and "layer" in ast.unparse(iterable.value).lower():
            readings.append(_reading(an, "dflash.fc_input_layers", "subset", node, 0.75,
                                     detail=f"features concatenated over {ast.unparse(iterable)}: a slice of the selected layers"))
    return readings, names


def detect_fc_norm(an: Analyzer, fc_names: list[str]) -> list[CodeReading]:
    readings = []
    if not fc_names:
        return readings
    for node in _walk_all(an, ast.Call):
        func = node.func
        is_fc_call = (isinstance(func, ast.Attribute) and func.attr in fc_names) or (
            isinstance(func, ast.Subscript) and isinstance(func.slice, ast.Constant) and func.slice.value in fc_names)
        if not is_fc_call:
            continue
        parent = an.parents.get(node)
        normed = False
        if isinstance(parent, ast.Call) and _is_norm_call(parent):
            normed = True
        elif isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute) and parent.func.value is node:
            grand = an.parents.get(parent)
            normed = isinstance(grand, ast.Call) and _is_norm_call(grand)
        elif isinstance(parent, ast.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0], ast.Name):
            var = parent.targets[0].id
            func = an.enclosing_function(node)
            returned = False
            if func is not None:
                for other in ast.walk(func):
                    if isinstance(other, ast.Call) and _is_norm_call(other) and other.lineno >= node.lineno and any(
                        isinstance(a, ast.Name) and a.id == var for a in other.args
                    ):
                        normed = True
                    if isinstance(other, ast.Return) and isinstance(other.value, ast.Name) and other.value.id == var:
                        returned = True
            if returned and not normed:
                continue  # the caller may norm it: not evidence either way
        else:
            continue
        value = "normed" if normed else "raw"
        detail = "fc output goes through a norm" if normed else "fc output is used without a norm"
        readings.append(_reading(an, "dflash.fc_norm", value, node, 0.75 if normed else 0.6, detail=detail))
    return readings


def _is_norm_call(node: ast.Call) -> bool:
    func = node.func
    if isinstance(func, ast.Subscript) and isinstance(func.slice, ast.Constant) and isinstance(func.slice.value, str):
        name = func.slice.value.lower()
        return "norm" in name or name in {"ln", "ln_f"}
    name = call_name(node).lower()
    return "norm" in name or bool(set(tokens(name)) & {"ln", "rms", "layernorm"})


# --- KV injection -------------------------------------------------------------------------------------


def _is_context(an: Analyzer, node: ast.AST) -> bool:
    names = [leaf_name(n) for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))]
    return any(set(tokens(n)) & CONTEXT_TOKENS for n in names)


def detect_kv_injection(an: Analyzer) -> list[CodeReading]:
    readings = []
    for node in _walk_all(an, ast.Call):
        if call_name(node) not in {"cat", "concat", "concatenate"} or not node.args:
            continue
        seq = node.args[0]
        if not isinstance(seq, (ast.List, ast.Tuple)) or len(seq.elts) != 2:
            continue
        first, second = seq.elts
        a_ctx, b_ctx = _is_context(an, first), _is_context(an, second)
        if a_ctx == b_ctx:
            continue
        # (a) cat of one projection applied to both sources, (b) a projection applied to cat(context, block)
        projected = _projection_of(an, first) and _projection_of(an, second)
        parent = an.parents.get(node)
        feeds_projection = False
        if isinstance(parent, ast.Assign) and isinstance(parent.targets[0], ast.Name):
            var = parent.targets[0].id
            func = an.enclosing_function(node)
            if func is not None:
                feeds_projection = any(
                    isinstance(c, ast.Call) and _is_kv_projection_name(call_name(c)) and any(isinstance(a, ast.Name) and a.id == var for a in c.args)
                    for c in ast.walk(func)
                )
        if isinstance(parent, ast.Call) and _is_kv_projection_name(call_name(parent)):
            feeds_projection = True
        if not (projected or feeds_projection):
            continue
        value = "context K/V first" if a_ctx else "block K/V first"
        readings.append(_reading(an, "dflash.kv_injection", value, node, 0.75,
                                 detail="every layer projects the context with its own K/V projections, "
                                 + ("context before the block" if a_ctx else "block before the context")))
    # input injection: the fused context is added to the block's hidden states instead of serving as K/V
    if not readings:
        for node in _walk_all(an, ast.BinOp):
            if not isinstance(node.op, ast.Add):
                continue
            if _is_context(an, node.left) != _is_context(an, node.right) and _in_draft_class(an, node):
                side = node.left if _is_context(an, node.left) else node.right
                if any(isinstance(c, ast.Call) and (c.func is not None and leaf_name(c.func) in {"fc", "proj", "context_proj", "feature_fusion"}) for c in ast.walk(side)) or "fused" in ast.unparse(side).lower():
                    readings.append(_reading(an, "dflash.kv_injection", "added to hidden states", node, 0.55,
                                             detail="the fused context is added to the block's hidden states, not injected as K/V"))
    return readings


def _is_kv_projection_name(name: str) -> bool:
    lower = name.lower()
    return bool(re.fullmatch(r"(k|v|key|value|wk|wv|to_k|to_v|k_proj|v_proj|kv_proj|key_proj|value_proj|c_attn|kv)", lower)) or lower.endswith(("k_proj", "v_proj", "kv_proj"))


def _projection_of(an: Analyzer, node: ast.AST, depth: int = 0) -> bool:
    if isinstance(node, ast.Call):
        if _is_kv_projection_name(call_name(node)):
            return True
        if isinstance(node.func, ast.Attribute) and call_name(node) in PRESERVING_METHODS:
            return _projection_of(an, node.func.value, depth + 1)
    if isinstance(node, ast.Name) and depth < 3:
        found = an.defs_of(node)
        if found and found[0]:
            return _projection_of(an, found[0][-1], depth + 1)
    return False
