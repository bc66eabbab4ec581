"""Target layer selection, read by evaluating the selection function with a tiny interpreter (never exec)."""

from __future__ import annotations

import ast
import math

from sleuth.evidence.ast_index import (
    Analyzer,
    CodeReading,
    call_name,
    const_number,
    nodes_of,
    reading_at,
)
from sleuth.evidence.origins import is_layer_tuple, produced_by
from sleuth.evidence.registry import detector


# --- target layer ids: a tiny interpreter for the selection function ----------------------------------


class _EvalError(Exception):
    pass


def _interpret(func: ast.FunctionDef, args: dict[str, object]) -> object:
    """Evaluate a small pure function (arithmetic, if/return, comprehensions, round/int/len/range)."""
    env = dict(args)
    budget = [2000]

    def ev(node: ast.AST) -> object:
        budget[0] -= 1
        if budget[0] < 0:
            raise _EvalError("budget")
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool, type(None))):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            raise _EvalError(node.id)
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b, ast.Div: lambda: a / b,
                   ast.FloorDiv: lambda: a // b, ast.Mod: lambda: a % b}
            if type(node.op) not in ops:
                raise _EvalError("op")
            try:
                return ops[type(node.op)]()
            except (TypeError, ZeroDivisionError) as exc:
                raise _EvalError(str(exc)) from None
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            a, b = ev(node.left), ev(node.comparators[0])
            table = {ast.Eq: a == b, ast.NotEq: a != b, ast.Lt: a < b, ast.LtE: a <= b, ast.Gt: a > b, ast.GtE: a >= b}
            return table[type(node.ops[0])] if type(node.ops[0]) in table else _raise()
        if isinstance(node, ast.IfExp):
            return ev(node.body) if ev(node.test) else ev(node.orelse)
        if isinstance(node, (ast.List, ast.Tuple)):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            fn = {"round": round, "int": int, "len": len, "range": range, "list": list, "min": min, "max": max,
                  "float": float, "abs": abs, "sorted": sorted}.get(node.func.id)
            if fn is None:
                raise _EvalError(node.func.id)
            return fn(*[ev(a) for a in node.args])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in {"floor", "ceil"} and isinstance(node.func.value, ast.Name) and node.func.value.id == "math":
            return getattr(math, node.func.attr)(ev(node.args[0]))
        if isinstance(node, ast.ListComp) and len(node.generators) == 1 and isinstance(node.generators[0].target, ast.Name):
            gen = node.generators[0]
            out = []
            for item in list(ev(gen.iter)):
                env[gen.target.id] = item
                if all(ev(c) for c in gen.ifs):
                    out.append(ev(node.elt))
            return out
        if isinstance(node, ast.Subscript):
            seq = ev(node.value)
            if isinstance(node.slice, ast.Slice):
                s = node.slice
                return seq[slice(ev(s.lower) if s.lower else None, ev(s.upper) if s.upper else None)]
            return seq[ev(node.slice)]
        raise _EvalError(type(node).__name__)

    def run(body: list[ast.stmt]) -> tuple[bool, object]:
        for stmt in body:
            if isinstance(stmt, ast.Return):
                return True, ev(stmt.value) if stmt.value is not None else None
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                env[stmt.targets[0].id] = ev(stmt.value)
            elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple):
                values = ev(stmt.value)
                names = stmt.targets[0].elts
                if not isinstance(values, list) or len(values) != len(names) or not all(isinstance(n, ast.Name) for n in names):
                    raise _EvalError("unpack")
                for n, v in zip(names, values):
                    env[n.id] = v
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                env[stmt.target.id] = ev(stmt.value)
            elif isinstance(stmt, ast.If):
                done, value = run(stmt.body if ev(stmt.test) else stmt.orelse)
                if done:
                    return done, value
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                continue  # docstring
            elif isinstance(stmt, ast.Raise):
                raise _EvalError("raise")
            else:
                raise _EvalError(type(stmt).__name__)
        return False, None

    _, value = run(func.body)
    return value


def _raise() -> object:
    raise _EvalError("compare")


@detector("dflash.target_layer_ids")
def detect_target_layer_ids(an: Analyzer) -> list[CodeReading]:
    from sleuth.oracle import speculators_default_layer_ids, target_layer_ids

    readings = []
    rule_functions: set[str] = set()
    for func_list in an.functions.values():
        for func, scope in func_list:
            params = [a.arg for a in func.args.args if a.arg not in {"self", "cls"}]
            if "layer" not in func.name.lower() or not 1 <= len(params) <= 3:
                continue
            results = []
            orders = [params[:2], params[:2][::-1]] if len(params) >= 2 else [params]
            for order in orders:
                ok = True
                produced = []
                for depth, k in ((36, 5), (64, 5), (28, 3), (36, 1)):
                    values = dict(zip(order, (depth, k)))
                    for extra in params[len(order):]:
                        default = scope.params.get(extra)
                        if default is None:
                            ok = False
                            break
                        values[extra] = an.literal(default)
                    if not ok:
                        break
                    try:
                        result = _interpret(func, values)
                    except (_EvalError, TypeError, IndexError, KeyError, ValueError, RecursionError):
                        ok = False
                        break
                    if not isinstance(result, list) or not all(isinstance(x, int) for x in result):
                        ok = False
                        break
                    produced.append((depth, k, result))
                if ok:
                    results.append(produced)
            if not results:
                continue
            best = None
            for produced in results:
                if all(r == target_layer_ids(d, k) for d, k, r in produced):
                    best = ("evenly-1-to-L-3", produced)
                    break
            if best is None:
                produced = results[0]
                if all(r == speculators_default_layer_ids(d) for d, k, r in produced if k != 1):
                    best = ("[2, L//2, L-3] (vLLM convention)", produced)
                else:
                    sample = produced[0]
                    best = (f"other: L={sample[0]}, k={sample[1]} -> {sample[2]}", produced)
            value, produced = best
            sample = produced[0]
            readings.append(reading_at(an, "dflash.target_layer_ids", value, func, 0.7, mode="default",
                                     detail=f"{func.name}: L={sample[0]}, k={sample[1]} -> {sample[2]} (evaluated statically)"))
            if value == "evenly-1-to-L-3":
                rule_functions.add(func.name)
    inline = _inline_rules(an)
    if inline:
        an._cache["inline-layer-rules"] = {id(expr) for expr in inline}
    if rule_functions or inline:
        readings += _read_sites(an, rule_functions)
    return readings


def _inline_rules(an: Analyzer) -> list[ast.expr]:
    """The rule written inline (`taps = [L // 2] if k == 1 else [round(1 + i * (L - 4) / (k - 1)) for i in range(k)]`):
    an assigned expression of two free names that evaluates to z-lab's ids for every depth tried."""
    from sleuth.oracle import target_layer_ids

    found = []
    for node in nodes_of(an, ast.Assign):
        value = node.value
        if not any(isinstance(n, ast.ListComp) for n in ast.walk(value)) or not any(
                isinstance(n, ast.Call) and call_name(n) == "range" for n in ast.walk(value)):
            continue
        bound = {t.id for n in ast.walk(value) if isinstance(n, ast.comprehension) for t in ast.walk(n.target)
                 if isinstance(t, ast.Name)}
        free = sorted({n.id for n in ast.walk(value) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                      - bound - {"range", "round", "int", "len", "float", "min", "max", "math", "torch"})
        if len(free) != 2:
            continue
        synthetic = ast.FunctionDef(name="_inline_rule", args=ast.arguments(
            posonlyargs=[], args=[ast.arg(arg=f) for f in free], kwonlyargs=[], kw_defaults=[], defaults=[]),
            body=[ast.Return(value=value)], decorator_list=[])
        for order in (free, free[::-1]):
            try:
                if all(_interpret(synthetic, dict(zip(order, (depth, k)))) == target_layer_ids(depth, k)
                       for depth, k in ((36, 5), (64, 5), (28, 3), (36, 1))):
                    found.append(value)
                    break
            except (_EvalError, TypeError, IndexError, KeyError, ValueError, RecursionError, ZeroDivisionError):
                continue
    return found


def _read_sites(an: Analyzer, rule_functions: set[str]) -> list[CodeReading]:
    """Where the z-lab ids index the per-layer tuple: id i is decoder layer i's output, HF hidden_states[i+1].
    Every site must add the one (all-sites rule); `hidden_states[i]` reads one layer too shallow."""
    readings = []
    for node in nodes_of(an, ast.Subscript):
        if not isinstance(node.ctx, ast.Load) or not is_layer_tuple(an, node.value):
            continue
        index = node.slice
        offset = 0
        if isinstance(index, ast.BinOp) and isinstance(index.op, (ast.Add, ast.Sub)):
            # the offset by value, also through a name (`offset = 1; hs[i + offset]`) or written first (`1 + i`)
            sides = [(index.left, index.right)] + ([(index.right, index.left)] if isinstance(index.op, ast.Add) else [])
            for ids_side, offset_side in sides:
                value = an.literal(offset_side)
                if isinstance(ids_side, ast.Name) and isinstance(value, (int, float)) and not isinstance(value, bool):
                    offset = int(value) * (1 if isinstance(index.op, ast.Add) else -1)
                    index = ids_side
                    break
        if not isinstance(index, ast.Name):
            continue
        found = an.defs_of(index)
        loops = [d for d in (found[0] if found else []) if isinstance(d, ast.Subscript) and isinstance(d.slice, ast.Constant)
                 and d.slice.value == 0 and hasattr(d, "lineno")]
        if not loops or not any(_ids_from_rule(an, d.value, rule_functions) for d in loops):
            continue
        if offset == 1:
            continue
        readings.append(reading_at(an, "dflash.target_layer_ids", f"custom (read at hidden_states[i{offset:+d}])", node, 0.8,
                                   detail=f"`{ast.unparse(node)}` reads z-lab layer id i at hidden_states[i{offset:+d}]; "
                                          "id i is HF hidden_states[i+1] (index 0 is the embeddings): "
                                          f"every feature is {abs(offset - 1)} layer(s) off"))
    return readings


def _ids_from_rule(an: Analyzer, node: ast.AST, rule_functions: set[str], depth: int = 0) -> bool:
    """Whether a layer-id list comes from the selection rule: `produced_by`, plus what origins does not follow
    for ids: a settings lookup that falls back to the rule (`cfg.get("target_layer_ids", rule(L, k))`), and
    `model.ids` read from outside the class that sets `self.ids` (the one class in the code that does)."""
    if depth > 6:
        return False
    if id(node) in an._cache.get("inline-layer-rules", set()) or produced_by(an, node, rule_functions):
        return True
    if isinstance(node, ast.Call) and call_name(node) in {"get", "pop", "getattr"} and len(node.args) >= 2:
        return _ids_from_rule(an, node.args[-1], rule_functions, depth + 1)
    if isinstance(node, (ast.Name, ast.Attribute)):
        found = an.defs_of(node)
        if found and found[0]:
            return any(_ids_from_rule(an, d, rule_functions, depth + 1) for d in found[0][-3:])
        if found and isinstance(node, ast.Name):
            return any(_ids_from_rule(an, a, rule_functions, depth + 1) for a in an.parameter_arguments(node)[:3])
        if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            holders = _self_attribute_definitions(an, node.attr)
            if len(holders) == 1:
                return any(_ids_from_rule(an, d, rule_functions, depth + 1) for d in holders[0][-3:])
    return False


def _self_attribute_definitions(an: Analyzer, attr: str) -> list[list[ast.expr]]:
    """Per class: the values assigned to `self.<attr>` in its methods."""
    out: dict[int, list[ast.expr]] = {}
    for node in nodes_of(an, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Attribute) and target.attr == attr and isinstance(target.value, ast.Name) \
                    and target.value.id == "self":
                cls = an.enclosing(node, (ast.ClassDef,))
                if cls is not None:
                    out.setdefault(id(cls), []).append(node.value)
    return list(out.values())
