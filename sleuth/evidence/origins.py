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

from sleuth.evidence.ast_index import (
    MISSING,
    PRESERVING_METHODS,
    Analyzer,
    call_name,
    in_variant_code,
    is_module_name,
    leaf_name,
    tokens,
)

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


# --- constant offsets along an anchor's path (i11-attn) ---------------------------------------------------

# Calls that keep an index's value (a layout change, a copy, a repeat per slot): the offset passes through.
_OFFSET_KEEPING_FUNCS = {"repeat_interleave", "expand", "expand_as", "broadcast_to", "clamp", "clip", "tensor",
                         "as_tensor", "asarray", "array", "LongTensor", "stack", "cat", "concat", "concatenate"}


@dataclass
class Leg:
    """One way a value reaches a site from its source: the constant added on the way, where the path was
    cut short (`missing`), the runtime condition it depends on, and the call site / definition it came
    through (for the report: that is where an offset enters)."""
    offset: int = 0
    missing: str = ""
    switch: str | None = None
    through: ast.AST | None = None
    lookup: str | None = None  # the value is another tensor read AT the anchor (`position_ids[0, anchor]`)
    source: ast.AST | None = None
    entered: ast.AST | None = None  # the expression that adds a nonzero constant on the way

    @property
    def complete(self) -> bool:
        return not self.missing


def anchor_legs(an: Analyzer, node: ast.AST) -> list[Leg]:
    """Every path by which an anchor-derived expression gets its value, with the constant offset it adds to
    the anchor: back through assignments (the one that reaches this use, so `a = a.long()` is not a loop),
    element reads of the anchor array, copies and repeats, local calls (into their returns, arguments bound),
    and parameters (to EVERY call site's argument: an offset a caller adds counts). A leg whose trail is cut
    (a call site that does not pass the parameter, an attribute nobody assigns, a too-long trail) says what
    is missing; a leg that ends at a sampled anchor tensor, a parameter of an entry point, or a loop over
    anchors is complete. Names never decide an offset: `q_anchor = anchors + 1` is the anchor plus one."""
    return _legs(an, node, {}, 0, frozenset())


def _shift(legs: list[Leg], by: int, at: ast.AST | None = None) -> list[Leg]:
    for leg in legs:
        leg.offset += by
        if by and leg.entered is None:
            leg.entered = at
    return legs


def _legs(an: Analyzer, node: ast.AST, bindings: dict[str, ast.expr], depth: int, seen: frozenset) -> list[Leg]:
    if depth > MAX_DEPTH * 2 or id(node) in seen:
        return [Leg(missing=f"the trail of `{ast.unparse(node)[:40]}` is too long or circular", source=node)]
    seen = seen | {id(node)}
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        sign = 1 if isinstance(node.op, ast.Add) else -1
        right, left = _int_const(node.right), _int_const(node.left)
        if right is not None:
            return _shift(_legs(an, node.left, bindings, depth + 1, seen), sign * right, node)
        if left is not None and sign == 1:
            return _shift(_legs(an, node.right, bindings, depth + 1, seen), left, node)
        lt, rt = an.tags(node.left), an.tags(node.right)
        anchor_side, other = (node.left, node.right) if "anchor" in lt or "anchor" not in rt else (node.right, node.left)
        legs = _legs(an, anchor_side, bindings, depth + 1, seen)
        for leg in legs:
            leg.switch = leg.switch or ast.unparse(other)
        return legs
    if isinstance(node, ast.Subscript):
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if "anchor" in an.tags(node.value) or not any("anchor" in an.tags(p) for p in parts if not isinstance(p, ast.Slice)):
            return _legs(an, node.value, bindings, depth + 1, seen)  # an element (or a slice) of the anchor array
        # another tensor read at the anchor (`position_ids[0, anchor]`): its value at the anchor's index
        part = next(p for p in parts if not isinstance(p, ast.Slice) and "anchor" in an.tags(p))
        legs = _legs(an, part, bindings, depth + 1, seen)
        for leg in legs:
            leg.lookup = leg.lookup or ast.unparse(node.value)
        return legs
    if isinstance(node, ast.Call):
        name = call_name(node)
        gathered = _gather_parts(node)
        if gathered is not None and "anchor" in an.tags(gathered[1]) and "anchor" not in an.tags(gathered[0]):
            # another tensor read at the anchors (`pos.gather(1, anchors)`, `take_along_dim(pos, anchors)`)
            legs = _legs(an, gathered[1], bindings, depth + 1, seen)
            for leg in legs:
                leg.lookup = leg.lookup or ast.unparse(gathered[0])
            return legs
        if isinstance(node.func, ast.Attribute) and (name in PRESERVING_METHODS or name in _OFFSET_KEEPING_FUNCS) \
                and not is_module_name(node.func.value) and not (isinstance(node.func.value, ast.Attribute) and is_module_name(node.func.value.value)):
            return _legs(an, node.func.value, bindings, depth + 1, seen)
        if name in {"add", "sub", "subtract"} and len(node.args) == 2 and _int_const(node.args[1]) is not None:
            sign = 1 if name == "add" else -1
            return _shift(_legs(an, node.args[0], bindings, depth + 1, seen), sign * _int_const(node.args[1]), node)
        if name in _OFFSET_KEEPING_FUNCS and node.args:
            first = node.args[0]
            if isinstance(first, (ast.List, ast.Tuple)) and len(first.elts) == 1:
                first = first.elts[0]
            return _legs(an, first, bindings, depth + 1, seen)
        functions = an.functions.get(name, [])
        if functions and _local_callee(node):
            return _through_local_call(an, node, functions[0][0], bindings, depth, seen)
        return [Leg(source=node)]  # sampled / computed here (randperm, nonzero, a library call): the source
    if isinstance(node, ast.Name):
        return _name_legs(an, node, bindings, depth, seen)
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            found = an.defs_of(node)
            if not found or not found[0]:
                return [Leg(missing=f"`{ast.unparse(node)}` is not assigned in the analysed code", source=node)]
            out: list[Leg] = []
            for definition in found[0][-3:]:
                out += _legs(an, definition, {}, depth + 1, seen)
            return out
        return [Leg(source=node)]  # a field of an input (batch.anchors): the boundary of the code
    if isinstance(node, ast.IfExp):
        label = ast.unparse(node.test)
        legs = _legs(an, node.body, bindings, depth + 1, seen) + _legs(an, node.orelse, bindings, depth + 1, seen)
        for leg in legs:
            leg.switch = leg.switch or label
        return legs
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd):
        return _legs(an, node.operand, bindings, depth + 1, seen)
    if isinstance(node, (ast.List, ast.Tuple)):
        elements = node.elts or _appended(an, node)
        out = []
        for element in elements[:4]:
            out += _legs(an, element, bindings, depth + 1, seen)
        return out or [Leg(source=node)]
    if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
        return [leg if leg.complete else Leg(source=node) for leg in _legs(an, node.elt, bindings, depth + 1, seen)]
    # built here in some other way (a product, a comprehension over rows): where the anchors come from
    return [Leg(source=node)]


def _appended(an: Analyzer, node: ast.expr) -> list[ast.expr]:
    """The values appended to a list built empty (`anchors = []; anchors.append(p)`), in the same function."""
    parent = an.parents.get(node)
    if not (isinstance(parent, ast.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0], ast.Name)):
        return []
    name, func = parent.targets[0].id, an.enclosing_function(node)
    return [call.args[0] for call in an.calls_named("append")
            if isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) and call.func.value.id == name
            and call.args and an.enclosing_function(call) is func]


def _gather_parts(node: ast.Call) -> tuple[ast.expr, ast.expr] | None:
    """(source tensor, index) of a gather-like read: x.gather(d, i), torch.gather(x, d, i), x.index_select(d, i),
    take_along_dim(x, i[, d]), x.take(i)."""
    name = call_name(node)
    method = isinstance(node.func, ast.Attribute) and not is_module_name(node.func.value)
    if name in {"gather", "index_select"}:
        if method and len(node.args) >= 2:
            return node.func.value, node.args[1]
        if not method and len(node.args) >= 3:
            return node.args[0], node.args[2]
    if name in {"take_along_dim", "take_along_axis"} and len(node.args) >= 2 and not method:
        return node.args[0], node.args[1]
    if name == "take" and method and node.args:
        return node.func.value, node.args[0]
    return None


def _local_callee(node: ast.Call) -> bool:
    """`helper(...)` or `self.helper(...)`: a call that resolves to a function of the analysed code by name
    (`match.start()` on some object does not)."""
    func = node.func
    return isinstance(func, ast.Name) or (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                                          and func.value.id in {"self", "cls"})


def block_legs(an: Analyzer, node: ast.AST, bindings: dict[str, ast.expr] | None = None, depth: int = 0) -> list[tuple[Leg, int]]:
    """For a block index `anchor + arange(B)` (built here, in a helper, through names): each path of the anchor
    (its `Leg`, offsets and lookups included) with the arange's start. Arguments are bound into helpers, so
    `helper(pos[0, anchors] + 1, B)` whose body is `start[:, None] + arange(B)` is the anchor's position + 1 + j."""
    bindings = bindings or {}
    if depth > MAX_DEPTH:
        return []
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        right = _int_const(node.right)
        if right is not None:
            sign = 1 if isinstance(node.op, ast.Add) else -1
            return [(leg, start + sign * right) for leg, start in block_legs(an, node.left, bindings, depth + 1)]
        if isinstance(node.op, ast.Add):
            for range_side, anchor_side in ((node.right, node.left), (node.left, node.right)):
                start = an.arange_start(range_side)
                if start is not None and "arange" in an.tags(range_side) and "arange" not in an.tags(anchor_side):
                    return [(leg, start) for leg in _legs(an, anchor_side, bindings, depth + 1, frozenset())]
        return []
    if isinstance(node, ast.Subscript):
        return block_legs(an, node.value, bindings, depth + 1)
    if isinstance(node, ast.Call):
        name = call_name(node)
        if isinstance(node.func, ast.Attribute) and name in PRESERVING_METHODS and not is_module_name(node.func.value):
            return block_legs(an, node.func.value, bindings, depth + 1)
        functions = an.functions.get(name, [])
        if functions and _local_callee(node):
            func = functions[0][0]
            params = [a.arg for a in func.args.posonlyargs + func.args.args]
            if params and params[0] in {"self", "cls"} and isinstance(node.func, ast.Attribute):
                params = params[1:]
            inner = {p: _substitute(a, bindings) for p, a in zip(params, node.args) if not isinstance(a, ast.Starred)}
            inner.update({kw.arg: _substitute(kw.value, bindings) for kw in node.keywords if kw.arg})
            out: list[tuple[Leg, int]] = []
            for ret in [s.value for s in ast.walk(func) if isinstance(s, ast.Return) and s.value is not None
                        and an.enclosing_function(s) is func][:2]:
                out += block_legs(an, ret, inner, depth + 1)
            return out
        return []
    if isinstance(node, ast.Name):
        reached = reaching_definitions(an, node)
        if reached and reached[0]:
            out = []
            for definition in reached[0][-2:]:
                out += block_legs(an, definition, bindings, depth + 1)
            return out
        if node.id in bindings:
            return block_legs(an, bindings[node.id], {}, depth + 1)
    return []


def _int_const(node: ast.AST) -> int | None:
    from sleuth.evidence.ast_index import const_number

    number = const_number(node)
    if number is None or not float(number).is_integer():
        return None
    return int(number)


def _through_local_call(an: Analyzer, node: ast.Call, func: ast.AST, bindings: dict[str, ast.expr], depth: int,
                        seen: frozenset) -> list[Leg]:
    params = [a.arg for a in func.args.posonlyargs + func.args.args]
    if params and params[0] in {"self", "cls"} and isinstance(node.func, ast.Attribute):
        params = params[1:]
    inner = {p: _substitute(a, bindings) for p, a in zip(params, node.args) if not isinstance(a, ast.Starred)}
    inner.update({kw.arg: _substitute(kw.value, bindings) for kw in node.keywords if kw.arg})
    returns = [s.value for s in ast.walk(func) if isinstance(s, ast.Return) and s.value is not None
               and an.enclosing_function(s) is func]
    if not returns:
        return [Leg(missing=f"`{call_name(node)}` returns nothing traceable", source=node)]
    out: list[Leg] = []
    for value in returns[:3]:
        if isinstance(value, ast.Tuple):
            return [Leg(source=node)]  # anchors, valid = helper(...): the tensor the helper samples
        out += _legs(an, value, inner, depth + 1, seen)
    for leg in out:
        leg.through = leg.through or node
    return out


def _contains(an: Analyzer, outer: ast.AST, node: ast.AST) -> bool:
    current: ast.AST | None = node
    while current is not None:
        if current is outer:
            return True
        current = an.parents.get(current)
    return False


def reaching_definitions(an: Analyzer, node: ast.Name) -> tuple[list[ast.expr], bool] | None:
    """(definitions that reach this use, whether the name is also a parameter that may reach it), or None when
    the name is not defined in the analysed code. Flow-aware where the light dataflow is not: a definition
    never reaches a use inside itself (`a = a.long()` reads the previous `a`), and in the same function only
    the last definition above the use reaches it (with the earlier ones when that one is conditional)."""
    found = an.defs_of(node)
    if found is None:
        return None
    definitions, scope = found
    is_param = node.id in scope.params
    candidates = [d for d in definitions if not _contains(an, d, node)]
    use_func = an.enclosing_function(node)
    line = getattr(node, "lineno", 0)
    same = [d for d in candidates if an.enclosing_function(d) is use_func and getattr(d, "lineno", 0)]
    if same and len(same) == len(candidates):
        before = sorted((d for d in same if d.lineno < line), key=lambda d: d.lineno)
        if not before:
            return [], is_param
        reaching = [before[-1]]
        for earlier in reversed(before[:-1]):
            if an.switch_of(reaching[-1]) is None:
                break
            reaching.append(earlier)
        # `if x is None: x = default`: the parameter still reaches the use past a conditional definition
        return reaching, is_param and an.switch_of(reaching[-1]) is not None
    return candidates, is_param and not candidates


def _name_legs(an: Analyzer, node: ast.Name, bindings: dict[str, ast.expr], depth: int, seen: frozenset) -> list[Leg]:
    reached = reaching_definitions(an, node)
    if reached is None:
        if node.id in bindings:
            return _legs(an, bindings[node.id], {}, depth + 1, seen)
        return [Leg(source=node)]  # a module-level input or an import: the boundary of the code
    definitions, is_param = reached
    if definitions:
        out: list[Leg] = []
        several = len(definitions) > 1 or is_param
        for definition in definitions[-3:]:
            # a reassignment in the same call (`a = a.long()`) still reads the arguments this call was given
            legs = _legs(an, definition, bindings, depth + 1, seen)
            if several:
                label = an.switch_of(definition)
                for leg in legs:
                    leg.switch = leg.switch or label
            out += legs
        if not is_param:
            return out
        return out + _param_legs(an, node, bindings, depth, seen)
    return _param_legs(an, node, bindings, depth, seen)


def _param_legs(an: Analyzer, node: ast.Name, bindings: dict[str, ast.expr], depth: int, seen: frozenset) -> list[Leg]:
    reached = reaching_definitions(an, node)
    is_param = bool(reached and reached[1])
    if node.id in bindings:
        return _legs(an, bindings[node.id], {}, depth + 1, seen)
    found = an.defs_of(node)
    scope = found[1] if found else None
    if not is_param or scope is None:
        return [Leg(source=node)]  # unpacked from a call (anchors, valid = sample(...)): the sampled tensor
    func = scope.node
    callee_calls = _calls_of(an, func)
    if not callee_calls:
        return [Leg(source=node)]  # an entry point's parameter: what the code is given
    args = an.call_site_arguments(func, node.id)
    out = []
    for arg in args:
        legs = _legs(an, arg, {}, depth + 1, seen)
        for leg in legs:
            leg.through = leg.through or arg
        out += legs
    if len(args) < len(callee_calls):
        default = scope.params.get(node.id)
        if default is not None:
            out += _legs(an, default, {}, depth + 1, seen)
        else:
            out.append(Leg(missing=f"`{getattr(func, 'name', '?')}` is called without `{node.id}` at some call site "
                                   "(passed through **kwargs or positionally past a *args)", source=node))
    return out


def _calls_of(an: Analyzer, func: ast.AST | None) -> list[ast.Call]:
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    callee = func.name
    if callee == "__init__":
        cls = an.parents.get(func)
        callee = cls.name if isinstance(cls, ast.ClassDef) else ""
    return an.calls_named(callee)


# --- where a value goes (forward) ------------------------------------------------------------------------------

# Library calls that compute a loss from what they are given.
LOSS_FUNCTIONS = {"cross_entropy", "nll_loss", "kl_div", "binary_cross_entropy", "binary_cross_entropy_with_logits",
                  "mse_loss", "smooth_l1_loss", "l1_loss", "huber_loss", "log_softmax", "CrossEntropyLoss", "KLDivLoss"}
# Calls that pass a value on unchanged in meaning (layout, dtype, joining).
_CARRIERS = {"cat", "stack", "concat", "concatenate", "flatten", "view", "reshape", "to", "float", "long", "int",
             "double", "half", "cpu", "cuda", "contiguous", "clone", "detach", "unsqueeze", "squeeze", "expand",
             "expand_as", "repeat", "clamp", "clamp_", "clamp_min", "clip", "permute", "transpose", "where",
             "masked_fill", "type_as", "view_as", "reshape_as", "broadcast_to", "flip", "roll"}


def value_uses(an: Analyzer, node: ast.AST) -> set[str]:
    """What the value of an expression is used for, followed forward through assignments, arithmetic, layout
    calls, local calls (into the parameter's uses in the callee) and returns (to the callers):
        'loss'     it reaches a loss computation (a library loss call, or a local function computing one)
        'compare'  it is compared (`==`, `<`): a metric or a mask, not a value the loss trains toward
        'index'    it indexes another tensor (a gather at those positions)
        'call:NAME' it is handed to a function outside the analysed code
    Empty when nothing uses it where the analysis can see."""
    return _uses(an, node, 0, frozenset())


def _uses(an: Analyzer, node: ast.AST, depth: int, seen: frozenset) -> set[str]:
    if depth > 8 or id(node) in seen:
        return set()
    seen = seen | {id(node)}
    parent = an.parents.get(node)
    if parent is None or isinstance(parent, (ast.Expr,)):
        return set()
    if isinstance(parent, ast.keyword):
        call = an.parents.get(parent)
        return _into_call(an, call, parent.arg, None, depth, seen) if isinstance(call, ast.Call) and parent.arg else set()
    if isinstance(parent, ast.Call):
        if parent.func is node:
            return set()
        if isinstance(parent.func, ast.Attribute) and parent.func.value is node:
            return _uses(an, parent, depth + 1, seen)
        position = parent.args.index(node) if node in parent.args else None
        return _into_call(an, parent, None, position, depth, seen)
    if isinstance(parent, ast.Attribute):
        grand = an.parents.get(parent)
        if isinstance(grand, ast.Call) and grand.func is parent:
            name = parent.attr
            if name in LOSS_FUNCTIONS:
                return {"loss"}
            return _uses(an, grand, depth + 1, seen) if name in _CARRIERS or name in PRESERVING_METHODS \
                else {f"call:{name}"}
        return _uses(an, parent, depth + 1, seen)
    if isinstance(parent, (ast.List, ast.Tuple, ast.Starred, ast.BinOp, ast.UnaryOp, ast.IfExp, ast.BoolOp)):
        return _uses(an, parent, depth + 1, seen)
    if isinstance(parent, ast.Subscript):
        if parent.value is node:
            return _uses(an, parent, depth + 1, seen)
        return {"index"}
    if isinstance(parent, ast.Compare):
        return {"compare"}
    if isinstance(parent, ast.Return):
        func = an.enclosing_function(parent)
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return set()
        out: set[str] = set()
        for call in an.calls_named(func.name):
            out |= _uses(an, call, depth + 1, seen)
        return out
    if isinstance(parent, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        names = {ast.unparse(t) for t in targets if isinstance(t, (ast.Name, ast.Attribute))}
        func = an.enclosing_function(parent)
        out = set()
        for use in ast.walk(func if func is not None else an.unit(parent).tree):
            if isinstance(use, (ast.Name, ast.Attribute)) and isinstance(getattr(use, "ctx", None), ast.Load) \
                    and ast.unparse(use) in names and getattr(use, "lineno", 0) > parent.lineno:
                out |= _uses(an, use, depth + 1, seen)
        return out
    return set()


def _into_call(an: Analyzer, call: ast.Call, keyword: str | None, position: int | None, depth: int,
               seen: frozenset) -> set[str]:
    name = call_name(call)
    if name in LOSS_FUNCTIONS:
        return {"loss"}
    if name in _CARRIERS:
        return _uses(an, call, depth + 1, seen)
    functions = an.functions.get(name, [])
    if not functions or not _local_callee(call):
        return {f"call:{name}"}
    func = functions[0][0]
    params = [a.arg for a in func.args.posonlyargs + func.args.args + func.args.kwonlyargs]
    if params and params[0] in {"self", "cls"} and isinstance(call.func, ast.Attribute):
        params = params[1:]
    param = keyword if keyword in params else (params[position] if position is not None and position < len(params) else None)
    if param is None:
        return {f"call:{name}"}
    out: set[str] = set()
    for use in ast.walk(func):
        if isinstance(use, ast.Name) and use.id == param and isinstance(use.ctx, ast.Load) \
                and an.enclosing_function(use) is func:
            out |= _uses(an, use, depth + 1, seen)
    return out


def call_bindings(an: Analyzer, func: ast.AST, param: str) -> list[tuple[ast.Call, ast.expr | None | object]]:
    """Each DFlash-path call of `func` (also `partial(func, ...)`) with what it passes for `param`: the
    argument, None (omitted: the default applies) or MISSING (unknown: `**kwargs`, `*args`, or a partial
    that leaves it to its own caller)."""
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    positional = [a.arg for a in func.args.posonlyargs + func.args.args]
    callee = func.name
    if callee == "__init__":
        cls = an.parents.get(func)
        callee = cls.name if isinstance(cls, ast.ClassDef) else ""
    if positional and positional[0] in {"self", "cls"}:
        positional = positional[1:]
    index = positional.index(param) if param in positional else None

    def bound(args: list[ast.expr], keywords: list[ast.keyword], omitted: object) -> object:
        for kw in keywords:
            if kw.arg == param:
                return kw.value
        starred = any(isinstance(a, ast.Starred) for a in args) or any(kw.arg is None for kw in keywords)
        if index is not None and index < len(args) and not any(isinstance(a, ast.Starred) for a in args[: index + 1]):
            return args[index]
        return MISSING if starred else omitted

    out: list[tuple[ast.Call, object]] = []
    for call in an.calls_named(callee):
        if in_variant_code(an, call) or an.enclosing_function(call) is func:
            continue
        out.append((call, bound(call.args, call.keywords, None)))
    for call in an.calls_named("partial"):
        if call.args and leaf_name(call.args[0]) == callee and not in_variant_code(an, call):
            out.append((call, bound(call.args[1:], call.keywords, MISSING)))
    return out
