"""The loss: decay gamma, the anchor slot's weight, loss kind, frozen embeddings/head, anchor sampling."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

from sleuth.evidence.ast_index import (
    ANCHOR_TOKENS,
    Analyzer,
    CodeReading,
    LOGITS_TOKENS,
    WEIGHTISH_TOKENS,
    MISSING,
    Mode,
    VARIANT,
    in_draft_class,
    VARIANT_PATTERN,
    in_variant_code,
    in_variant_file,
    is_module_name,
    reading_at,
    nodes_of,
    call_name,
    const_number,
    is_blocksize_name,
    kwarg,
    leaf_name,
    name_tags,
    tokens,
)
from sleuth.evidence.origins import call_bindings, keyed_values
from sleuth.evidence.registry import detector


# --- loss: decay, slot 0, kind -----------------------------------------------------------------------


def _decay_exponentials(an: Analyzer) -> Iterator[tuple[ast.Call, ast.expr, ast.expr]]:
    """exp(-X / G) (or exp(-(X) / G), exp(X / -G)): (call, numerator X, divisor G)."""
    for node in nodes_of(an, ast.Call):
        if call_name(node) != "exp":
            continue
        if node.args:
            arg = node.args[0]
        elif isinstance(node.func, ast.Attribute) and not is_module_name(node.func.value):
            arg = node.func.value  # (-(k - 1) / gamma).exp()
        else:
            continue
        numerator = divisor = None
        if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Div):
            numerator, divisor = arg.left, arg.right
            if isinstance(numerator, ast.UnaryOp) and isinstance(numerator.op, ast.USub):
                numerator = numerator.operand
            elif isinstance(divisor, ast.UnaryOp) and isinstance(divisor.op, ast.USub):
                divisor = divisor.operand
            else:
                continue
        elif isinstance(arg, ast.UnaryOp) and isinstance(arg.op, ast.USub) and isinstance(arg.operand, ast.BinOp) and isinstance(arg.operand.op, ast.Div):
            numerator, divisor = arg.operand.left, arg.operand.right
        if numerator is None or divisor is None:
            continue
        yield node, numerator, divisor


def _inverted_decays(an: Analyzer) -> Iterator[tuple[ast.Call, ast.expr, ast.expr]]:
    """exp(-X * G) over the slot index X: a decay written with a rate, whose gamma is 1/G (call, X, G)."""
    for node in nodes_of(an, ast.Call):
        if call_name(node) != "exp":
            continue
        if node.args:
            arg = node.args[0]
        elif isinstance(node.func, ast.Attribute) and not is_module_name(node.func.value):
            arg = node.func.value
        else:
            continue
        sides: tuple[ast.expr, ast.expr] | None = None
        if isinstance(arg, ast.UnaryOp) and isinstance(arg.op, ast.USub) and isinstance(arg.operand, ast.BinOp) \
                and isinstance(arg.operand.op, ast.Mult):
            sides = (arg.operand.left, arg.operand.right)
        elif isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Mult):
            for negated, other in ((arg.left, arg.right), (arg.right, arg.left)):
                if isinstance(negated, ast.UnaryOp) and isinstance(negated.op, ast.USub):
                    sides = (negated.operand, other)
        if sides is None:
            continue
        for slot, rate in (sides, sides[::-1]):
            # the rate is a setting (a name, an attribute, a constant, cfg["key"]), not another tensor expression
            setting = isinstance(rate, (ast.Name, ast.Attribute, ast.Constant)) or (
                isinstance(rate, ast.Subscript) and isinstance(rate.slice, ast.Constant) and isinstance(rate.slice.value, str))
            # and the other side is a slot position: an arange, or the decay's `k - 1` (not a per-slot loss)
            positional = _slot_start(an, slot) is not None or any(
                isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and const_number(n.right) is not None for n in ast.walk(slot))
            if setting and positional and _is_slot_index(an, slot) and not _is_slot_index(an, rate) and _in_loss_context(an, node):
                yield node, slot, rate
                break


@dataclass
class _Source:
    """Where a value on the decay's path ends: a literal, a default (parameter, settings field, `.get`
    fallback), or an opaque value (`missing` says why)."""
    value: object
    node: ast.AST
    how: str
    kind: str  # literal | default | opaque
    missing: str = ""


def _config_defaults(an: Analyzer, key: str) -> list[_Source]:
    """A settings value read by its key (`args.key`, `cfg["key"]`, `kwargs.get("key")`): the defaults of
    settings fields declared with exactly that name, and values stored under that key in literal dicts."""
    out: list[_Source] = []
    for value_node, _unit, stmt in an.field_defaults.get(key, []):
        if in_variant_code(an, stmt):
            continue
        value = an.literal(value_node)
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            out.append(_Source(value, stmt, f"settings field `{key}`", "default"))
    return out


def _constructed_field(an: Analyzer, key: str, depth: int) -> list[_Source]:
    """A settings class field declared without a default (`gamma: float | None`): what its constructors pass
    for it (`Plan(gamma=cfg.loss_decay_gamma)`, `cls(gamma=...)` in a classmethod)."""
    out: list[_Source] = []
    if depth > 8:
        return out
    for cls in nodes_of(an, ast.ClassDef):
        if in_variant_code(an, cls) or not any(
                isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id == key and st.value is None
                for st in cls.body):
            continue
        calls = list(an.calls_named(cls.name)) + [c for c in an.calls_named("cls") if an.enclosing(c, (ast.ClassDef,)) is cls]
        for call in calls[:4]:
            arg = kwarg(call, key)
            if arg is not None and not in_variant_code(an, call):
                out += _gamma_sources(an, arg, depth + 1)
    return out


def _gamma_sources(an: Analyzer, node: ast.AST, depth: int = 0) -> list[_Source]:
    """Follow the decay's gamma back along its value path: assignments, `self.x`, parameters to the arguments
    their callers pass (a default counts only where some caller leaves it unset), keyword dicts handed to an
    entry point, settings fields read by their exact key. Names never stand in for the path."""
    if depth > 10:
        return [_Source(MISSING, node, "", "opaque", "the trail is too long to follow")]
    number = const_number(node)
    if number is not None:
        return [_Source(float(number), node, ast.unparse(node), "literal")]
    if isinstance(node, ast.Constant) and node.value is None:
        return [_Source(None, node, "None", "literal")]
    if isinstance(node, ast.Call):
        name = call_name(node)
        if name in {"float", "int"} and len(node.args) == 1:
            return _gamma_sources(an, node.args[0], depth + 1)
        if name in {"get", "pop", "getattr", "setdefault"} and len(node.args) >= 2:
            key_node = node.args[1] if name == "getattr" else node.args[0]
            fallback = node.args[2] if name == "getattr" and len(node.args) >= 3 else node.args[-1] if name != "getattr" else None
            out: list[_Source] = []
            if isinstance(key_node, ast.Constant) and isinstance(key_node.value, str):
                out += _config_defaults(an, key_node.value)
            if fallback is not None:
                out += [_Source(s.value, s.node, f"`{ast.unparse(node)[:60]}` fallback", "default", s.missing) if s.kind == "literal" else s
                        for s in _gamma_sources(an, fallback, depth + 1)]
            return out
        return [_Source(MISSING, node, "", "opaque", f"`{ast.unparse(node)[:60]}` is computed at run time")]
    if isinstance(node, ast.IfExp):
        # `g if weighting == "decay" else None`: each branch holds under its condition; a branch that is a
        # bare constant is the other mode's placeholder (gamma unused there), not a value the decay divides by
        out = _gamma_sources(an, node.body, depth + 1)
        for source in _gamma_sources(an, node.orelse, depth + 1):
            out.append(replace(source, kind="switch") if source.kind == "literal" else source)
        return out
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
        out = []
        for value in node.values:
            out += _gamma_sources(an, value, depth + 1)
        return out
    if isinstance(node, ast.Name) or (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
        found = an.defs_of(node)
        if found is None:
            if isinstance(node, ast.Attribute):
                return _config_defaults(an, node.attr) or [_Source(MISSING, node, "", "opaque", f"`{ast.unparse(node)}` is never assigned in the analysed code")]
            return [_Source(MISSING, node, "", "opaque", f"`{ast.unparse(node)}` is not defined in the analysed code")]
        definitions, scope = found
        if definitions:
            out = []
            for definition in definitions[-3:]:
                out += _gamma_sources(an, definition, depth + 1)
            return out
        return _parameter_sources(an, scope.node, node.id, scope.params.get(node.id), depth)
    if isinstance(node, ast.Attribute):
        out = _config_defaults(an, node.attr) + _constructor_argument(an, node, node.attr, depth) + _constructed_field(an, node.attr, depth)
        return out or [_Source(MISSING, node, "", "opaque", f"`{ast.unparse(node)[:60]}` is a run-time setting with no default in the code")]
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        key = node.slice.value
        out = _config_defaults(an, key) + _constructor_argument(an, node, key, depth)
        for value in [v for v in keyed_values(an, key) if not in_variant_code(an, v)][:3]:
            out += _gamma_sources(an, value, depth + 1)
        return out or [_Source(MISSING, node, "", "opaque", f"`{ast.unparse(node)[:60]}` is a run-time setting with no default in the code")]
    return [_Source(MISSING, node, "", "opaque", f"`{ast.unparse(node)[:60]}` is computed at run time")]


def _constructor_argument(an: Analyzer, node: ast.AST, key: str, depth: int) -> list[_Source]:
    """`self.hparams.key` / `self.settings["key"]` inside a class whose constructor takes `key`: the class keeps
    its constructor arguments under their names (Lightning's save_hyperparameters, `self.cfg = locals()`)."""
    base = node.value
    while isinstance(base, (ast.Attribute, ast.Subscript)):
        base = base.value
    cls = an.enclosing(node, (ast.ClassDef,))
    if not (isinstance(base, ast.Name) and base.id == "self" and isinstance(cls, ast.ClassDef)):
        return []
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            scope = an.scope(stmt.body[0]) if stmt.body else None
            if scope is not None and key in scope.params:
                return _parameter_sources(an, stmt, key, scope.params[key], depth + 1)
    return []


def _parameter_sources(an: Analyzer, func: ast.AST | None, param: str, default: ast.expr | None, depth: int) -> list[_Source]:
    name = getattr(func, "name", "?")
    sites = call_bindings(an, func, param) if func is not None else []
    passed = [arg for _call, arg in sites if isinstance(arg, ast.expr)]
    out: list[_Source] = []
    for arg in passed[:4]:
        out += _gamma_sources(an, arg, depth + 1)
    # A default is what runs only where a caller leaves the parameter unset (or nothing calls the function).
    if default is not None and (not sites or any(not isinstance(arg, ast.expr) for _call, arg in sites)):
        value = an.literal(default)
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            out.append(_Source(None if value is None else float(value), default, f"default of `{name}({param}=...)`", "default"))
    if not passed:
        # an entry point called with a keyword dict: `{"gamma": g}` splatted into `forward(**kwargs)`
        for value in [v for v in keyed_values(an, param) if not in_variant_code(an, v)][:3]:
            out += _gamma_sources(an, value, depth + 1)
    if not out:
        why = "nothing in the analysed code calls it" if not sites else "its callers pass it at run time"
        out.append(_Source(MISSING, func or an.units[0].tree, "", "opaque", f"parameter `{param}` of `{name}` has no default and {why}"))
    return out


def _references(an: Analyzer, name: str) -> list[ast.AST]:
    """Loads of a function's name (`f`, `obj.f`) anywhere: calls, `partial(f, ...)`, a registry entry."""
    index = an.memo("name-loads", lambda: _index_name_loads(an))
    return index.get(name, [])


def _index_name_loads(an: Analyzer) -> dict[str, list[ast.AST]]:
    index: dict[str, list[ast.AST]] = {}
    for node in an.by_type.get(ast.Name, []):
        if isinstance(node.ctx, ast.Load):
            index.setdefault(node.id, []).append(node)
    for node in an.by_type.get(ast.Attribute, []):
        if isinstance(node.ctx, ast.Load):
            index.setdefault(node.attr, []).append(node)
    return index


def _module_of(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _unit_for_module(an: Analyzer, module: str) -> object | None:
    """The analysed file of a dotted module (`pkg.sub` -> pkg/sub.py or pkg/sub/__init__.py); the analysed root
    may sit below the import root, so the longest common tail decides."""
    index = an.memo("modules", lambda: {_module_of(u.path): u for u in an.units})
    if module in index:
        return index[module]
    parts = module.split(".")
    for start in range(1, len(parts)):
        tail = ".".join(parts[start:])
        hits = [u for m, u in index.items() if m == tail or m.endswith("." + tail)]
        if len(hits) == 1:
            return hits[0]
    return None


def _imported_from(an: Analyzer, unit: object, name: str, depth: int = 0) -> str | None:
    """The module a file's `from M import name` finally takes `name` from, through package re-exports."""
    package = _module_of(unit.path)
    package = package if unit.path.endswith("__init__.py") else package.rsplit(".", 1)[0] if "." in package else ""
    for stmt in unit.tree.body if depth else ast.walk(unit.tree):
        if not isinstance(stmt, ast.ImportFrom):
            continue
        alias = next((a for a in stmt.names if (a.asname or a.name) == name), None)
        if alias is None:
            continue
        module = stmt.module or ""
        if stmt.level:
            base = package.split(".") if package else []
            base = base[: len(base) - (stmt.level - 1)] if stmt.level > 1 else base
            module = ".".join([*base, module] if module else base)
        source = _unit_for_module(an, module)
        if source is not None and depth < 4 and not any(
                isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == alias.name for n in source.tree.body):
            deeper = _imported_from(an, source, alias.name, depth + 1)
            if deeper is not None:
                return deeper
        return _module_of(source.path) if source is not None else module
    return None


def _refers_to(an: Analyzer, ref: ast.AST, func: ast.AST) -> bool:
    """Whether a load of `func`'s name means `func`: in its own file, or in a file that imports the name from
    `func`'s module (through package re-exports). A file that defines or imports the name from elsewhere
    means another function; a name of unknown provenance (`obj.f`, a star import) may be it."""
    here, there = an.unit(ref), an.unit(func)
    if here is there:
        return True
    name = func.name
    if isinstance(ref, ast.Name):
        if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name for n in here.tree.body):
            return False
        module = _imported_from(an, here, name)
        if module is not None:
            target = _module_of(there.path)
            return module == target or target.endswith("." + module) or module.endswith("." + target)
    return True


def _used_on_dflash_path(an: Analyzer, func: ast.AST, depth: int = 0) -> bool | None:
    """True: DFlash code refers to `func` (or to another algorithm's function that DFlash code uses);
    False: only other algorithms' code does (their loss applies it, DFlash's does not); None: nothing
    refers to it (a library function or an entry point: undecided)."""
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or depth > 3:
        return None
    refs = [r for r in _references(an, func.name) if an.enclosing_function(r) is not func and _refers_to(an, r, func)]
    if not refs:
        return None
    for ref in refs:
        if not in_variant_code(an, ref):
            return True
        holder = an.enclosing_function(ref)
        if holder is not None and _used_on_dflash_path(an, an.outermost_function(ref) or holder, depth + 1) is True:
            return True
    return False


@detector("dflash.loss_decay_gamma")
def detect_gamma(an: Analyzer) -> list[CodeReading]:
    """The gamma the decay actually divides by, traced along its value path; a decay that only other
    algorithms' code applies is no decay for DFlash (`none`)."""
    decays = [(node, numerator, divisor, False) for node, numerator, divisor in _decay_exponentials(an)]
    decays += [(node, slot, rate, True) for node, slot, rate in _inverted_decays(an)]
    readings = _flat_weights(an) if not decays else []
    for node, _numerator, divisor, inverted in decays:
        if an.switch_of(node) == VARIANT or in_variant_code(an, node):
            continue  # DSpark's decay from slot 0, another algorithm's loss
        holder = an.outermost_function(node) or an.enclosing_function(node)
        if holder is not None and _used_on_dflash_path(an, holder) is False:
            readings.append(reading_at(an, "dflash.loss_decay_gamma", "none", node, 0.6,
                                       detail=f"the decay in `{holder.name}` is applied only by other algorithms' code; "
                                              "nothing on the DFlash loss path calls it"))
            continue
        written = f"exp(-(k-1) * {ast.unparse(divisor)[:30]})" if inverted else f"exp(-(k-1)/{ast.unparse(divisor)[:30]})"
        sources = _gamma_sources(an, divisor)
        known = [s for s in sources if s.kind not in ("opaque", "switch")]
        opaque = [s for s in sources if s.kind == "opaque"]
        for source in known:
            value = source.value
            if inverted and isinstance(value, float):
                if value == 0:
                    continue
                value = 1.0 / value
            hard = source.kind == "literal" and source.node is divisor
            how = (f"the decay divisor (gamma) is hard-coded to {source.value}" if hard else
                   f"{source.how} = {source.value!r}, the value that reaches the decay {written}")
            if inverted:
                how += f": it multiplies the exponent, so the decay's gamma is 1/{source.value}"
            if opaque:
                how += f" (other values may reach it: {opaque[0].missing})"
            # a literal one caller passes speaks for that call only (an eval helper, a test): weaker than a default
            confidence = 0.85 if hard else 0.5 if source.kind == "literal" else 0.6
            readings.append(reading_at(an, "dflash.loss_decay_gamma", None if value is None else float(value),
                                       divisor if hard else source.node, confidence,
                                       mode="hardcoded" if hard else "default", detail=how))
        if not known:
            why = "; ".join(dict.fromkeys(s.missing for s in opaque))[:200]
            readings.append(reading_at(an, "dflash.loss_decay_gamma", None, node, 0.3, mode="switch",
                                       switch=leaf_name(divisor) or ast.unparse(divisor)[:30],
                                       detail=f"the decay's gamma is set at run time ({why})"))
    return readings


FLAT_CALLS = {"ones", "ones_like", "new_ones"}
# Names of per-slot loss weights (not masks: a 0/1 mask times ones is not a decay setting).
SLOT_WEIGHT_TOKENS = {"weight", "weights", "w", "decay", "wts", "lw", "coef"}


def _flat_weights(an: Analyzer) -> list[CodeReading]:
    """No decay anywhere, and the per-slot weights are ones with slot 0 zeroed (`w = ones(B); w[0] = 0`):
    the decay is off in the code, whatever gamma a settings class still declares ("none")."""
    readings = []
    for node in nodes_of(an, ast.Assign):
        # w = ones_like(k) * (k > 0): flat weights with slot 0 masked out in one expression
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and set(tokens(node.targets[0].id)) & SLOT_WEIGHT_TOKENS \
                and isinstance(node.value, ast.BinOp) and _is_flat(an, node.value):
            switch = an.switch_of(node)
            readings.append(reading_at(an, "dflash.loss_decay_gamma", "none", node, 0.75,
                                       mode="switch" if switch else "hardcoded", switch=switch,
                                       detail=f"`{node.targets[0].id}` = ones times a slot mask: flat per-slot weights, no decay"))
            continue
        if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Subscript) or const_number(node.value) != 0:
            continue
        target = node.targets[0]
        index = target.slice.elts[-1] if isinstance(target.slice, ast.Tuple) else target.slice
        if const_number(index) != 0 or not isinstance(target.value, ast.Name):
            continue
        found = an.defs_of(target.value)
        if not found or not found[0] or not all(_is_flat(an, d) for d in found[0]):
            continue
        switch = an.switch_of(node)
        readings.append(reading_at(an, "dflash.loss_decay_gamma", "none", node, 0.75,
                                   mode="switch" if switch else "hardcoded", switch=switch,
                                   detail=f"`{target.value.id}` = {ast.unparse(found[0][0])[:40]} with slot 0 zeroed: "
                                          "flat per-slot weights, no decay in the code"))
    return readings


def _is_flat(an: Analyzer, node: ast.AST, depth: int = 0) -> bool:
    """ones(...), a name bound to it, or ones times a 0/1 mask (`ones_like(k) * (k > 0)`): no decay."""
    if depth > 4:
        return False
    if isinstance(node, ast.Call):
        if call_name(node) in FLAT_CALLS:
            return True
        return isinstance(node.func, ast.Attribute) and call_name(node) in {"float", "to", "clone"} and _is_flat(an, node.func.value, depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        for flat, other in ((node.left, node.right), (node.right, node.left)):
            if _is_flat(an, flat, depth + 1) and any(isinstance(n, ast.Compare) for n in ast.walk(other)):
                return True
        return False
    if isinstance(node, ast.Name):
        found = an.defs_of(node)
        return bool(found and len(found[0]) == 1 and _is_flat(an, found[0][0], depth + 1))
    return False


def _dict_literal_items(an: Analyzer) -> list[tuple[str, ast.expr, ast.AST]]:
    """(key, value, node) of config dicts written as literals: dict(block_size=16) / {"block_size": 16}."""
    key = ("dict_items",)
    if key not in an._cache:
        items: list[tuple[str, ast.expr, ast.AST]] = []
        for node in nodes_of(an, (ast.Call, ast.Dict)):
            if isinstance(node, ast.Call) and call_name(node) == "dict" and isinstance(node.func, ast.Name):
                items.extend((kw.arg, kw.value, node) for kw in node.keywords if kw.arg)
            elif isinstance(node, ast.Dict):
                items.extend((k.value, v, node) for k, v in zip(node.keys, node.values)
                             if isinstance(k, ast.Constant) and isinstance(k.value, str))
        an._cache[key] = items
    return an._cache[key]


@detector("block_size")
def detect_block_size_defaults(an: Analyzer) -> list[CodeReading]:
    readings = []
    for func_list in an.functions.values():
        for func, scope in func_list:
            for param, default in scope.params.items():
                if default is not None and (is_blocksize_name(param) or param in {"block", "block_tokens"}):
                    value = an.literal(default)
                    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 2:
                        readings.append(reading_at(an, "block_size", int(value), default, 0.5, mode="default",
                                                 detail=f"{func.name}({param}={int(value)})"))
    for field_name, entries in an.field_defaults.items():
        if is_blocksize_name(field_name) or field_name in {"block", "block_tokens"}:
            for value_node, _unit, stmt in entries:
                value = an.literal(value_node)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 2:
                    readings.insert(0, reading_at(an, "block_size", int(value), stmt, 0.6, mode="default", detail=f"{field_name} = {int(value)}"))
    # config dicts written as literals (weaker than parameter defaults and fields)
    for key, value_node, where in _dict_literal_items(an):
        if is_blocksize_name(key) or key in {"block", "block_tokens"}:
            value = an.literal(value_node)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 2 <= value <= 64:  # a draft block, not a kernel tile size
                readings.append(reading_at(an, "block_size", int(value), where, 0.5, mode="default", detail=f"{key!r}: {int(value)}"))
    # the per-slot decay runs over the B slots of a block: exp(-(arange(N) - 1) / gamma) has N = B
    for node, numerator, _divisor in _decay_exponentials(an):
        for sub in ast.walk(numerator):
            calls = [sub] if isinstance(sub, ast.Call) else []
            if isinstance(sub, ast.Name):
                found = an.defs_of(sub)
                calls = [d for d in (found[0] if found else []) if isinstance(d, ast.Call)]
            for call in calls:
                if call_name(call) != "arange" or len(call.args) != 1:
                    continue
                arg = call.args[0]
                value = an.literal(arg)
                if value is MISSING and isinstance(arg, ast.Attribute):
                    value = _field_default(an, arg.attr)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and 2 <= value <= 64:
                    readings.append(reading_at(an, "block_size", int(value), call, 0.4, mode="default",
                                             detail=f"the per-slot decay weights span {int(value)} slots"))
    return readings


def _field_default(an: Analyzer, name: str) -> object:
    values = {an.literal(v) for v, _u, _s in an.field_defaults.get(name, [])}
    return values.pop() if len(values) == 1 else MISSING


def _is_slot_index(an: Analyzer, node: ast.AST) -> bool:
    """An expression over the slot position within a block: arange(B), x % B, names like pos_in_block."""
    tags = an.tags(node)
    if "slot" in tags:
        return True
    if "arange" in tags and "anchor" not in tags:
        return True
    names = [leaf_name(n).lower() for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))]
    return any(re.search(r"(slot|pos_in_block|pos_idx|position_in_block|block_pos|in_block)", n) for n in names)


@detector("dflash.anchor_slot_untrained")
def detect_anchor_slot(an: Analyzer) -> list[CodeReading]:
    readings = []
    for node in nodes_of(an, (ast.Assign, ast.Compare, ast.Subscript)):
            # w[..., 0] = 0  /  mask[:, ::B] = 0
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript):
                target = node.targets[0]
                if const_number(node.value) != 0 and not (isinstance(node.value, ast.Constant) and node.value.value is False):
                    continue
                toks = set(tokens(leaf_name(target.value))) | ({"weight"} if set(tokens(leaf_name(target.value))) & {"valid", "keep", "supervised", "supervise"} else set())
                if _holds_decay(an, target.value):  # whatever it is called, it holds the per-slot decay weights
                    toks |= {"weight"}
                index = target.slice
                parts = index.elts if isinstance(index, ast.Tuple) else [index]
                last = parts[-1]
                # every B-th entry from 0 is slot 0 of each block, whatever the tensor is called
                strided = isinstance(last, ast.Slice) and last.step is not None and an.is_blocksize(last.step) and last.lower is None
                # Zeroing slot 0 of the targets or logits is not a weight of 0: slot 0 is still trained
                # (toward a zero target); only the weights (or the mask) that multiply the loss count.
                if not strided and not toks & WEIGHTISH_TOKENS:
                    continue
                zero_slot = const_number(last) == 0 and (len(parts) > 1 or toks & WEIGHTISH_TOKENS)
                if zero_slot or strided:
                    switch = an.switch_of(node)
                    readings.append(reading_at(an, "dflash.anchor_slot_untrained", "weight 0", node, 0.8,
                                             mode="switch" if switch else "hardcoded", switch=switch,
                                             detail=f"slot 0 zeroed in `{leaf_name(target.value)}`"))
            # w * (pos != 0) / (pos > 0) / (pos >= 1); torch.where(pos == 0, 0, w)
            elif isinstance(node, ast.Compare) and len(node.ops) == 1:
                op, right = node.ops[0], node.comparators[0]
                c = const_number(right)
                is_zero_excl = (isinstance(op, (ast.NotEq, ast.Gt)) and c == 0) or (isinstance(op, ast.GtE) and c == 1)
                is_zero_sel = isinstance(op, ast.Eq) and c == 0
                if not (is_zero_excl or is_zero_sel) or not _is_slot_index(an, node.left):
                    continue
                if is_zero_sel:
                    parent = an.parents.get(node)
                    if not (isinstance(parent, ast.Call) and call_name(parent) in {"where", "masked_fill"} and
                            len(parent.args) >= 2 and (_is_zero(parent.args[1]) or call_name(parent) == "masked_fill")) \
                            and not _removed_by_complement(an, node):
                        continue
                if not _in_loss_context(an, node) or not _in_weight_expression(an, node):
                    continue
                switch = an.switch_of(node)
                readings.append(reading_at(an, "dflash.anchor_slot_untrained", "weight 0", node, 0.75,
                                         mode="switch" if switch else "hardcoded", switch=switch,
                                         detail=f"slot 0 excluded by `{ast.unparse(node)}`"))
            # loss over slots 1..B-1 only: logits[..., 1:, :] / weights[:, 1:]
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple):
                toks = set(tokens(leaf_name(node.value)))
                if not toks & (LOGITS_TOKENS | {"target", "targets", "labels", "weights", "loss", "losses"}):
                    continue
                slices = [p for p in node.slice.elts if isinstance(p, ast.Slice) and const_number(p.lower) == 1 and p.upper is None and p.step is None]
                func = an.enclosing_function(node)
                in_loss_function = func is not None and re.search(r"loss|objective|criterion|weight|train|step", func.name, re.I)
                if slices and in_loss_function and isinstance(an.parents.get(node), (ast.Call, ast.Assign, ast.BinOp)):
                    readings.append(reading_at(an, "dflash.anchor_slot_untrained", "weight 0", node, 0.55,
                                             detail=f"only slots 1.. enter the loss (`{ast.unparse(node)[:60]}`)"))
    # weights built as a list: ws = [0.0]; for j in range(1, B): ws.append(exp(-(j - 1) / gamma))
    for node, _numerator, _divisor in _decay_exponentials(an):
        parent = an.parents.get(node)
        if not (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute) and parent.func.attr == "append"):
            continue
        found = an.defs_of(parent.func.value)
        if found and any(isinstance(d, ast.List) and d.elts and const_number(d.elts[0]) == 0 for d in found[0]):
            switch = an.switch_of(node)
            readings.append(reading_at(an, "dflash.anchor_slot_untrained", "weight 0", parent, 0.7,
                                     mode="switch" if switch else "hardcoded", switch=switch,
                                     detail=f"`{leaf_name(parent.func.value)}` starts with weight 0 for slot 0, decay from slot 1"))
    # the decay placed after a zero for slot 0: cat([zeros(1), decay]) / F.pad(decay, (1, 0)) / hstack([[0.], d])
    for node, decay in _decay_after_zero(an):
        switch = an.switch_of(node)
        readings.append(reading_at(an, "dflash.anchor_slot_untrained", "weight 0", node, 0.75,
                                 mode="switch" if switch else "hardcoded", switch=switch,
                                 detail=f"slot 0 is the zero placed before `{ast.unparse(decay)[:40]}`"))
    # functional index update (JAX): w.at[0].set(0) / w.at[:, 0].multiply(0) on the per-slot weights
    for node in nodes_of(an, ast.Call):
        func = node.func
        if not (isinstance(func, ast.Attribute) and func.attr in {"set", "multiply", "mul"} and node.args
                and const_number(node.args[0]) == 0 and isinstance(func.value, ast.Subscript)
                and isinstance(func.value.value, ast.Attribute) and func.value.value.attr == "at"):
            continue
        receiver = func.value.value.value
        index = func.value.slice
        parts = index.elts if isinstance(index, ast.Tuple) else [index]
        toks = set(tokens(leaf_name(receiver)))
        if const_number(parts[-1]) == 0 and (toks & WEIGHTISH_TOKENS or _holds_decay(an, receiver)):
            switch = an.switch_of(node)
            readings.append(reading_at(an, "dflash.anchor_slot_untrained", "weight 0", node, 0.8,
                                     mode="switch" if switch else "hardcoded", switch=switch,
                                     detail=f"slot 0 zeroed in `{leaf_name(receiver)}` (functional update)"))
    # a decay applied from slot 0 with nothing excluding slot 0 anywhere: by that formula slot 0 weighs
    # exp(1/gamma) > 0, so slot 0 is trained. Any 1-D slice from slot 1 on a loss-side tensor makes it undecided.
    readings = [r for r in readings if not an.overridden_everywhere(r.scope)]  # hooks every subclass replaces
    sliced_from_one = any(
        isinstance(n.slice, ast.Slice) and const_number(n.slice.lower) == 1 and n.slice.upper is None
        and set(tokens(leaf_name(n.value))) & (WEIGHTISH_TOKENS | LOGITS_TOKENS | {"ce", "nll", "kl", "losses", "target", "targets", "labels"})
        for n in nodes_of(an, ast.Subscript) if not in_variant_code(an, n)
    )
    readings = [r for r in readings if not (in_variant_file(r.path) or VARIANT_PATTERN.search(r.scope or ""))]
    # "nothing zeroes slot 0" is a claim only when nothing in the loss even singles slot 0 out: a test of the
    # slot index against 0 (`anchor = k == 0`, then its term subtracted, masked, indexed away) is an exclusion
    # in a form the readings above may not follow, so the decay alone then decides nothing.
    # (Only code that runs: not a base hook every subclass overrides, not a helper off the DFlash path.)
    def _runs(node: ast.AST) -> bool:
        holder = an.outermost_function(node)
        return not (an.overridden_everywhere(reading_at(an, "", None, node, 0.0).scope)
                    or (holder is not None and _used_on_dflash_path(an, holder) is False))

    slot_zero_singled_out = any(
        _is_slot_index(an, n.left) and _in_loss_context(an, n) and not in_variant_code(an, n)
        and ((isinstance(n.ops[0], (ast.Eq, ast.NotEq, ast.Gt)) and const_number(n.comparators[0]) == 0)
             or (isinstance(n.ops[0], (ast.GtE, ast.Lt)) and const_number(n.comparators[0]) == 1))
        and _runs(n)
        for n in nodes_of(an, ast.Compare) if len(n.ops) == 1
    )
    if not readings and not sliced_from_one and not slot_zero_singled_out:
        for node, numerator, _divisor in _decay_exponentials(an):
            if an.switch_of(node) == VARIANT or in_variant_code(an, node):
                continue
            holder = an.outermost_function(node)
            if holder is not None and _used_on_dflash_path(an, holder) is False:
                continue
            if _is_slot_index(an, numerator) and _in_loss_context(an, node):
                start = _slot_start(an, numerator)
                switch = an.switch_of(node)
                mode: Mode = "switch" if switch else "hardcoded"
                if start == 0:
                    readings.append(reading_at(an, "dflash.anchor_slot_untrained", "trained", node, 0.6, mode=mode, switch=switch,
                                             detail="decay weights cover slot 0 and nothing zeroes the anchor slot"))
                elif _clamped_at_zero(numerator):
                    readings.append(reading_at(an, "dflash.anchor_slot_untrained", "trained", node, 0.6, mode=mode, switch=switch,
                                             detail=f"`{ast.unparse(numerator)[:40]}` is clamped at 0, so slot 0 gets the full "
                                                    "weight exp(0) = 1, and nothing zeroes the anchor slot"))
    # other algorithms' readings (Domino's, DSpark's) say nothing about DFlash's slot 0
    readings = [r for r in readings if not (in_variant_file(r.path) or VARIANT_PATTERN.search(r.scope or ""))]
    if not any(r.value == "weight 0" for r in readings):
        readings += _slot_zero_kept(an)
    return _behind_weighting_switch(an, readings)


def _clamped_at_zero(node: ast.AST) -> bool:
    """`(k - 1).clamp(min=0)` / `clamp(k - 1, min=0)` / `max(k - 1, 0)`: the exponent is 0 at slot 0 as well."""
    if not isinstance(node, ast.Call) or call_name(node) not in {"clamp", "clamp_min", "clip", "maximum", "max"}:
        return False
    inner = node.func.value if isinstance(node.func, ast.Attribute) and not is_module_name(node.func.value) else (node.args[0] if node.args else None)
    bound = kwarg(node, "min")
    if bound is None:
        rest = node.args if inner is not (node.args[0] if node.args else None) else node.args[1:]
        bound = rest[0] if rest else None
    return (isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Sub) and const_number(inner.right) == 1
            and const_number(bound) == 0)


def _slot_zero_kept(an: Analyzer) -> list[CodeReading]:
    """A slot mask in the loss weights that lets slot 0 through (`pos >= 0`, `pos > -1`): slot 0 is trained,
    unless something else zeroes it (the caller only asks when nothing does)."""
    readings = []
    for node in nodes_of(an, ast.Compare):
        if len(node.ops) != 1 or in_variant_code(an, node) or an.switch_of(node) == VARIANT:
            continue
        op, bound = node.ops[0], const_number(node.comparators[0])
        keeps = (isinstance(op, ast.GtE) and bound == 0) or (isinstance(op, ast.Gt) and bound == -1)
        # only the slot index itself (0 at the anchor), not a distance like `slot - 1` whose 0 is slot 1
        if keeps and _is_slot_index(an, node.left) and _slot_start(an, node.left) == 0 and an.const_offset(node.left) == 0 \
                and _in_loss_context(an, node) and _in_weight_expression(an, node):
            readings.append(reading_at(an, "dflash.anchor_slot_untrained", "trained", node, 0.6,
                                       detail=f"`{ast.unparse(node)}` keeps every slot, the anchor's too, and nothing "
                                              "zeroes slot 0"))
    return readings


def _function_at(an: Analyzer, path: str, line: int) -> ast.AST | None:
    """The outermost function of the analysed code that holds `path:line`."""
    for entries in an.functions.values():
        for func, _scope in entries:
            if an.unit(func).path == path and func.lineno <= line <= (func.end_lineno or func.lineno) \
                    and an.outermost_function(func) is None:
                return func
    return None


def _behind_weighting_switch(an: Analyzer, readings: list[CodeReading]) -> list[CodeReading]:
    """A slot-0 exclusion inside a weighting function that the loss picks behind a switch
    (`decay_fn = dpace if ... else decayed`) holds only in that branch: its readings become switch readings,
    and each alternative the other branch assigns in its place that zeroes nothing adds `trained` there."""
    zeroing: dict[ast.AST, list[int]] = {}
    for i, r in enumerate(readings):
        if r.value == "weight 0" and r.mode == "hardcoded":
            func = _function_at(an, r.path, r.line)
            if func is not None:
                zeroing.setdefault(func, []).append(i)
    holders = {_function_at(an, r.path, r.line) for r in readings if r.value == "weight 0"}
    out = list(readings)
    for func, indices in zeroing.items():
        refs = [ref for ref in _references(an, func.name)
                if an.enclosing_function(ref) is not func and _refers_to(an, ref, func) and not in_variant_code(an, ref)]
        if not refs:
            continue
        alternatives: list[tuple[ast.AST, str, str]] = []
        for ref in refs:
            label = an.switch_of(ref)
            if label is None or label == VARIANT:
                alternatives = []
                break  # used unconditionally somewhere: its exclusion holds on that path
            for other, name in _other_branch_assignments(an, ref):
                if name != func.name and not any(getattr(h, "name", None) == name for h in holders):
                    alternatives.append((other, name, label))
            if not alternatives:
                break
        if not alternatives:
            continue
        label = alternatives[0][2]
        for i in indices:
            r = out[i]
            out[i] = replace(r, mode="switch", switch=label, detail=f"{r.detail} (only where `{func.name}` weighs the loss: behind `{label}`)")
        for other, name, label in alternatives:
            out.append(reading_at(an, "dflash.anchor_slot_untrained", "trained", other, 0.6, mode="switch", switch=label,
                                  detail=f"in the other branch of `{label}` the per-slot weights come from `{name}`, "
                                         "which does not zero slot 0"))
    return out


def _other_branch_assignments(an: Analyzer, ref: ast.AST) -> list[tuple[ast.AST, str]]:
    """`x = f(...)` in one branch of an if: the functions the other branch assigns to `x` instead."""
    stmt = an.parents.get(ref)
    while stmt is not None and not isinstance(stmt, ast.stmt):
        stmt = an.parents.get(stmt)
    branch = an.parents.get(stmt) if stmt is not None else None
    if not (isinstance(stmt, ast.Assign) and isinstance(branch, ast.If)):
        return []
    names = {ast.unparse(t) for t in stmt.targets}
    other = branch.orelse if stmt in branch.body else branch.body
    out = []
    for alt in other:
        if isinstance(alt, ast.Assign) and {ast.unparse(t) for t in alt.targets} == names:
            for sub in ast.walk(alt.value):
                name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else None
                if name and name in an.functions and name != "partial":
                    out.append((alt, name))
    return out


def _removed_by_complement(an: Analyzer, node: ast.AST) -> bool:
    """`w - w * (k == 0)`, `w * (1 - (k == 0))`, `w * ~(k == 0)`: the weights with the selected slot taken away,
    which is `w * (k != 0)` written as a complement."""
    current, child = an.parents.get(node), node
    while isinstance(current, ast.Attribute) and current.value is child and current.attr in {
            "float", "to", "type_as", "long", "int", "double", "half"}:
        call = an.parents.get(current)  # (k == 0).float()
        if not (isinstance(call, ast.Call) and call.func is current):
            return False
        current, child = an.parents.get(call), call
    if isinstance(current, ast.UnaryOp) and isinstance(current.op, ast.Invert):
        return isinstance(an.parents.get(current), ast.BinOp) and isinstance(an.parents.get(current).op, ast.Mult)
    if isinstance(current, ast.BinOp) and isinstance(current.op, ast.Sub) and current.right is child \
            and const_number(current.left) == 1:
        outer = an.parents.get(current)
        return isinstance(outer, ast.BinOp) and isinstance(outer.op, ast.Mult)
    if isinstance(current, ast.BinOp) and isinstance(current.op, ast.Mult):
        other = current.left if current.right is child else current.right
        outer = an.parents.get(current)
        return (isinstance(outer, ast.BinOp) and isinstance(outer.op, ast.Sub) and outer.right is current
                and ast.unparse(outer.left) == ast.unparse(other))
    return False


def _is_zero_prefix(node: ast.AST) -> bool:
    """A constant zero of one or more slots: zeros(1), new_zeros(n), tensor([0.]), [0.0], (0,)."""
    if isinstance(node, ast.Call) and call_name(node) in {"zeros", "new_zeros", "zeros_like"}:
        return True
    if isinstance(node, ast.Call) and call_name(node) in {"tensor", "as_tensor", "asarray", "array", "Tensor"} and node.args:
        node = node.args[0]
    return isinstance(node, (ast.List, ast.Tuple)) and bool(node.elts) and all(const_number(e) == 0 for e in node.elts)


def _decay_after_zero(an: Analyzer) -> Iterator[tuple[ast.Call, ast.expr]]:
    """Where the per-slot decay is laid out after a zero for the anchor slot: `cat([zeros(1), decay])` (cat,
    concat, concatenate, hstack, stack-free forms) or `pad(decay, (1, 0))`, the decay traced through names."""
    decay_ids = {id(call) for call, _n, _d in _decay_exponentials(an)}

    def is_decay(expr: ast.AST) -> bool:
        if any(id(sub) in decay_ids for sub in ast.walk(expr)):
            return True
        return any(_holds_decay(an, sub) for sub in ast.walk(expr) if isinstance(sub, (ast.Name, ast.Attribute)))

    for node in nodes_of(an, ast.Call):
        name = call_name(node)
        if name in {"cat", "concat", "concatenate", "hstack"} and node.args and isinstance(node.args[0], (ast.List, ast.Tuple)):
            parts = node.args[0].elts
            if len(parts) >= 2 and _is_zero_prefix(parts[0]) and any(is_decay(p) for p in parts[1:]):
                yield node, next(p for p in parts[1:] if is_decay(p))
        elif name == "pad" and len(node.args) >= 2 and isinstance(node.args[1], (ast.Tuple, ast.List)) \
                and len(node.args[1].elts) == 2 and const_number(node.args[1].elts[0]) == 1 and is_decay(node.args[0]):
            value = kwarg(node, "value")
            if value is None or const_number(value) == 0:
                yield node, node.args[0]


def _holds_decay(an: Analyzer, node: ast.AST) -> bool:
    """The name was assigned from a per-slot decay exp(-X/G) (dataflow), whatever it is called."""
    if not isinstance(node, (ast.Name, ast.Attribute)):
        return False
    key = ("decay_names",)
    if key not in an._cache:
        an._cache[key] = {id(call) for call, _n, _d in _decay_exponentials(an)}
    decay_ids = an._cache[key]
    found = an.defs_of(node)
    if not found:
        return False
    return any(id(sub) in decay_ids for d in found[0] for sub in ast.walk(d))


def _is_zero(node: ast.AST) -> bool:
    if const_number(node) == 0:
        return True
    return isinstance(node, ast.Call) and call_name(node) in {"zeros", "zeros_like", "new_zeros"}


def _in_weight_expression(an: Analyzer, node: ast.AST) -> bool:
    """The comparison scales or selects loss weights: inside a product / where, or assigned to a weight-ish name."""
    current = an.parents.get(node)
    while current is not None and not isinstance(current, ast.stmt):
        if isinstance(current, ast.BinOp) and isinstance(current.op, (ast.Mult, ast.BitAnd)):
            return True
        if isinstance(current, ast.Call) and call_name(current) in {"where", "masked_fill", "mul", "logical_and"}:
            return True
        current = an.parents.get(current)
    if isinstance(current, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = current.targets if isinstance(current, ast.Assign) else [current.target]
        return any(set(tokens(leaf_name(t))) & WEIGHTISH_TOKENS for t in targets)
    return False


def _arange_or_range_start(an: Analyzer, call: ast.Call) -> int | None:
    if hasattr(call, "range_start"):  # a loop variable over range(start, stop)
        start = call.range_start  # type: ignore[attr-defined]
        value = const_number(start) if start is not None else 0
        return int(value) if value is not None else None
    return an.arange_start(call)


def _slot_start(an: Analyzer, node: ast.AST) -> int | None:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and call_name(sub) == "arange":
            return _arange_or_range_start(an, sub)
        if isinstance(sub, ast.Name):
            found = an.defs_of(sub)
            if found and found[0]:
                for d in found[0]:
                    for inner in ast.walk(d):
                        if isinstance(inner, ast.Call) and call_name(inner) == "arange":
                            return _arange_or_range_start(an, inner)
                        if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Mod):
                            return 0
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mod):
            return 0
    return None


def _in_loss_context(an: Analyzer, node: ast.AST) -> bool:
    func = an.outermost_function(node)
    if func is None:
        return True
    key = ("loss", id(func))
    if key not in an._cache:
        text = ast.get_source_segment(an.unit(node).text, func) or ""
        cls = an.enclosing(func, (ast.ClassDef,))
        if cls is not None:  # e.g. weights built in __init__ and used by the class's loss method
            text += ast.get_source_segment(an.unit(node).text, cls) or ""
        an._cache[key] = bool(re.search(r"loss|weight|decay|gamma|objective|label|target", text, re.I))
    return an._cache[key]


@detector("dflash.loss_kind")
def detect_loss_kind(an: Analyzer) -> list[CodeReading]:
    readings = []
    for node in nodes_of(an, ast.Call):
        name = call_name(node)
        value = None
        if name in {"cross_entropy", "nll_loss", "CrossEntropyLoss", "NLLLoss"}:
            value = "ce"
            target = node.args[1] if len(node.args) >= 2 else kwarg(node, "target")
            if target is not None and any(isinstance(n, ast.Call) and call_name(n) == "argmax" for n in ast.walk(target)):
                value = "ce"
            elif target is not None and set(tokens(leaf_name(target))) & {"ids", "tokens", "labels", "input"}:
                value = "ce (data tokens)"
                found = an.defs_of(target) if isinstance(target, (ast.Name, ast.Attribute)) else None
                if found and any(isinstance(n, ast.Call) and call_name(n) == "argmax" for d in found[0] for n in ast.walk(d)):
                    value = "ce"
        elif name in {"kl_div", "KLDivLoss"}:
            value = "kl"
        elif name in {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "MSELoss", "cosine_similarity"}:
            if not _in_loss_context(an, node):
                continue
            value = f"regression ({name})"
        if value is None:
            continue
        switch = an.switch_of(node)
        readings.append(reading_at(an, "dflash.loss_kind", value, node, 0.7, mode="switch" if switch else "hardcoded",
                                 switch=switch, detail=f"{name}(...)"))
    readings += _squared_errors(an)
    # other algorithms' losses say nothing about DFlash's (and must not hide a regression term in it)
    readings = [r for r in readings if not (in_variant_file(r.path) or VARIANT_PATTERN.search(r.scope or ""))]
    readings = _chosen_from_registry(an, readings)
    # an auxiliary regression term beside a CE/KL objective does not change the loss kind
    if any(r.value in ("ce", "kl", "ce (data tokens)") and r.mode == "hardcoded" for r in readings):
        readings = [r for r in readings if not str(r.value).startswith("regression")]
    # hand-written: -log_softmax(draft).gather(argmax(target)) is CE; softmax * (logp - logq) is KL
    for node in nodes_of(an, ast.FunctionDef):
        if not re.search(r"loss", node.name, re.I):
            continue
        calls = {call_name(c) for c in ast.walk(node) if isinstance(c, ast.Call)}
        if "log_softmax" in calls and not any(r.path == an.unit(node).path and node.lineno <= r.line <= (node.end_lineno or r.line) for r in readings):
            branches = [n for n in ast.walk(node) if isinstance(n, ast.If)]
            switch = ast.unparse(branches[0].test) if branches and "argmax" in calls else None
            if "argmax" in calls and calls & {"gather", "take_along_axis", "take_along_dim", "take"}:
                readings.append(reading_at(an, "dflash.loss_kind", "ce", node, 0.55, mode="switch" if switch else "hardcoded",
                                         switch=switch, detail=f"{node.name}: -log_softmax gathered at the target argmax"))
    return readings


def _squared_errors(an: Analyzer) -> list[CodeReading]:
    """A hand-written squared error between two tensors (`(a - b).pow(2)`, `(a - b) ** 2`, `square(a - b)`) as
    the body of a loss: a regression, not CE / KL. A variance (`x - x.mean()`) is not one."""
    readings = []
    for node in nodes_of(an, (ast.BinOp, ast.Call)):
        if isinstance(node, ast.BinOp):
            base = node.left if isinstance(node.op, ast.Pow) and const_number(node.right) == 2 else None
        elif call_name(node) == "pow" and isinstance(node.func, ast.Attribute) and node.args and const_number(node.args[0]) == 2:
            base = node.func.value
        elif call_name(node) == "square":
            base = node.func.value if isinstance(node.func, ast.Attribute) and not is_module_name(node.func.value) else (node.args[0] if node.args else None)
        else:
            base = None
        if not (isinstance(base, ast.BinOp) and isinstance(base.op, ast.Sub)):
            continue
        if any(isinstance(n, ast.Call) and call_name(n) in {"mean", "var", "std"} for side in (base.left, base.right) for n in ast.walk(side)):
            continue  # x - x.mean(): a variance or a norm, not an objective
        holder = an.enclosing(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef))
        if holder is None or in_variant_code(an, node):
            continue
        is_loss = isinstance(holder, ast.Lambda) and _lambda_is_loss_term(an, holder) or (
            isinstance(holder, (ast.FunctionDef, ast.AsyncFunctionDef)) and re.search(r"loss|objective|criterion", holder.name, re.I))
        if not is_loss:
            continue
        switch = an.switch_of(node)
        readings.append(reading_at(an, "dflash.loss_kind", "regression (squared error)", node, 0.7,
                                   mode="switch" if switch else "hardcoded", switch=switch,
                                   detail=f"`{ast.unparse(node)[:60]}`: a squared error, not CE / KL"))
    return readings


def _lambda_is_loss_term(an: Analyzer, lam: ast.Lambda) -> bool:
    """A lambda stored as a loss term: a value of a loss-config mapping (`{"name": (fn, weight)}`), or bound to
    a name / keyword / parameter about a loss."""
    current = an.parents.get(lam)
    while isinstance(current, (ast.Tuple, ast.List)):
        current = an.parents.get(current)
    if isinstance(current, ast.Dict):
        holder = an.parents.get(current)
        names = [ast.unparse(t) for t in getattr(holder, "targets", [])] + [ast.unparse(getattr(holder, "target", ast.Pass()))]
        return any(re.search(r"loss|objective|criterion", n, re.I) for n in names)
    if isinstance(current, ast.keyword):
        return bool(current.arg and re.search(r"loss|objective|criterion", current.arg, re.I))
    if isinstance(current, (ast.Assign, ast.AnnAssign)):
        targets = current.targets if isinstance(current, ast.Assign) else [current.target]
        return any(re.search(r"loss|objective|criterion", ast.unparse(t), re.I) for t in targets)
    return False


def _registry_choice(an: Analyzer, func: ast.AST, depth: int = 0) -> str | None:
    """When a loss function is used only as one entry of a mapping with several (`{"kl_div": kl, "ce": ce}`, a
    loss picked by name at run time), the mapping's name; None when it is called or bound on its own somewhere
    (or nothing refers to it: a library function)."""
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or depth > 3:
        return None
    refs = [r for r in _references(an, func.name)
            if an.enclosing_function(r) is not func and _refers_to(an, r, func) and not in_variant_code(an, r)]
    if not refs:
        return None
    chosen_from = None
    for ref in refs:
        container = an.parents.get(ref)
        while isinstance(container, (ast.Tuple, ast.List)):
            container = an.parents.get(container)
        if isinstance(container, ast.Dict) and len(container.keys) >= 2:
            holder = an.parents.get(container)
            chosen_from = ast.unparse(holder.targets[0]) if isinstance(holder, ast.Assign) else (
                ast.unparse(holder.target) if isinstance(holder, ast.AnnAssign) else "a mapping of losses")
            continue
        caller = an.outermost_function(ref)
        inner = _registry_choice(an, caller, depth + 1) if caller is not None else None
        if inner is None:
            return None
        chosen_from = inner
    return chosen_from


def _chosen_from_registry(an: Analyzer, readings: list[CodeReading]) -> list[CodeReading]:
    """Readings inside loss functions that the code picks by name at run time become switch readings."""
    out = []
    for r in readings:
        func = _function_at(an, r.path, r.line)
        registry = _registry_choice(an, func) if func is not None and r.mode == "hardcoded" else None
        if registry is not None:
            r = replace(r, mode="switch", switch=f"{registry}[...]",
                        detail=f"{r.detail} in `{func.name}`, one of the losses `{registry}` picks by name at run time")
        out.append(r)
    return out


EMBED_SOURCES = {"get_input_embeddings", "embed_tokens", "Embedding", "wte", "tok_embeddings", "embed_in", "word_embeddings"}
HEAD_SOURCES = {"get_output_embeddings", "lm_head", "embed_out", "output_layer"}
HEAD_ATTR = re.compile(r"head|unembed|vocab_proj|output_proj", re.I)


def _freeze_sites(an: Analyzer) -> list[tuple[ast.AST, str]]:
    """Every statement that freezes something, with the expression it freezes. A loop variable stands for
    what it iterates (`for t in (self.embed, self.head): t.weight.requires_grad = False`); a loop over
    `named_parameters()` filtered by name prefixes freezes `self.<prefix>` for each prefix."""
    sites: list[tuple[ast.AST, str]] = []

    def owners(node: ast.AST, receiver: ast.expr) -> list[str]:
        text = ast.unparse(receiver)
        root = receiver
        while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
            root = root.value if not isinstance(root, ast.Call) else root.func
        loop = an.enclosing(node, (ast.For,))
        if isinstance(loop, ast.For) and isinstance(root, ast.Name) and any(
                isinstance(n, ast.Name) and n.id == root.id for n in ast.walk(loop.target)):
            prefixes = _name_prefixes(an, node, loop)
            if prefixes:
                return [f"self.{p}" for p in prefixes]
            return [ast.unparse(loop.iter)]
        return [text]

    for node in nodes_of(an, ast.Call):
        if call_name(node) == "requires_grad_" and node.args and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value is False and isinstance(node.func, ast.Attribute):
            sites += [(node, o) for o in owners(node, node.func.value)]
            holder = an.parents.get(node)
            if isinstance(holder, ast.Assign) and len(holder.targets) == 1:
                sites.append((node, ast.unparse(holder.targets[0])))  # self.verifier = verifier.requires_grad_(False)
    for node in nodes_of(an, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Attribute) and target.attr == "requires_grad" and isinstance(node.value, ast.Constant) \
                    and node.value.value is False:
                sites += [(node, o) for o in owners(node, target.value)]
            # a tensor made frozen where it is bound: `self.head.weight = nn.Parameter(w.clone(), requires_grad=False)`
            value = node.value
            if isinstance(value, ast.Call) and any(
                    k.arg == "requires_grad" and isinstance(k.value, ast.Constant) and k.value.value is False
                    for k in value.keywords):
                sites += [(node, o) for o in owners(node, target)]
    return sites


def _name_prefixes(an: Analyzer, node: ast.AST, loop: ast.For) -> list[str]:
    """`for name, p in m.named_parameters(): if name.startswith(PREFIXES): p.requires_grad_(False)`: the
    module names the prefixes select (string constants, or a name bound to a tuple of them)."""
    if not (isinstance(loop.iter, ast.Call) and call_name(loop.iter) == "named_parameters"):
        return []
    branch = an.enclosing(node, (ast.If,))
    if branch is None or an.enclosing(branch, (ast.For,)) is not loop:
        return []
    out: list[str] = []
    for call in ast.walk(branch.test):
        if isinstance(call, ast.Call) and call_name(call) == "startswith" and call.args:
            arg = call.args[0]
            values = [arg]
            if isinstance(arg, ast.Name):
                found = an.defs_of(arg)
                values = found[0][-1:] if found and found[0] else []
            for value in values:
                elements = value.elts if isinstance(value, (ast.Tuple, ast.List)) else [value]
                out += [e.value.rstrip(".") for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return out


def _component_holders(an: Analyzer) -> list[tuple[str, str, ast.Assign, str]]:
    """`self.X = <embedding or head>` inside a module class: (kind, attr, statement, source expression).

    Such an attribute is a registered submodule: its weights are among the drafter's parameters, trained
    unless something freezes that very object (or the whole model it was taken from)."""
    out: list[tuple[str, str, ast.Assign, str]] = []
    for node in nodes_of(an, ast.Assign):
        if len(node.targets) != 1:
            continue
        target = node.targets[0]
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"):
            continue
        if an.enclosing(node, (ast.ClassDef,)) is None:
            continue
        value = node.value
        leaf = leaf_name(value)
        if isinstance(value, ast.Call) and leaf == "Linear" and HEAD_ATTR.search(target.attr):
            out.append(("lm_head", target.attr, node, ast.unparse(value)))
        elif leaf in EMBED_SOURCES:
            out.append(("embeddings", target.attr, node, ast.unparse(value)))
        elif leaf in HEAD_SOURCES:
            out.append(("lm_head", target.attr, node, ast.unparse(value)))
    return out


def trains(an: Analyzer) -> bool:
    """Whether the analysed code trains anything (a backward pass, an optimizer step, a trainer class): the
    all-sites rules about what is trained only apply on a training path."""
    def compute() -> bool:
        for node in nodes_of(an, ast.Call):
            if call_name(node) in {"backward", "value_and_grad", "zero_grad", "training_step", "manual_backward"}:
                return True
        for node in nodes_of(an, ast.ClassDef):
            if any(re.search(r"Trainer|LightningModule", ast.unparse(b)) for b in node.bases):
                return True
        return any(re.fullmatch(r"training_step|compute_loss|train_step", f.name) for f in nodes_of(an, ast.FunctionDef))
    return an.memo("trains", compute)


def _freezes_instance_of(an: Analyzer, node: ast.AST, owner: str, cls: ast.ClassDef) -> bool:
    """Whether a freeze of `owner` freezes a whole instance of `cls` (so every submodule it holds)."""
    root = owner.split(".")[0].split("(")[0]
    inside = an.enclosing(node, (ast.ClassDef,)) is cls
    if owner == "self" and inside:
        return True
    receiver = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
    while isinstance(receiver, (ast.Attribute, ast.Call)):
        receiver = receiver.value if isinstance(receiver, ast.Attribute) else receiver.func
    if not isinstance(receiver, ast.Name) or receiver.id != root:
        return False
    found = an.defs_of(receiver)
    for definition in (found[0] if found else []):
        if isinstance(definition, ast.Call):
            callee = call_name(definition)
            if callee == cls.name or (callee == "cls" and inside) or (
                    callee == "from_pretrained" and leaf_name(getattr(definition.func, "value", None) or definition.func) == cls.name):
                return True
    return False


def _whole_object(text: str) -> str:
    """The object a freeze applies to, without mode calls: `teacher.eval()` -> `teacher`; `x.parameters()` -> `x`."""
    return re.sub(r"\.(eval|train|to|cuda|cpu|float|half|bfloat16|parameters|requires_grad_)\([^()]*\)", "", text)


def _root_object(text: str) -> str:
    """`self.target.get_output_embeddings()` -> `self.target`; `teacher.eval()` -> `teacher`."""
    text = re.sub(r"\.(eval|train|to|cuda|cpu|float|half|bfloat16|requires_grad_)\([^()]*\)", "", text)
    parts = text.split(".")
    keep = 2 if parts[0] == "self" and len(parts) > 1 else 1
    return ".".join(parts[:keep])


@detector("dflash.frozen_embed_head")
def detect_frozen_embed_head(an: Analyzer) -> list[CodeReading]:
    """All sites must agree: every embedding / lm_head the drafter holds as a submodule is frozen at its own
    object (or through the whole model it came from); one unfrozen holder is `trained` at its location.
    When the drafter holds none, the target's own embedding / head used in place counts (shared, frozen)."""
    readings = []
    freezes = _freeze_sites(an)
    holders = _component_holders(an)
    for kind, attr, stmt, source in holders:
        # the holder's own object, reached through any instance (`self.lm_head`, `model.lm_head.weight`)
        own = re.compile(rf"(^|\.){re.escape(attr)}(\.|$|\b)")
        root = _root_object(source)
        # or the whole model it was taken from (`teacher.eval().requires_grad_(False)`), not a sibling of it
        covering = [(n, o) for n, o in freezes
                    if own.search(o) or (root not in {"self", ""} and _whole_object(o) == root)]
        cls = an.enclosing(stmt, (ast.ClassDef,))
        if not covering and isinstance(cls, ast.ClassDef):
            # the whole module frozen: `instance = cls(config); instance.requires_grad_(False)`, `self.requires_grad_(False)`
            covering = [(n, o) for n, o in freezes if _freezes_instance_of(an, n, o, cls)]
        if covering:
            node, owner = covering[0]
            readings.append(reading_at(an, "dflash.frozen_embed_head", "frozen", node, 0.7,
                                     detail=f"the drafter's {kind} `self.{attr}` is frozen here ({owner})"))
        elif not trains(an) and not re.match(r"(nn\.)?(Embedding|Linear)\(", source):
            # inference-only code binding the target's own modules (z-lab's MLX drafter): nothing is trained
            # here. A freshly built Embedding / Linear is wrong either way: trained, or random at inference.
            readings.append(reading_at(an, "dflash.frozen_embed_head", "frozen?", stmt, 0.5,
                                       detail=f"the drafter holds the {kind} `self.{attr}`; no training step in the code"))
        else:
            readings.append(reading_at(an, "dflash.frozen_embed_head", "trained", stmt, 0.75,
                                     detail=f"the drafter holds the {kind} `self.{attr}` = {source[:60]} as a submodule "
                                            "(its weights join the drafter's parameters) and nothing freezes it"))
    if holders:
        if any(r.value == "trained" for r in readings):
            return readings
        if any(r.value == "frozen?" for r in readings):
            # a held module whose freezing is undecided: the rule is about every one, so no match
            return [r for r in readings if r.value == "frozen?"]
        missing = {"embeddings", "lm_head"} - {kind for kind, *_ in holders}
        shared = [r for kind, r in _shared_uses(an) if kind in missing]
        if missing and not {kind for kind, _ in _shared_uses(an)} >= missing:
            # One component held and frozen, the other not seen: the rule is about both, so no match.
            return [reading_at(an, "dflash.frozen_embed_head", "frozen?", holders[0][2], 0.7,
                             detail=f"the {holders[0][0]} is frozen; where the drafter's {' and '.join(sorted(missing))} "
                                    "comes from is not seen")]
        return readings + shared
    readings += [r for _, r in _shared_uses(an)]
    for node, owner in freezes:
        if re.search(r"embed|lm_head|head", owner, re.I):
            readings.append(reading_at(an, "dflash.frozen_embed_head", "frozen", node, 0.7, detail=f"{owner}: requires_grad False"))
    if not readings:
        # a drafter class that builds its own embedding / vocab head and never freezes it
        for node in nodes_of(an, ast.Call):
            if call_name(node) == "Embedding" and in_draft_class(an, node):
                parent = an.parents.get(node)
                attr = leaf_name(parent.targets[0]) if isinstance(parent, ast.Assign) else ""
                cls = an.enclosing(node, (ast.ClassDef,))
                text = ast.get_source_segment(an.unit(node).text, cls) if cls is not None else ""
                if attr and text and not re.search(rf"{re.escape(attr)}[\w.]*\.(requires_grad|load_state_dict|weight\.data\.copy_|from_pretrained)", text):
                    readings.append(reading_at(an, "dflash.frozen_embed_head", "trained", node, 0.55,
                                             detail=f"the drafter owns a trainable embedding `{attr}` (never frozen or copied from the target)"))
    return readings


def _shared_uses(an: Analyzer) -> list[tuple[str, CodeReading]]:
    """The target's own embedding / head applied in place (not held by the drafter): shared, not trained."""
    readings: list[tuple[str, CodeReading]] = []
    for node in nodes_of(an, ast.Call):
        if isinstance(node.func, ast.Attribute):
            owner_toks = set(tokens(leaf_name(node.func.value)))
            attr = node.func.attr.lower()
            if owner_toks & {"target", "teacher", "verifier", "base"} and attr in {
                    "embed", "embed_tokens", "lm_head", "logits", "get_input_embeddings", "get_output_embeddings"}:
                kind = "embeddings" if "embed" in attr and "output" not in attr else "lm_head"
                readings.append((kind, reading_at(an, "dflash.frozen_embed_head", "frozen", node, 0.65,
                                                detail=f"uses the target's own {node.func.attr} (shared, not a drafter parameter)")))
    return readings


def _anchor_producers(an: Analyzer) -> set[str]:
    """Names of local functions whose result is bound to an anchor name: `anchors = self._sample(mask)`."""
    out: set[str] = set()
    for node in nodes_of(an, ast.Assign):
        if isinstance(node.value, ast.Call) and any("anchor" in name_tags(leaf_name(t)) for t in node.targets):
            out.add(call_name(node.value))
    return out


@detector("dflash.anchor_sampling")
def detect_anchor_sampling(an: Analyzer) -> list[CodeReading]:
    readings = []
    producers = _anchor_producers(an)
    for node in nodes_of(an, ast.Call):
        name = call_name(node)
        func = an.enclosing_function(node)
        parent = an.parents.get(node)
        while parent is not None and not isinstance(parent, ast.stmt):
            parent = an.parents.get(parent)
        assigned = [leaf_name(t) for t in getattr(parent, "targets", [])]
        in_anchor_code = (func is not None and (set(tokens(func.name)) & (ANCHOR_TOKENS | {"anchor"}) or func.name in producers)) or any(
            "anchor" in name_tags(n) for n in assigned) or _helper_of_anchor_code(an, func, producers)
        if not in_anchor_code:
            continue
        replace = kwarg(node, "replace")
        stdlib_random = isinstance(node.func, ast.Attribute) and leaf_name(node.func.value) in {"random", "rng", "generator", "gen"}
        if name == "randperm" or (name == "multinomial" and not _const_true(kwarg(node, "replacement"))) or (
            name == "sample" and stdlib_random) or (  # random.sample: without replacement
            name in {"choice", "permutation"} and isinstance(replace, ast.Constant) and replace.value is False) or (
            name == "permutation" and replace is None) or (
            name in {"argsort", "topk"} and _uses_uniform_noise(an, node)
        ):
            value, why = _candidate_set(an, node)
            readings.append(reading_at(an, "dflash.anchor_sampling", value, node, 0.7 if value != "uniform without replacement" or why else 0.6,
                                     detail=f"anchors drawn with {name}" + (f" ({why})" if why else "")))
        elif name in {"randint", "randint_like"} or (name == "multinomial" and _const_true(kwarg(node, "replacement"))) or (
                name == "choices" and stdlib_random) or (
                name == "choice" and (len(node.args) >= 2 or kwarg(node, "size") is not None or kwarg(node, "shape") is not None)
                and (replace is None or _const_true(replace))):  # numpy/jax choice replaces by default
            readings.append(reading_at(an, "dflash.anchor_sampling", "with replacement", node, 0.7,
                                     detail=f"anchors drawn with {name}: duplicates possible, not the reference rule"))
    return readings


def _helper_of_anchor_code(an: Analyzer, func: ast.AST | None, producers: set[str]) -> bool:
    """A helper the anchor sampler calls to draw its indices (`candidates[choose(n, k, gen)]`): its draw is the
    anchors' draw, whatever the helper is called."""
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    for call in an.calls_named(func.name):
        caller = an.enclosing_function(call)
        if isinstance(caller, (ast.FunctionDef, ast.AsyncFunctionDef)) and caller is not func and (
                set(tokens(caller.name)) & (ANCHOR_TOKENS | {"anchor"}) or caller.name in producers):
            return True
    return False


def _uses_uniform_noise(an: Analyzer, node: ast.Call) -> bool:
    """argsort / topk of uniform noise is a uniform sample without replacement."""
    def noisy(expr: ast.AST) -> bool:
        return any(isinstance(n, ast.Call) and call_name(n) in {"rand", "rand_like", "random", "uniform"} for n in ast.walk(expr))
    if noisy(node):
        return True
    receiver = node.func.value if isinstance(node.func, ast.Attribute) else (node.args[0] if node.args else None)
    if isinstance(receiver, ast.Name):
        found = an.defs_of(receiver)
        return bool(found and any(noisy(d) for d in found[0]))
    return False


def _const_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


# --- the candidate set anchors are drawn from ----------------------------------------------------------

# Calls that only shape or compare a mask: a construction made of these is fully seen.
_MASK_OPS = {"bool", "clone", "float", "int", "long", "to", "squeeze", "unsqueeze", "view", "reshape", "flatten",
             "nonzero", "argwhere", "flatnonzero", "where", "max", "min", "clamp", "clip", "logical_and", "logical_not",
             "ones", "ones_like", "new_ones", "full", "full_like", "zeros", "zeros_like", "numel", "size", "contiguous",
             "set", "gt", "ge", "lt", "le", "ne", "eq", "detach", "cpu", "any", "all", "expand", "expand_as", "int"}
_ALL_TRUE = {"ones", "ones_like", "new_ones", "full", "full_like"}
_NOISE = {"rand", "rand_like", "uniform", "random", "normal", "randn", "randn_like"}


def _candidate_set(an: Analyzer, sampler: ast.Call) -> tuple[str, str]:
    """What a without-replacement sampler draws from: (value, why). The value stays
    "uniform without replacement" unless the candidate set is traced and shows a filter missing: no loss
    mask between the sequence and the sampler, or nothing keeping anchors out of the last positions."""
    func = an.enclosing_function(sampler)
    mask, unfiltered = _sampled_mask(an, sampler)
    if unfiltered:
        return "uniform over every position (loss mask ignored)", unfiltered
    if mask is None or func is None:
        return "uniform without replacement", ""
    exprs, complete = _mask_construction(an, mask, func)
    loss = any(_is_loss_mask_name(n) for e in exprs for n in _mask_leaves(e))
    tail = any(_excludes_tail(an, e) for e in exprs)
    all_true = any(isinstance(n, ast.Call) and call_name(n) in _ALL_TRUE for e in exprs for n in ast.walk(e))
    if complete and not loss and all_true:
        return ("uniform over every position (loss mask ignored)",
                f"the candidate mask `{ast.unparse(mask)[:40]}` is built without the loss mask")
    if complete and loss and not tail:
        return ("uniform without replacement, last B positions not excluded",
                f"the candidate mask `{ast.unparse(mask)[:40]}` keeps the last positions: their blocks run off the sequence")
    if complete:
        return "uniform without replacement", "over the loss mask, the last positions cut off"
    return "uniform without replacement", ""


def _sampled_mask(an: Analyzer, sampler: ast.Call) -> tuple[ast.expr | None, str]:
    """The boolean mask whose positions the sampler permutes, or (None, why) when the sampler permutes noise
    that nothing masks (every position is a candidate)."""
    name = call_name(sampler)
    if name == "randperm" and sampler.args:
        counted = _counted(sampler.args[0])
        for definition in _definitions(an, counted):
            for sub in ast.walk(definition):
                if isinstance(sub, ast.Call) and call_name(sub) in {"nonzero", "argwhere", "flatnonzero", "where"}:
                    inner = sub.func.value if isinstance(sub.func, ast.Attribute) and not is_module_name(sub.func.value) else (sub.args[0] if sub.args else None)
                    if inner is not None:
                        return inner, ""
        return None, ""
    if name in {"argsort", "topk"}:
        scores = sampler.func.value if isinstance(sampler.func, ast.Attribute) and not is_module_name(sampler.func.value) else (sampler.args[0] if sampler.args else None)
        while isinstance(scores, ast.UnaryOp):
            scores = scores.operand
        if not isinstance(scores, ast.Name):
            return None, ""
        func = an.enclosing_function(sampler)
        for definition in _definitions(an, scores):
            for sub in ast.walk(definition):
                if isinstance(sub, ast.Call) and call_name(sub) == "where" and sub.args:
                    return sub.args[0], ""
        for call in nodes_of(an, ast.Call):
            if call_name(call) in {"masked_fill_", "masked_fill"} and isinstance(call.func, ast.Attribute) and call.args \
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == scores.id \
                    and an.enclosing_function(call) is func:
                excluded = call.args[0]
                return (excluded.operand if isinstance(excluded, ast.UnaryOp) else excluded), ""
        definitions = _definitions(an, scores)
        if definitions and all(isinstance(d, ast.Call) and call_name(d) in _NOISE for d in definitions):
            return None, f"`{scores.id}` is uniform noise over every position and nothing masks it before the {name}"
    return None, ""


def _counted(node: ast.expr) -> ast.expr | None:
    """`x.numel()`, `len(x)`, `x.shape[0]`, `x.size(0)` -> x."""
    if isinstance(node, ast.Call):
        if call_name(node) in {"numel", "size"} and isinstance(node.func, ast.Attribute):
            return node.func.value
        if call_name(node) == "len" and node.args:
            return node.args[0]
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
        return node.value.value
    return None


def _definitions(an: Analyzer, node: ast.expr | None) -> list[ast.expr]:
    if node is None:
        return []
    if isinstance(node, (ast.Name, ast.Attribute)):
        found = an.defs_of(node)
        return list(found[0]) if found and found[0] else []
    return [node]


def _mask_construction(an: Analyzer, mask: ast.expr, func: ast.AST) -> tuple[list[ast.expr], bool]:
    """Every expression that builds the mask inside `func`: its definitions (through names, a few deep) and
    the stores into it (`m[:, -B:] = False`). Complete when every name resolves there (or is a parameter) and
    every call only shapes or compares."""
    exprs: list[ast.expr] = []
    complete = True
    pending = [mask]
    seen: set[str] = set()
    while pending and len(exprs) < 24:
        expr = pending.pop()
        exprs.append(expr)
        for sub in ast.walk(expr):
            if isinstance(sub, ast.Call):
                if call_name(sub) in _ALL_TRUE:
                    continue
                if call_name(sub) not in _MASK_OPS:
                    complete = False
            if isinstance(sub, ast.Name) and sub.id not in seen and isinstance(sub.ctx, ast.Load) and not is_module_name(sub):
                if _inside_shape_argument(an, sub, expr):
                    continue
                seen.add(sub.id)
                found = an.defs_of(sub)
                if found is None:
                    complete = False
                    continue
                definitions, scope = found
                # a parameter: what its callers pass (a neutral name like `valid` may be the loss mask)
                pending += definitions[-3:] if definitions else an.parameter_arguments(sub)[:3]
                # stores into it: m[...] = v, m.at[...].set(v) results are definitions already
                for stmt in nodes_of(an, ast.Assign):
                    if an.enclosing_function(stmt) is func and any(
                            isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == sub.id for t in stmt.targets):
                        exprs.append(stmt.targets[0])
    return exprs, complete


def _inside_shape_argument(an: Analyzer, name: ast.Name, root: ast.expr) -> bool:
    """`ones_like(loss_mask)`: the argument gives a shape, not a filter."""
    current = an.parents.get(name)
    while current is not None and current is not root:
        if isinstance(current, ast.Call) and call_name(current) in _ALL_TRUE:
            return True
        current = an.parents.get(current)
    return isinstance(current, ast.Call) and call_name(current) in _ALL_TRUE and current is not name


def _mask_leaves(expr: ast.expr) -> list[str]:
    """The names a mask expression reads, leaving out what only gives a shape (`ones_like(loss_mask)`)."""
    out: list[str] = []
    pending = [expr]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Call) and call_name(node) in _ALL_TRUE:
            continue
        if isinstance(node, (ast.Name, ast.Attribute)):
            out.append(leaf_name(node))
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            out.append(node.slice.value)  # batch["loss_mask"]
        pending.extend(ast.iter_child_nodes(node))
    return out


def _is_loss_mask_name(name: str) -> bool:
    toks = set(tokens(name))
    return bool(({"loss", "mask"} <= toks) or toks & {"labels", "label", "supervised", "trainable"} or name in {"lm", "lmask"})


def _excludes_tail(an: Analyzer, expr: ast.expr) -> bool:
    """A cut at the sequence's end: a store or slice from a negative start (`m[:, -B:]`), a slice or `.at[]`
    ending at `S - x`, or a bound that is one (`n = max(S - 1, 0)`; `m[:n]`)."""
    for sub in ast.walk(expr):
        if isinstance(sub, ast.Slice):
            if isinstance(sub.lower, ast.UnaryOp) and isinstance(sub.lower.op, ast.USub):
                return True
            for bound in (sub.lower, sub.upper):
                if bound is not None and _is_end_minus(an, bound):
                    return True
    return False


def _is_end_minus(an: Analyzer, node: ast.expr, depth: int = 0) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub):
        return True
    if isinstance(node, ast.Call) and call_name(node) in {"max", "min"} and depth < 3:
        return any(_is_end_minus(an, a, depth + 1) for a in node.args)
    if isinstance(node, ast.Name) and depth < 3:
        return any(_is_end_minus(an, d, depth + 1) for d in _definitions(an, node))
    return False
