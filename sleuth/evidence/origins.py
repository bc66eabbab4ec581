"""Value origins: follow an expression back to where its value comes from, never trusting its name.

`trace(an, expr)` walks back through assignments, `self.x` attributes, subscripts and tensor methods that
keep a value's meaning (`.float()`, `.to()`, slicing a batch), norm calls, local function calls (into their
returns, with the call's arguments bound to the parameters: an offset on an argument is not lost), and a
function's parameters (to the arguments at its call sites). It stops at a source it can name:

    layer          `<model output>.hidden_states[INDEX]`: one entry of the per-layer tuple
    last_hidden    `<model output>.last_hidden_state`
    unresolved     anything else; `missing` says what was not found (a parameter with no call site, a call
                   into code that is not in the tree, a tuple unpacked from an opaque call)

Names never decide an origin; a detector may use them to rank candidates or explain an `unknown`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from sleuth.evidence.ast_index import PRESERVING_METHODS, Analyzer, call_name, is_module_name, kwarg, leaf_name, tokens

MAX_DEPTH = 12
LAYER_TUPLES = {"hidden_states", "all_hidden_states"}


@dataclass
class Origin:
    kind: str  # layer | last_hidden | unresolved
    node: ast.AST  # the source expression (the subscript, the attribute) or where the trail ended
    index: ast.expr | None = None  # for `layer`: the index into the per-layer tuple
    bindings: dict[str, ast.expr] = field(default_factory=dict)  # parameters bound on the way in
    missing: str = ""
    steps: int = 0


def call_site_arguments(an: Analyzer, func: ast.AST | None, param: str) -> list[ast.expr]:
    """The arguments passed for `param` where `func` is called (the class name for `__init__`)."""
    return an.call_site_arguments(func, param)


def keyed_values(an: Analyzer, key: str) -> list[ast.expr]:
    """Every value the analysed code stores under a string key: `{"key": v}` literals, `d["key"] = v`,
    `dict(key=v)` (across files: a feature dump written by one script and read by another)."""
    index = an.memo("keyed-values", lambda: _index_keyed_values(an))
    return index.get(key, [])


def _index_keyed_values(an: Analyzer) -> dict[str, list[ast.expr]]:
    index: dict[str, list[ast.expr]] = {}
    for node in an.by_type.get(ast.Dict, []):
        for k, v in zip(node.keys, node.values):
            if isinstance(k, ast.Constant) and isinstance(k.value, str):
                index.setdefault(k.value, []).append(v)
    for node in an.by_type.get(ast.Assign, []):
        for target in node.targets:
            if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str):
                index.setdefault(target.slice.value, []).append(node.value)
    for node in an.by_type.get(ast.Call, []):
        if isinstance(node.func, ast.Name) and node.func.id == "dict":
            for kw in node.keywords:
                if kw.arg:
                    index.setdefault(kw.arg, []).append(kw.value)
    return index


def is_norm_call(node: ast.Call) -> bool:
    return bool(set(tokens(call_name(node))) & {"norm", "rmsnorm", "layernorm", "ln"})


def trace(an: Analyzer, node: ast.AST, bindings: dict[str, ast.expr] | None = None, depth: int = 0) -> list[Origin]:
    """Every origin `node`'s value can come from (several when a name has several definitions)."""
    bindings = bindings or {}
    if depth > MAX_DEPTH:
        return [Origin("unresolved", node, missing="the trail is too long to follow", steps=depth)]
    if isinstance(node, ast.Attribute):
        if node.attr == "last_hidden_state":
            return [Origin("last_hidden", node, steps=depth)]
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            return _through_definitions(an, node, bindings, depth)
        return [Origin("unresolved", node, missing=f"`{ast.unparse(node)[:60]}` is an attribute of an opaque value", steps=depth)]
    if isinstance(node, ast.Subscript):
        if _is_layer_tuple(an, node.value, bindings, depth):
            return [Origin("layer", node, node.slice, dict(bindings), steps=depth)]
        if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            # a value stored under a key (a dumped shard, a batch dict): what the code stores under that key
            stored = keyed_values(an, node.slice.value)
            if stored:
                out: list[Origin] = []
                for value in stored[:3]:
                    out += trace(an, value, {}, depth + 1)
                return out
        return trace(an, node.value, bindings, depth + 1)  # slicing a tensor keeps what it is
    if isinstance(node, ast.Call):
        name = call_name(node)
        if isinstance(node.func, ast.Attribute) and name in PRESERVING_METHODS and not is_module_name(node.func.value):
            return trace(an, node.func.value, bindings, depth + 1)
        if is_norm_call(node) and node.args:
            return trace(an, node.args[0], bindings, depth + 1)
        return _through_call(an, node, bindings, depth)
    if isinstance(node, ast.Name):
        if node.id in bindings:
            return trace(an, bindings[node.id], {}, depth + 1)
        return _through_definitions(an, node, bindings, depth)
    if isinstance(node, ast.IfExp):
        return trace(an, node.body, bindings, depth + 1) + trace(an, node.orelse, bindings, depth + 1)
    return [Origin("unresolved", node, missing=f"`{ast.unparse(node)[:60]}` is computed, not taken from a layer", steps=depth)]


def _through_definitions(an: Analyzer, node: ast.expr, bindings: dict[str, ast.expr], depth: int) -> list[Origin]:
    found = an.defs_of(node)
    if found is None:
        return [Origin("unresolved", node, missing=f"`{ast.unparse(node)}` is not defined in the analysed code", steps=depth)]
    definitions, scope = found
    if definitions:
        out: list[Origin] = []
        for definition in definitions[-3:]:
            out += trace(an, definition, bindings, depth + 1)
        return out
    # a parameter: what its callers pass
    name = ast.unparse(node)
    args = call_site_arguments(an, scope.node, name) if isinstance(node, ast.Name) else []
    if not args:
        default = scope.params.get(name) if isinstance(node, ast.Name) else None
        if default is not None:
            return trace(an, default, {}, depth + 1)
        return [Origin("unresolved", node, missing=f"parameter `{name}` has no call site in the analysed code", steps=depth)]
    out = []
    for arg in args[:3]:
        out += trace(an, arg, {}, depth + 1)
    return out


def _through_call(an: Analyzer, node: ast.Call, bindings: dict[str, ast.expr], depth: int) -> list[Origin]:
    name = call_name(node)
    functions = an.functions.get(name, [])
    if not functions:
        return [Origin("unresolved", node, missing=f"`{name}(...)` is not a function of the analysed code", steps=depth)]
    func, _scope = functions[0]
    params = [a.arg for a in func.args.posonlyargs + func.args.args]
    if params and params[0] in {"self", "cls"} and isinstance(node.func, ast.Attribute):
        params = params[1:]
    inner = {p: a for p, a in zip(params, node.args) if not isinstance(a, ast.Starred)}
    inner.update({kw.arg: kw.value for kw in node.keywords if kw.arg})
    # the caller's own bindings stay visible through arguments that name them
    inner = {p: _substitute(a, bindings) for p, a in inner.items()}
    returns = [s.value for s in ast.walk(func) if isinstance(s, ast.Return) and s.value is not None
               and an.enclosing_function(s) is func]
    if not returns:
        return [Origin("unresolved", node, missing=f"`{name}` returns nothing traceable", steps=depth)]
    out: list[Origin] = []
    for value in returns[:3]:
        out += trace(an, value, inner, depth + 1)
    return out


def _substitute(node: ast.expr, bindings: dict[str, ast.expr]) -> ast.expr:
    if isinstance(node, ast.Name) and node.id in bindings:
        return bindings[node.id]
    return node


def is_layer_tuple(an: Analyzer, node: ast.AST) -> bool:
    """Whether `node` holds a model's per-layer hidden states (`out.hidden_states`, or a name / parameter
    whose value is one)."""
    return _is_layer_tuple(an, node, {}, 0)


def produced_by(an: Analyzer, node: ast.AST, functions: set[str], depth: int = 0) -> bool:
    """Whether the value of `node` is the result of calling one of `functions` (through names, `self.x`,
    parameters and their call sites)."""
    if depth > MAX_DEPTH:
        return False
    if isinstance(node, ast.Call):
        return call_name(node) in functions or (
            isinstance(node.func, ast.Name) and node.func.id in {"list", "tuple", "sorted"} and bool(node.args)
            and produced_by(an, node.args[0], functions, depth + 1))
    if isinstance(node, (ast.Name, ast.Attribute)):
        found = an.defs_of(node)
        if found and found[0]:
            return any(produced_by(an, d, functions, depth + 1) for d in found[0][-3:])
        if found and isinstance(node, ast.Name):
            args = an.parameter_arguments(node)
            return bool(args) and all(produced_by(an, a, functions, depth + 1) for a in args[:3])
    return False


def _is_layer_tuple(an: Analyzer, node: ast.AST, bindings: dict[str, ast.expr], depth: int) -> bool:
    """`out.hidden_states`, or a name / parameter whose value is one."""
    if isinstance(node, ast.Attribute) and node.attr in LAYER_TUPLES:
        return True
    if depth > MAX_DEPTH:
        return False
    if isinstance(node, ast.Name):
        if node.id in bindings:
            return _is_layer_tuple(an, bindings[node.id], {}, depth + 1)
        found = an.defs_of(node)
        if found and found[0]:
            return any(_is_layer_tuple(an, d, bindings, depth + 1) for d in found[0][-3:])
        if found and not found[0]:  # a parameter: what its callers pass
            args = an.parameter_arguments(node)
            return bool(args) and all(_is_layer_tuple(an, a, {}, depth + 1) for a in args[:3])
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        found = an.defs_of(node)
        return bool(found and found[0] and any(_is_layer_tuple(an, d, bindings, depth + 1) for d in found[0][-3:]))
    return False


def head_input(node: ast.Call) -> ast.expr | None:
    """The hidden states a head call projects: `lm_head(x)`, `model.lm_head(x)`, `get_output_embeddings()(x)`."""
    if not node.args:
        return None
    callee = node.func
    if isinstance(callee, ast.Call) and call_name(callee) == "get_output_embeddings":
        return node.args[0]
    name = leaf_name(callee)
    if set(tokens(name)) & {"head", "unembed"} or name in {"lm_head", "output_layer", "embed_out"}:
        return node.args[0]
    return None


# --- what a called module is (i11-attn) --------------------------------------------------------------------

NOOP_MODULES = {"Identity", "identity", "Dropout", "Sequential"}


def module_definitions(an: Analyzer, callee: ast.expr) -> list[ast.expr] | None:
    """What a called module attribute / name is bound to in the analysed code (`self.hidden_norm = X`):
    the bound expressions, or None when the callee has no definition here (a parameter with no call site,
    an attribute of an opaque object, a library function)."""
    if not isinstance(callee, (ast.Name, ast.Attribute)):
        return None
    found = an.defs_of(callee)
    if not found or not found[0]:
        return None
    return list(found[0])


def is_noop_module(node: ast.expr) -> bool:
    """`nn.Identity()`, `nn.Dropout(...)` (no normalisation), `nn.Sequential()` with nothing in it, `lambda x: x`:
    a module that passes its input through unchanged (for what a norm or projection must do)."""
    if isinstance(node, ast.Lambda):
        params = [a.arg for a in node.args.args]
        return len(params) >= 1 and isinstance(node.body, ast.Name) and node.body.id == params[0]
    if isinstance(node, ast.Call):
        name = call_name(node)
        if name == "Sequential":
            return not node.args
        return name in NOOP_MODULES
    return False
