"""The context path: fc over the selected layers, the norm after it, K/V injection into every layer."""

from __future__ import annotations

import ast
import re

from sleuth.evidence.ast_index import (
    Analyzer,
    CONTEXT_TOKENS,
    CodeReading,
    Mode,
    PRESERVING_METHODS,
    Scope,
    in_draft_class,
    reading_at,
    nodes_of,
    call_name,
    const_number,
    kwarg,
    leaf_name,
    tokens,
    is_module_name,
)
from sleuth.evidence.origins import is_noop_module, module_definitions, reaching_definitions
from sleuth.evidence.registry import detector


# --- fc ------------------------------------------------------------------------------------------------


def _linear_dims(an: Analyzer, node: ast.Call) -> tuple[ast.expr, ast.expr] | None:
    name = call_name(node)
    if name == "Linear":
        in_f = node.args[0] if node.args else kwarg(node, "in_features")
        out_f = node.args[1] if len(node.args) >= 2 else kwarg(node, "out_features")
        if in_f is not None and out_f is not None:
            return in_f, out_f
    if name in {"normal", "randn", "uniform", "truncated_normal", "zeros", "empty", "xavier_uniform", "glorot_normal",
                "lecun_normal", "orthogonal"}:
        # a raw weight matrix used as x @ W (JAX / numpy style): shape (in, out), given as a tuple argument
        shape = next((a for a in node.args if isinstance(a, ast.Tuple) and len(a.elts) == 2), kwarg(node, "shape"))
        if isinstance(shape, ast.Tuple) and len(shape.elts) == 2 and isinstance(shape.elts[0], ast.BinOp):
            return shape.elts[0], shape.elts[1]
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
    for call in nodes_of(an, ast.Call):
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
    for node in nodes_of(an, (ast.Assign, ast.AnnAssign, ast.arg, ast.keyword)):
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
    # inline: cat([out.hidden_states[i + 1] for i in (1, 9, 17, 25, 33)], -1)
    for comp in nodes_of(an, (ast.ListComp, ast.GeneratorExp)):
        iterable = comp.generators[0].iter
        if not (isinstance(iterable, (ast.List, ast.Tuple)) and len(iterable.elts) >= 2
                and all(const_number(e) is not None for e in iterable.elts)):
            continue
        if any(isinstance(n, ast.Subscript) and re.search(r"hidden|states|hs", leaf_name(n.value), re.I) for n in ast.walk(comp.elt)):
            lengths.add(len(iterable.elts))
    return lengths


@detector("dflash.fc_input_layers")
def detect_fc_input_layers(an: Analyzer) -> list[CodeReading]:
    return every_site_counts(an.memo("fc", lambda: detect_fc(an))[0], good={"all"})


@detector("dflash.fc_norm")
def detect_fc_norm_after_fc(an: Analyzer) -> list[CodeReading]:
    return every_site_counts(detect_fc_norm(an, an.memo("fc", lambda: detect_fc(an))[1]), good={"normed"})


def every_site_counts(readings: list[CodeReading], good: set[str]) -> list[CodeReading]:
    """Each definition of the fusion path is a site of its own (a torch model next to an MLX port, a training
    model next to an export copy): a correct one elsewhere never vouches for a broken one. A hard-coded
    disagreeing reading in another scope is raised to the strongest agreeing reading's confidence, so the
    verdict is the broken site's, with the agreeing ones named in the notes."""
    agreeing = [r for r in readings if r.value in good and r.mode == "hardcoded"]
    if not agreeing:
        return readings
    top = max(r.confidence for r in agreeing)
    for r in readings:
        if r.mode != "hardcoded" or r.value in good or str(r.value).endswith("?") or str(r.value).startswith("count:"):
            continue
        others = [a for a in agreeing if (a.path, a.scope) != (r.path, r.scope)]
        if others and r.confidence < top:
            r.confidence = top
            r.detail += f"; {others[0].path}:{others[0].line} agrees with the rule, but every definition in the tree must"
    return readings


def _fusion_name(name: str | None) -> bool:
    return bool(name) and bool(re.search(r"(^|_)(fc|fus|fusion|feat|features?|ctx|context|aux|taps?|cond|target)"
                                         r"|hidden_proj|input_proj|proj_in|in_proj", name, re.I))


def detect_fc(an: Analyzer) -> tuple[list[CodeReading], list[str]]:
    """Readings for dflash.fc_input_layers, and the attribute names of the fusion projection(s)."""
    readings: list[CodeReading] = []
    names: list[str] = []
    candidates: list[tuple[ast.Call, str | None, ast.expr]] = []
    widenings: set[str] = set()  # multipliers of Linear(H, M * H): the up / gate half of an MLP
    for node in nodes_of(an, ast.Call):
        dims = _linear_dims(an, node)
        if dims is None:
            continue
        widening = _multiplier(an, dims[1], dims[0])
        if widening is not None:
            widenings.add(ast.unparse(widening))
        multiplier = _multiplier(an, *dims)
        if multiplier is None:
            continue
        parent = an.parents.get(node)
        while isinstance(parent, ast.BinOp) and isinstance(parent.op, (ast.Mult, ast.Div)):
            parent = an.parents.get(parent)  # normal(key, shape) * 0.02
        name = None
        if isinstance(parent, ast.Assign) and parent.targets:
            name = leaf_name(parent.targets[0])
        elif isinstance(parent, ast.AnnAssign):
            name = leaf_name(parent.target)
        elif isinstance(parent, ast.Dict):
            name = next((key.value for key, value in zip(parent.keys, parent.values)
                         if value is node and isinstance(key, ast.Constant) and isinstance(key.value, str)), None)
        elif isinstance(parent, ast.keyword) and parent.arg:
            name = parent.arg
        if name:
            names.append(name)
        candidates.append((node, name, multiplier))
    # A Linear(M * H, H) is the fusion projection only where nothing says otherwise: one whose M * H width some
    # Linear(H, M * H) produces is an MLP's down projection, and where some candidates are named as the fusion
    # (fc, fusion, context / feature projection), the unnamed and otherwise-named ones (a target's own mixing
    # layer, a block's MLP) are not it.
    candidates = [c for c in candidates if ast.unparse(c[2]) not in widenings or _fusion_name(c[1])]
    if any(_fusion_name(c[1]) for c in candidates):
        candidates = [c for c in candidates if _fusion_name(c[1])]
    for node, _name, multiplier in candidates:
        value, detail, confidence, mode = _classify_layer_count(an, multiplier)
        if value.startswith("count:"):
            lengths = _layer_list_lengths(an)
            if len(lengths) == 1:
                selected = lengths.pop()
                value = "all" if int(value.split(":")[1]) == selected else "subset"
                detail += f"; the code's layer-id list has {selected} entries"
        readings.append(reading_at(an, "dflash.fc_input_layers", value, node, confidence, mode=mode,
                                 switch=ast.unparse(multiplier) if mode == "switch" else None, detail=detail))
    # the feature concatenation: cat([hs[i + 1] for i in layer_ids[:-1]], -1)
    for node in nodes_of(an, ast.Call):
        if call_name(node) not in {"cat", "concat", "concatenate"} or not node.args:
            continue
        comp = node.args[0]
        if not isinstance(comp, (ast.ListComp, ast.GeneratorExp)) or not comp.generators:
            continue
        iterable = comp.generators[0].iter
        if isinstance(iterable, ast.Subscript) and isinstance(iterable.slice, ast.Slice) and "layer" in ast.unparse(iterable.value).lower():
            readings.append(reading_at(an, "dflash.fc_input_layers", "subset", node, 0.75,
                                     detail=f"features concatenated over {ast.unparse(iterable)}: a slice of the selected layers"))
    # stack(..., dim=-1).flatten(-2): every selected layer is read, but fc's input interleaves them feature by feature
    for node in nodes_of(an, ast.Call):
        if call_name(node) != "stack" or not node.args or not isinstance(node.args[0], (ast.ListComp, ast.GeneratorExp)):
            continue
        dim = kwarg(node, "dim") if kwarg(node, "dim") is not None else (node.args[1] if len(node.args) > 1 else None)
        if const_number(dim) != -1 or not _whole_layer_comprehension(node.args[0]):
            continue
        parent = an.parents.get(node)
        merged = isinstance(parent, ast.Attribute) and parent.attr == "flatten" and isinstance(an.parents.get(parent), ast.Call) \
            and [const_number(a) for a in an.parents.get(parent).args] == [-2]
        if merged:
            readings.append(reading_at(an, "dflash.fc_input_layers", "interleaved", node, 0.75,
                                     detail="the selected layers are stacked on the last dim and flattened: fc's input "
                                            "interleaves them feature by feature instead of concatenating them"))
    # the fused features are every selected layer, concatenated whole: cat(feats, -1) where feats is (through a
    # local name or a parameter's call sites) [hidden_states[i + 1] for i in layer_ids], no slice anywhere.
    # Weak evidence (0.5): any subset reading above outweighs it.
    if readings and not any(r.value == "subset" for r in readings):
        for node in nodes_of(an, ast.Call):
            if call_name(node) not in {"cat", "concat", "concatenate"} or not node.args or not _in_fusion(an, node, names):
                continue
            comps = _bound_comprehensions(an, node.args[0])
            if comps and all(_whole_layer_comprehension(c) for c in comps):
                readings.append(reading_at(an, "dflash.fc_input_layers", "all", node, 0.5,
                                         detail="the fused features concatenate every selected layer (no slice)"))
    return readings, names


def _in_fusion(an: Analyzer, node: ast.AST, fc_names: list[str]) -> bool:
    """The concatenation feeds the fusion projection in the same expression or function."""
    func = an.enclosing_function(node)
    if func is None:
        return False
    text = ast.get_source_segment(an.unit(node).text, func) or ""
    return any(re.search(rf"\b{re.escape(n)}\b", text) for n in fc_names)


def _bound_comprehensions(an: Analyzer, node: ast.AST, depth: int = 0) -> list[ast.AST]:
    if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
        return [node]
    if depth > 2 or not isinstance(node, ast.Name):
        return []
    found = an.defs_of(node)
    if found and found[0]:
        out = []
        for d in found[0]:
            inner = _bound_comprehensions(an, d, depth + 1)
            if not inner:
                return []
            out += inner
        return out
    default = an.scope(node).param_default(node.id)
    if default is not None:
        out = []
        for arg in _call_site_arguments(an, default[2], node.id):
            inner = _bound_comprehensions(an, arg, depth + 1)
            if not inner:
                return []
            out += inner
        return out
    return []


def _whole_layer_comprehension(comp: ast.AST) -> bool:
    iterable = comp.generators[0].iter
    if isinstance(iterable, ast.Subscript) and isinstance(iterable.slice, ast.Slice):
        return False
    return any(isinstance(n, ast.Subscript) and re.search(r"hidden|states|\bhs\b", ast.unparse(n.value), re.I) for n in ast.walk(comp.elt))


def detect_fc_norm(an: Analyzer, fc_names: list[str]) -> list[CodeReading]:
    readings = []
    if not fc_names:
        return readings
    for node in nodes_of(an, ast.Call):
        func = node.func
        is_fc_call = (isinstance(func, ast.Attribute) and func.attr in fc_names) or (
            isinstance(func, ast.Subscript) and isinstance(func.slice, ast.Constant) and func.slice.value in fc_names)
        if not is_fc_call:
            continue
        readings.extend(_fc_norm_at(an, node))
    for node in nodes_of(an, ast.BinOp):
        # x @ params["fc"] / x @ self.fc_weight: the same projection as a matmul with the raw matrix
        right = node.right
        key = right.slice.value if isinstance(right, ast.Subscript) and isinstance(right.slice, ast.Constant) else (
            leaf_name(right) if isinstance(right, (ast.Name, ast.Attribute)) else None)
        if isinstance(node.op, ast.MatMult) and key in fc_names:
            readings.extend(_fc_norm_at(an, node))
    return readings


def _fc_norm_at(an: Analyzer, node: ast.AST) -> list[CodeReading]:
    readings = []
    parent = an.parents.get(node)
    norm_call: ast.Call | None = None
    if isinstance(parent, ast.Call) and _is_norm_call(parent):
        norm_call = parent
    elif isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute) and parent.func.value is node:
        grand = an.parents.get(parent)
        if isinstance(grand, ast.Call) and _is_norm_call(grand):
            norm_call = grand
    elif isinstance(parent, ast.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0], ast.Name):
        var = parent.targets[0].id
        func = an.enclosing_function(node)
        returned = False
        if func is not None:
            for other in ast.walk(func):
                if isinstance(other, ast.Call) and _is_norm_call(other) and other.lineno >= node.lineno and any(
                    isinstance(a, ast.Name) and a.id == var for a in other.args
                ):
                    norm_call = norm_call or other
                if isinstance(other, ast.Return) and isinstance(other.value, ast.Name) and other.value.id == var:
                    returned = True
        if returned and norm_call is None:
            return readings  # the caller may norm it: not evidence either way
        if norm_call is not None and func is not None and _normed_value_unused(an, func, var, norm_call):
            readings.append(reading_at(an, "dflash.fc_norm", "raw", node, 0.7,
                                       detail=f"`{ast.unparse(norm_call)[:50]}` is computed, but `{var}` (the fc output "
                                       "before the norm) is what the code goes on to use"))
            return readings
    else:
        return readings
    if norm_call is None:
        readings.append(reading_at(an, "dflash.fc_norm", "raw", node, 0.6, detail="fc output is used without a norm"))
        return readings
    switch = an.switch_of(norm_call)
    if switch is not None and switch != an.switch_of(node):
        # the norm applies only when a flag is set: the flag's default decides what runs
        default = _flag_default(an, norm_call)
        if default is False:
            readings.append(reading_at(an, "dflash.fc_norm", "raw", node, 0.7, mode="default", switch=switch,
                                       detail=f"fc output is normed only when `{switch}`, which defaults to off"))
            return readings
        if default is None:
            readings.append(reading_at(an, "dflash.fc_norm", "normed?", node, 0.5, mode="switch", switch=switch,
                                       detail=f"fc output is normed only when `{switch}`"))
            return readings
    # the norm is what the called module IS, not what it is called: `self.hidden_norm = nn.Identity()` is no norm
    kind, what = _norm_module_kind(an, norm_call)
    if kind == "noop":
        readings.append(reading_at(an, "dflash.fc_norm", "raw", node, 0.75,
                                   detail=f"fc output goes through `{ast.unparse(norm_call.func)}`, which is {what}: no norm"))
    elif kind == "switch":
        readings.append(reading_at(an, "dflash.fc_norm", "normed?", node, 0.5, mode="switch", switch=what,
                                   detail=f"`{ast.unparse(norm_call.func)}` is a norm or a pass-through depending on {what}"))
    elif kind == "norm":
        readings.append(reading_at(an, "dflash.fc_norm", "normed", node, 0.75, detail=f"fc output goes through a norm ({what})"))
    else:
        readings.append(reading_at(an, "dflash.fc_norm", "normed?", node, 0.5,
                                   detail=f"fc output goes through `{ast.unparse(norm_call.func)}`, {what}"))
    return readings


def _flag_default(an: Analyzer, node: ast.AST) -> bool | None:
    """The default of the flag an `if` around `node` tests (`if self.cfg.norm_context:`): a config field's or a
    parameter's default, through `not`; None when it cannot be read."""
    current = an.parents.get(node)
    while current is not None and not isinstance(current, ast.If):
        current = an.parents.get(current)
    if current is None:
        return None
    test, negated = current.test, False
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, negated = test.operand, True
    value = an.literal(test)
    if not isinstance(value, bool) and isinstance(test, (ast.Name, ast.Attribute)):
        defaults = {ast.unparse(v) for v, _u, _s in an.field_defaults.get(leaf_name(test), [])}
        if len(defaults) == 1:
            value = {"True": True, "False": False}.get(defaults.pop())
    if not isinstance(value, bool):
        return None
    in_body = any(node is n or _contains(an, n, node) for n in current.body)
    return (value != negated) if in_body else (value == negated)


def _contains(an: Analyzer, outer: ast.AST, node: ast.AST) -> bool:
    current = node
    while current is not None:
        if current is outer:
            return True
        current = an.parents.get(current)
    return False


def _normed_value_unused(an: Analyzer, func: ast.AST, var: str, norm_call: ast.Call) -> bool:
    """The norm's result is bound to another name that nothing reads, while the raw fc output is read after it."""
    parent = an.parents.get(norm_call)
    if not (isinstance(parent, ast.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0], ast.Name)):
        return False
    normed = parent.targets[0].id
    if normed == var:
        return False
    later = [n for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
             and n.lineno > norm_call.lineno]
    return not any(n.id == normed for n in later) and any(n.id == var for n in later)


def _norm_module_kind(an: Analyzer, call: ast.Call) -> tuple[str, str]:
    """('norm' | 'noop' | 'switch' | 'unresolved', what) for the module a norm-named call invokes."""
    callee = call.func
    if isinstance(callee, ast.Attribute) and is_module_name(callee.value) or (
            isinstance(callee, ast.Attribute) and isinstance(callee.value, ast.Attribute) and is_module_name(callee.value.value)):
        return "norm", f"`{ast.unparse(callee)}`"  # F.rms_norm / torch.nn.functional.layer_norm
    if isinstance(callee, ast.Name) and callee.id in an.functions:
        return "norm", f"local function `{callee.id}`"
    definitions = module_definitions(an, callee)
    if definitions is None:
        if isinstance(callee, ast.Attribute) and isinstance(callee.value, ast.Name) and callee.value.id == "self":
            return "unresolved", f"whose module `{ast.unparse(callee)}` is not assigned in the analysed code"
        return "norm", f"`{ast.unparse(callee)}`"  # a library norm called by its own name (rms_norm(x, w))
    kinds: set[str] = set()
    switch = None
    for definition in definitions:
        options = [definition.body, definition.orelse] if isinstance(definition, ast.IfExp) else [definition]
        if isinstance(definition, ast.IfExp):
            switch = ast.unparse(definition.test)
        elif len(definitions) > 1:
            switch = an.switch_of(definition) or switch
        for option in options:
            if is_noop_module(option):
                kinds.add("noop")
            elif isinstance(option, ast.Call) and _is_norm_call(option):
                kinds.add("norm")
            else:
                kinds.add("other")
    described = ", ".join(ast.unparse(d)[:50] for d in definitions[:2])
    if kinds == {"norm"}:
        return "norm", described
    if kinds == {"noop"}:
        return "noop", described
    if "noop" in kinds and "norm" in kinds:
        return "switch", switch or f"several definitions ({described})"
    return "unresolved", f"whose module is `{described}` (not a recognised norm)"


def _is_norm_call(node: ast.Call) -> bool:
    func = node.func
    if isinstance(func, ast.Subscript) and isinstance(func.slice, ast.Constant) and isinstance(func.slice.value, str):
        name = func.slice.value.lower()
        return "norm" in name or name in {"ln", "ln_f"}
    name = call_name(node).lower()
    return "norm" in name or bool(set(tokens(name)) & {"ln", "rms", "layernorm"})


# --- KV injection -------------------------------------------------------------------------------------


def _is_context(an: Analyzer, node: ast.AST, depth: int = 0) -> bool:
    names = [leaf_name(n) for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))]
    if any(set(tokens(n)) & CONTEXT_TOKENS for n in names):
        return True
    # a local name says nothing: what it was computed from does (`v_c = self.v_proj(ctx)`)
    if isinstance(node, ast.Name) and depth < 3:
        reached = reaching_definitions(an, node)
        if reached and len(reached[0]) == 1 and not reached[1]:
            return _is_context(an, reached[0][0], depth + 1)
    return False


@detector("dflash.kv_injection")
def detect_kv_injection(an: Analyzer) -> list[CodeReading]:
    readings = []
    by_function: dict[int, list[tuple[ast.AST, tuple[str | None, str | None]]]] = {}
    for node in nodes_of(an, ast.Call):
        if call_name(node) not in {"cat", "concat", "concatenate"} or not node.args:
            continue
        seq = node.args[0]
        if not isinstance(seq, (ast.List, ast.Tuple)) or len(seq.elts) != 2:
            continue
        first, second = seq.elts
        sources = (_traced_projection_source(an, first), _traced_projection_source(an, second))
        if None not in sources and sources[0] == sources[1] and _function_has_context(an, node):
            # both halves projected from one input: the "context" K/V are the block's own (no context at all)
            readings.append(reading_at(an, "dflash.kv_injection", "context K/V from the block's own states", node, 0.85,
                                       detail=f"both halves of the concatenation project `{sources[0]}`: the context part "
                                       "does not come from the target features"))
            continue
        a_ctx, b_ctx = _is_context(an, first), _is_context(an, second)
        if a_ctx == b_ctx and not a_ctx:
            # names say nothing (c, x): the block is the source the queries are projected from
            a_blk, b_blk = (_projection_source(an, e) in _query_sources(an, node) for e in (first, second))
            if a_blk != b_blk and _projection_source(an, first) is not None and _projection_source(an, second) is not None:
                a_ctx, b_ctx = b_blk, a_blk
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
                ) or any(  # einsum("...", src, W_k) / src @ W_k: a K/V weight applied to the concatenation
                    _weight_projection_source(c) is not None and isinstance(_weight_projection_source(c), ast.Name)
                    and _weight_projection_source(c).id == var
                    for c in ast.walk(func)
                )
        if isinstance(parent, ast.Call) and _is_kv_projection_name(call_name(parent)):
            feeds_projection = True
        if not (projected or feeds_projection):
            continue
        value = "context K/V first" if a_ctx else "block K/V first"
        readings.append(reading_at(an, "dflash.kv_injection", value, node, 0.75,
                                 detail="every layer projects the context with its own K/V projections, "
                                 + ("context before the block" if a_ctx else "block before the context")))
        if projected:
            kinds = (_projection_kind(an, first), _projection_kind(an, second))
            by_function.setdefault(id(an.enclosing_function(node)), []).append((node, kinds))
            if None not in kinds and kinds[0] != kinds[1]:
                ctx_kind, blk_kind = kinds if a_ctx else kinds[::-1]
                readings.append(reading_at(an, "dflash.kv_injection", f"context {ctx_kind} with the block's {blk_kind} projection",
                                           node, 0.85, detail=f"one concatenation joins a {kinds[0]} projection with a "
                                           f"{kinds[1]} projection: context and block must go through the same projection"))
    # the K concatenation and the V concatenation of one attention: one must be keys, the other values
    for group in by_function.values():
        kinds_seen = [k for _node, k in group if None not in k and k[0] == k[1]]
        if len(kinds_seen) >= 2 and len({k[0] for k in kinds_seen}) == 1:
            node = group[-1][0]
            readings.append(reading_at(an, "dflash.kv_injection", f"K and V both through the {kinds_seen[0][0]} projection",
                                       node, 0.85, detail="the keys and the values are both built with the same projection"))
    # input injection: the fused context is added to the block's hidden states instead of serving as K/V
    if not readings:
        for node in nodes_of(an, ast.BinOp):
            if not isinstance(node.op, ast.Add):
                continue
            if _is_context(an, node.left) != _is_context(an, node.right) and in_draft_class(an, node):
                side = node.left if _is_context(an, node.left) else node.right
                if any(isinstance(c, ast.Call) and (c.func is not None and leaf_name(c.func) in {"fc", "proj", "context_proj", "feature_fusion"}) for c in ast.walk(side)) or "fused" in ast.unparse(side).lower():
                    readings.append(reading_at(an, "dflash.kv_injection", "added to hidden states", node, 0.55,
                                             detail="the fused context is added to the block's hidden states, not injected as K/V"))
    return readings


def _function_has_context(an: Analyzer, node: ast.AST) -> bool:
    """The function around `node` takes or reads the drafter's context (target features) somewhere."""
    func = an.enclosing_function(node)
    if func is None:
        return False
    return any(set(tokens(n.arg if isinstance(n, ast.arg) else n.id)) & CONTEXT_TOKENS
               for n in ast.walk(func) if isinstance(n, (ast.arg, ast.Name)))


def _traced_projection_source(an: Analyzer, node: ast.AST, depth: int = 0) -> str | None:
    """The input text X of the projection that produced `node` (through local names), or None."""
    direct = _projection_source(an, node)
    if direct is not None:
        return direct
    if isinstance(node, ast.Name) and depth < 3:
        reached = reaching_definitions(an, node)
        if reached and len(reached[0]) == 1 and not reached[1]:
            return _traced_projection_source(an, reached[0][0], depth + 1)
    return None


def _projection_kind(an: Analyzer, node: ast.AST, depth: int = 0) -> str | None:
    """'key' or 'value': which projection produced `node` (k_proj(x) / x @ W_v), through shape-preserving
    methods and single local assignments; None when that is not read (a fused kv_proj, an opaque call)."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and call_name(node) in PRESERVING_METHODS \
            and not _is_kv_projection_name(call_name(node)):
        node = node.func.value
    name = None
    if isinstance(node, ast.Call) and _is_kv_projection_name(call_name(node)):
        name = call_name(node)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult) and _kv_weight(node.right):
        right = node.right
        name = right.slice.value if isinstance(right, ast.Subscript) else leaf_name(right)
    elif isinstance(node, ast.Call) and _weight_projection_source(node) is not None:
        weight = [a for a in node.args if not (isinstance(a, ast.Constant) and isinstance(a.value, str))][1]
        name = weight.slice.value if isinstance(weight, ast.Subscript) else leaf_name(weight)
    elif isinstance(node, ast.Name) and depth < 3:
        found = an.defs_of(node)
        if found and len(found[0]) == 1:
            return _projection_kind(an, found[0][0], depth + 1)
        return None
    if not isinstance(name, str):
        return None
    toks = set(tokens(name)) | {name.lower()}
    is_key = bool(toks & {"k", "key", "wk", "to_k", "k_proj", "key_proj", "k_weight"}) or name.lower().endswith("k_proj")
    is_value = bool(toks & {"v", "value", "wv", "to_v", "v_proj", "value_proj", "v_weight"}) or name.lower().endswith("v_proj")
    if is_key == is_value:
        return None
    return "key" if is_key else "value"


def _is_kv_projection_name(name: str) -> bool:
    lower = name.lower()
    return bool(re.fullmatch(r"(k|v|key|value|wk|wv|to_k|to_v|k_proj|v_proj|kv_proj|key_proj|value_proj|c_attn|kv)", lower)) or lower.endswith(("k_proj", "v_proj", "kv_proj"))


def _kv_weight(node: ast.AST) -> bool:
    """A K/V weight: self.wk, layer["wv"], params.k_weight."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        name = node.slice.value
    elif isinstance(node, (ast.Name, ast.Attribute)):
        name = leaf_name(node)
    else:
        return False
    return _is_kv_projection_name(name) or bool(re.fullmatch(r"(w_?[kv]|[kv]_?(weight|w|kernel)|(key|value)_(weight|kernel))", name.lower()))


def _weight_projection_source(node: ast.AST) -> ast.expr | None:
    """X of `X @ W_k` / `matmul(X, W_k)` / `einsum(eq, X, W_k)`."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult) and _kv_weight(node.right):
        return node.left
    if isinstance(node, ast.Call) and call_name(node) in {"einsum", "matmul", "dot", "tensordot"}:
        args = [a for a in node.args if not (isinstance(a, ast.Constant) and isinstance(a.value, str))]
        if len(args) == 2 and _kv_weight(args[1]):
            return args[0]
    return None


def _projection_source(an: Analyzer, node: ast.AST) -> str | None:
    """The source text X of a K/V projection k_proj(X) / X @ W_k (through shape-preserving methods)."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and call_name(node) in PRESERVING_METHODS \
            and not _is_kv_projection_name(call_name(node)):
        node = node.func.value
    if isinstance(node, ast.Call) and _is_kv_projection_name(call_name(node)) and node.args:
        return ast.unparse(node.args[0])
    source = _weight_projection_source(node)
    return ast.unparse(source) if source is not None else None


def _query_sources(an: Analyzer, node: ast.AST) -> set[str]:
    """Texts X of the query projections q_proj(X) / X @ W_q in the function around `node`."""
    func = an.enclosing_function(node)
    out: set[str] = set()
    if func is None:
        return out
    q_name = re.compile(r"(q|query|wq|w_q|to_q|q_proj|query_proj|q_weight)", re.I)
    for c in ast.walk(func):
        if isinstance(c, ast.Call) and c.args and q_name.fullmatch(call_name(c)):
            out.add(ast.unparse(c.args[0]))
        elif isinstance(c, ast.BinOp) and isinstance(c.op, ast.MatMult):
            right = c.right
            key = right.slice.value if isinstance(right, ast.Subscript) and isinstance(right.slice, ast.Constant) else leaf_name(right)
            if isinstance(key, str) and q_name.fullmatch(key):
                out.add(ast.unparse(c.left))
    return out


def _projection_of(an: Analyzer, node: ast.AST, depth: int = 0) -> bool:
    if _weight_projection_source(node) is not None:
        return True
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
