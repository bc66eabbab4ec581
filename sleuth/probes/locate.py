"""Where a trainer's DFlash pieces are, read statically, for probes without an adapter.

`sleuth diagnose --code PATH --probe` on code that is neither speculators nor SpecForge and comes with no
`--probe-entry` is probed piece by piece: this module finds, in sleuth's own process and without importing
anything, the functions and classes that compute each part of DFlash training, and the probe child
(sleuth/probes/adapters/generic.py) calls them on synthetic inputs whose answers are known.

What is located (`PIECE_KINDS`), by the code index sleuth already builds for static reading
(sleuth/evidence/ast_index.py: the detectors' reading sites name the function a rule is computed in) and
by the shape of the code itself (a nested `mask_mod(b, h, q_idx, kv_idx)`, a list comprehension over
`range(k)` with `round`, `exp` over an `arange`, a `torch.optim` construction), never by a name alone:

    layer_ids   the rule choosing target layers from the target's depth        -> target_layer_ids
    features    the gather of selected hidden states (a function or module)    -> fc_input_layers, ids offset
    mask        the attention mask builder, or the factory of a mask_mod       -> anchor / isolation / bidirectional
    positions   the block tokens' position ids                                 -> block_position_ids
    teacher     the per-slot targets taken from the target's logits            -> target_shift
    final_logits  teacher logits recomputed from hidden states                 -> target_logits_source
    weights     the per-slot loss weights                                      -> anchor_slot_untrained, gamma
    loss        the loss over draft logits and targets                         -> loss_kind (and weights inside)
    optimizer   what builds the optimizer (and freezes) over the drafter       -> frozen_embed_head
    drafter     nn.Module classes a drafter is built from (constructed tiny for the optimizer probe)

A piece counts only when the run uses it: it is called (or passed, or picked from a registry by the
configured key) from a function that trains (calls backward / an optimizer step, computes a loss, or is
`main`); a helper nobody calls, and a method every concrete subclass overrides, are not probed. For each
piece the plan records its parameters (names, defaults, annotations) and what the training path passes
for each (a literal, a config default, or the expression sleuth could not resolve), so the child calls it
the way the run does or says what it could not bind.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sleuth.evidence.ast_index import Analyzer, Unit, call_name, const_number, dotted, leaf_name, load_units, tokens
from sleuth.evidence.harness import harness_units
from sleuth.evidence.origins import head_input
from sleuth.probes.pieces import PIECE_KINDS

# Which static detector's reading sites point at which kind of piece.
_READING_KINDS = {
    "dflash.target_layer_ids": "layer_ids",
    "dflash.fc_input_layers": "features",
    "dflash.context_excludes_anchor": "mask",
    "dflash.blocks_isolated": "mask",
    "dflash.block_bidirectional": "mask",
    "dflash.block_position_ids": "positions",
    "dflash.target_shift": "teacher",
    "dflash.target_logits_source": "final_logits",
    "dflash.anchor_slot_untrained": "weights",
    "dflash.loss_decay_gamma": "weights",
    "dflash.loss_kind": "loss",
    "dflash.frozen_embed_head": "drafter",  # where the embeddings / lm_head a drafter holds are made
}
LOSS_CALLS = {"cross_entropy", "nll_loss", "kl_div", "binary_cross_entropy", "binary_cross_entropy_with_logits",
              "log_softmax", "mse_loss", "smooth_l1_loss", "CrossEntropyLoss", "KLDivLoss"}
OPTIMIZERS = {"AdamW", "Adam", "SGD", "Adafactor", "Muon", "Lion", "RMSprop", "Adagrad", "LAMB", "AdamW8bit"}
MODULE_BASES = {"Module", "PreTrainedModel", "LightningModule"}
# Parameters that hand a function the model (or a whole batch it runs the model on), by their whole name.
_MODEL_PARAMS = {"model", "drafter", "draft_model", "params", "p", "net", "module", "target", "target_model",
                 "verifier", "teacher_model", "batch", "row", "trainer", "state"}
_SAFE_TOP_CALLS = {"dataclass", "field", "namedtuple", "TypeVar", "compile", "getLogger", "device", "dtype", "Path",
                   "getenv", "get", "dict", "list", "set", "tuple", "frozenset", "int", "float", "str", "bool", "partial",
                   "finfo", "iinfo", "NewType", "Enum", "IntEnum", "Literal", "Union", "Optional", "cast", "object",
                   "register_buffer", "Generator", "join", "environ", "attrgetter", "itemgetter"}


@dataclass
class Param:
    name: str
    kind: str  # positional | keyword | var_positional | var_keyword
    has_default: bool = False
    default: Any = None  # the default's value when it is a literal sleuth could read
    default_source: str = ""  # the default as written
    annotation: str = ""


@dataclass
class Piece:
    kind: str
    name: str
    qualname: str
    module: str
    path: str  # as the report names the file
    line: int
    owner: str | None = None  # the class that defines it (a method)
    concrete: list[str] = field(default_factory=list)  # classes `self` is bound to (owner or non-overriding subclasses)
    class_modules: dict[str, str] = field(default_factory=dict)  # class name -> the module defining it
    owner_is_module: bool = False  # the owner is an nn.Module (an instance is built from its constructor)
    params: list[Param] = field(default_factory=list)
    passed: dict[str, Any] = field(default_factory=dict)  # param -> the literal the training path passes
    unresolved: dict[str, str] = field(default_factory=dict)  # param -> what the path passes that is not known
    found_by: str = ""
    used_by: str = ""
    chain: int = 0  # pieces of one chain (a builder and the helper it calls) share it; the child tries them in order
    # For a drafter (or a module a piece lives on): its forward's parameters and the attributes that hold its
    # layers, rotary module, embedding and output head (what `sleuth probe init` wires the protocol to).
    module_info: dict[str, Any] = field(default_factory=dict)
    call_sites: list[str] = field(default_factory=list)  # `line` (path:line) where the training path calls it

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class ModuleInfo:
    name: str
    file: str
    strip: list[int] = field(default_factory=list)  # top-level statements not run on import (their first lines)


@dataclass
class Located:
    root: str
    sys_path: list[str]
    modules: dict[str, ModuleInfo]
    pieces: list[Piece]
    missing: dict[str, str]  # kind -> why nothing was located
    settings: dict[str, list[tuple[Any, str]]]  # setting name -> (value, where), from the code's defaults
    packs_documents: str | None  # where the code tracks documents in a row, or None
    excluded: dict[str, str]  # probe-harness files left out (path -> why)
    errors: list[str] = field(default_factory=list)
    # Functions on the run's path that set requires_grad: the optimizer probe's verdict stands only if each ran.
    grad_sites: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), default=repr))


# --- the index ----------------------------------------------------------------------------------------------


@dataclass
class _Function:
    node: ast.FunctionDef | ast.AsyncFunctionDef
    unit: Unit
    qualname: str
    owner: ast.ClassDef | None
    outer: ast.FunctionDef | ast.AsyncFunctionDef | None  # the enclosing function of a nested def


class _Index:
    """The implementation's functions and classes, who calls whom, and which of them train."""

    def __init__(self, an: Analyzer, units: list[Unit]) -> None:
        self.an, self.units = an, units
        self.functions: list[_Function] = []
        self.by_node: dict[ast.AST, _Function] = {}
        self.classes: dict[str, list[tuple[ast.ClassDef, Unit]]] = {}
        for unit in units:
            self._collect(unit.tree, unit, None, None, [])
        self.bases = {name: {leaf_name(b) for cls, _u in defs for b in cls.bases} for name, defs in self.classes.items()}
        self.callees: dict[ast.AST, set[ast.AST]] = {f.node: set() for f in self.functions}
        self.call_sites: dict[ast.AST, list[tuple[ast.Call, _Function | None]]] = {f.node: [] for f in self.functions}
        self._link()
        # Drivers run training (backward, an optimizer step, main). Library code with no driver (a loss
        # function a user's own loop calls) is entered at its loss functions that nothing here calls.
        self.drivers = {f.node for f in self.functions if self._drives(f)}
        # a stage the user's script runs on its own (prepare() caching the target's outputs) is part of the run
        self.drivers |= {f.node for f in self.functions if f.owner is None and f.outer is None and not self.users(f)
                         and _runs_target(f.node)}
        if not self.drivers:
            self.drivers = {f.node for f in self.functions if _calls(f.node) & LOSS_CALLS and _returns(f.node)
                            and not self.users(f)}
        self.training = self.drivers
        self.module_names: dict[str, str] = {}  # unit path -> the module name it is imported by
        self.registered: dict[str, list[_Function]] = {}  # registry key -> the functions registered under it

    def _collect(self, node: ast.AST, unit: Unit, owner: ast.ClassDef | None, outer: Any, names: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                self.classes.setdefault(child.name, []).append((child, unit))
                self._collect(child, unit, child, None, [*names, child.name])
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                info = _Function(child, unit, ".".join([*names, child.name]), owner if outer is None else None, outer)
                self.functions.append(info)
                self.by_node[child] = info
                self._collect(child, unit, None, child, [*names, child.name])
            elif not isinstance(child, (ast.Lambda,)):
                self._collect(child, unit, owner, outer, names)

    def named(self, name: str) -> list[_Function]:
        return [f for f in self.functions if f.node.name == name]

    def enclosing(self, node: ast.AST) -> _Function | None:
        func = self.an.enclosing_function(node)
        return self.by_node.get(func) if func is not None else None

    def _targets(self, call: ast.Call) -> list[_Function]:
        name = call_name(call)
        if isinstance(call.func, ast.Name) and name in self.classes:
            return [f for f in self.functions if f.node.name == "__init__" and f.owner is not None and f.owner.name == name]
        if isinstance(call.func, ast.Attribute) and name == "__init__" and isinstance(call.func.value, ast.Call) \
                and call_name(call.func.value) == "super":
            caller = self.enclosing(call)
            parents = self.ancestors(caller.owner.name) if caller and caller.owner else set()
            return [f for f in self.functions if f.node.name == "__init__" and f.owner is not None and f.owner.name in parents]
        return [f for f in self.named(name) if f.outer is None or isinstance(call.func, ast.Name)]

    def module_forwards(self, call: ast.Call) -> list[_Function]:
        """What calling an instance of a local class runs: an nn.Module's `forward` (through `__call__`, an
        inherited one too), a class's own `__call__` (`self.drafter(x)`, `model(x)` with `model = Drafter(...)`,
        `loss, metrics = objective(ids, mask)` with `objective = DFlashObjective(...)`)."""
        if not isinstance(call.func, (ast.Name, ast.Attribute)) or call_name(call) in self.classes:
            return []
        found = self.an.defs_of(call.func)
        classes = {call_name(d) for d in (found[0] if found else []) if isinstance(d, ast.Call)} & set(self.classes)
        out: list[_Function] = []
        for cls in sorted(classes):
            for ancestor in self._mro(cls):
                methods = self.methods(ancestor)
                hit = methods.get("__call__") or (methods.get("forward") if self.is_module_class(cls) else None)
                if hit is not None:
                    out.append(hit)
                    break
        return out

    def _link(self) -> None:
        for call in self.an.by_type.get(ast.Call, []):
            caller = self.enclosing(call)
            if caller is None and not any(self.an.unit(call) is u for u in self.units):
                continue
            for target in self._targets(call) + self.module_forwards(call):
                self.call_sites[target.node].append((call, caller))
                if caller is not None:
                    self.callees[caller.node].add(target.node)
            # a function passed as a value (create_block_mask(mask_mod), map(fn, ...), Thread(target=fn))
            for arg in [*call.args, *(kw.value for kw in call.keywords)]:
                if isinstance(arg, (ast.Name, ast.Attribute)):
                    for target in self.named(leaf_name(arg)):
                        if caller is not None and (isinstance(arg, ast.Name) or dotted(arg).startswith("self.")):
                            self.callees[caller.node].add(target.node)
        # `fn = helper` / `self.loss_fn = hard_ce` / `{"ce": ce}`: a reference is a use by the enclosing function
        for name_node in self.an.by_type.get(ast.Name, []):
            if not isinstance(name_node.ctx, ast.Load):
                continue
            parent = self.an.parents.get(name_node)
            if isinstance(parent, ast.Call) and parent.func is name_node:
                continue
            caller = self.enclosing(name_node)
            if caller is None:
                continue
            for target in self.named(name_node.id):
                if target.node is not caller.node and target.outer is None:
                    self.callees[caller.node].add(target.node)

    def ancestors(self, cls: str, seen: frozenset = frozenset()) -> set[str]:
        if cls in seen:
            return set()
        found = {cls}
        for base in self.bases.get(cls, set()):
            if base in self.classes:
                found |= self.ancestors(base, seen | {cls})
        return found

    def descendants(self, cls: str) -> set[str]:
        return {name for name in self.classes if cls in self.ancestors(name)}

    def is_module_class(self, cls: str) -> bool:
        return any(base in MODULE_BASES for name in self.ancestors(cls) for base in self.bases.get(name, set()))

    def methods(self, cls: str) -> dict[str, _Function]:
        return {f.node.name: f for f in self.functions if f.owner is not None and f.owner.name == cls}

    def _abstract(self, cls: str) -> bool:
        """A class that still has an abstract method after its own and its ancestors' definitions."""
        resolved: dict[str, bool] = {}
        for ancestor in reversed(self._mro(cls)):
            for name, method in self.methods(ancestor).items():
                resolved[name] = any(leaf_name(d) == "abstractmethod" for d in method.node.decorator_list)
        return any(resolved.values())

    def _mro(self, cls: str, seen: frozenset = frozenset()) -> list[str]:
        """Depth-first, left to right: close enough to Python's MRO for single-inheritance hierarchies."""
        if cls in seen or cls not in self.classes:
            return []
        order = [cls]
        for base in [leaf_name(b) for b in self.classes[cls][0][0].bases]:
            order += [c for c in self._mro(base, seen | {cls}) if c not in order]
        return order

    def concrete_classes(self, method: _Function) -> list[str]:
        """Concrete classes whose `self.<name>` resolves to this method (it or a subclass that inherits it)."""
        owner = method.owner.name if method.owner else None
        if owner is None:
            return []
        found = []
        for cls in sorted({owner} | self.descendants(owner)):
            resolved = next((c for c in self._mro(cls) if method.node.name in self.methods(c)), None)
            if resolved == owner and not self._abstract(cls):
                found.append(cls)
        return found

    def _drives(self, func: _Function) -> bool:
        if func.node.name == "main" or self._in_main_guard(func):
            return True
        for node in ast.walk(func.node):
            if isinstance(node, ast.Call):
                name = call_name(node)
                if name == "backward":
                    return True
                if name == "step" and isinstance(node.func, ast.Attribute) and set(tokens(dotted(node.func.value))) \
                        & {"opt", "optimizer", "optim", "optimizers"}:
                    return True
        return False

    def _in_main_guard(self, func: _Function) -> bool:
        for node in func.unit.tree.body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                if any(isinstance(c, ast.Call) and call_name(c) == func.node.name for c in ast.walk(node)):
                    return True
        return False

    def users(self, func: _Function, direct: bool = False) -> list[_Function]:
        found = [self.by_node[c] for c, callees in self.callees.items() if func.node in callees and c in self.by_node]
        if not direct and func.node.name == "__init__" and func.owner is not None:
            # an object's methods run on an instance its constructor built (a subclass's through super())
            family = {func.owner.name} | self.descendants(func.owner.name)
            found += [f for f in self.functions if f.owner is not None and f.owner.name in family
                      and f.node.name != "__init__" and f not in found]
        return found

    def link_registries(self, settings: _Settings) -> None:
        """`LOSSES[cfg.loss]` with `@register("ce")` functions (or a `{"ce": fn}` literal): the function under
        the key the run's config selects is used by the function that subscripts the registry; every
        registered one when the key cannot be resolved."""
        registered: dict[str, list[_Function]] = {}
        registries: set[str] = set()  # the dicts functions are registered in
        for func in self.functions:
            for deco in func.node.decorator_list:
                if isinstance(deco, ast.Call) and deco.args and isinstance(deco.args[0], ast.Constant) \
                        and isinstance(deco.args[0].value, str):
                    for key in deco.args:  # @register("ce", "xent", "hard_ce"): one function, several names
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            registered.setdefault(key.value, []).append(func)
                    for decorator in self.named(call_name(deco)):  # `LOSSES[name] = fn` inside register()
                        registries |= {leaf_name(n.value) for n in ast.walk(decorator.node)
                                       if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store)}
        for node in self.an.by_type.get(ast.Dict, []):
            pairs = [(k, v) for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)
                     and isinstance(k.value, str) and isinstance(v, (ast.Name, ast.Attribute)) and self.named(leaf_name(v))]
            if pairs:
                parent = self.an.parents.get(node)
                if isinstance(parent, ast.Assign):
                    registries |= {leaf_name(t) for t in parent.targets}
                for key, value in pairs:
                    registered.setdefault(key.value, []).extend(self.named(leaf_name(value)))
        self.registered = registered
        if not registered:
            return
        lookups = [(sub, sub.slice, None) for sub in self.an.by_type.get(ast.Subscript, [])
                   if not isinstance(sub.slice, ast.Constant) and isinstance(sub.ctx, ast.Load)
                   and leaf_name(sub.value) in registries]
        lookups += [(call, call.args[0], call.args[1] if len(call.args) > 1 else None)
                    for call in self.an.by_type.get(ast.Call, [])
                    if call_name(call) == "get" and isinstance(call.func, ast.Attribute) and call.args
                    and leaf_name(call.func.value) in registries]
        for node, key_expr, default in lookups:
            caller = self.enclosing(node)
            if caller is None:
                continue
            key = _registry_key(settings, key_expr)
            if key is None:
                keys = list(registered)  # a key sleuth cannot resolve: any registered function may run
            elif key in registered:
                keys = [key]
            elif default is not None:  # `.get(name, LOSSES[DEFAULT_LOSS])`: the fallback runs
                fallback = default.slice if isinstance(default, ast.Subscript) else None
                resolved = _registry_key(settings, fallback) if fallback is not None else None
                keys = [resolved] if resolved in registered else []
            else:
                keys = []
            for chosen in keys:
                for target in registered.get(chosen, []):
                    self.callees[caller.node].add(target.node)

    def training_path(self, func: _Function) -> str | None:
        """How the run reaches this function: the chain up to a function that trains, or None."""
        frontier, seen = [(func, [])], {func.node}
        while frontier:
            current, chain = frontier.pop(0)
            if current.node in self.training:
                return " <- ".join([*chain, f"{current.qualname} ({current.unit.path}:{current.node.lineno})"]) \
                    if chain else f"{current.qualname} ({current.unit.path}:{current.node.lineno}) trains"
            for user in self.users(current):
                if user.node not in seen:
                    seen.add(user.node)
                    frontier.append((user, [*chain, current.qualname]))
        return None


# --- settings: the defaults the code gives its options --------------------------------------------------------


class _Settings:
    """Values of named options: argparse defaults, config-class fields, module constants, config dict keys,
    and the user's `--config` on top (it is what the run uses)."""

    def __init__(self, an: Analyzer, index: _Index, user_config: dict[str, Any] | None) -> None:
        self.an, self.index = an, index
        self.user = {str(k): v for k, v in (user_config or {}).items() if not isinstance(v, dict)}
        self.values: dict[str, list[tuple[Any, str]]] = {}
        for unit in index.units:
            self._scan(unit)

    def _add(self, name: str, node: ast.AST | None, where: ast.AST, unit: Unit) -> None:
        value = _literal(node)
        if value is not _UNREAD:
            self.values.setdefault(name, []).append((value, f"{unit.path}:{getattr(where, 'lineno', 0)}"))

    def _scan(self, unit: Unit) -> None:
        for node in ast.walk(unit.tree):
            if isinstance(node, ast.Call) and call_name(node) == "add_argument":
                flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                dest = next((kw.value.value for kw in node.keywords if kw.arg == "dest" and isinstance(kw.value, ast.Constant)), None)
                long = next((f for f in flags if f.startswith("--")), flags[0] if flags else None)
                name = dest or (long.lstrip("-").replace("-", "_") if long else None)
                default = next((kw.value for kw in node.keywords if kw.arg == "default"), None)
                if name and default is not None:
                    self._add(name, default, node, unit)
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                        self._add(stmt.target.id, _field_default(stmt.value), stmt, unit)
                    elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                        self._add(stmt.targets[0].id, stmt.value, stmt, unit)
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        self._add(key.value, value, node, unit)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
                for kw in node.keywords:
                    if kw.arg:
                        self._add(kw.arg, kw.value, node, unit)
        for stmt in unit.tree.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                self._add(stmt.targets[0].id, stmt.value, stmt, unit)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                self._add(stmt.target.id, stmt.value, stmt, unit)

    def lookup(self, name: str) -> tuple[Any, str] | str:
        """(value, where) of an option by its name, or why it is not known."""
        if name in self.user:
            return self.user[name], f"--config {name}"
        found = self.values.get(name, [])
        distinct = {json.dumps(v, default=repr) for v, _w in found}
        if len(distinct) == 1:
            return found[0]
        if not found:
            return f"`{name}` has no default in the analysed code"
        return f"`{name}` has several defaults: " + ", ".join(f"{v!r} ({w})" for v, w in found[:3])

    def resolve(self, node: ast.expr, depth: int = 0) -> tuple[Any, str] | str:
        """The value an argument expression has on the run's path, or why it is not known."""
        text = ast.unparse(node)[:60]
        value = _literal(node)
        if value is not _UNREAD:
            return value, "literal"
        if depth > 3:
            return f"`{text}` is too far from a literal"
        if isinstance(node, ast.Call) and call_name(node) in {"int", "float", "bool", "str"} and len(node.args) == 1:
            return self.resolve(node.args[0], depth + 1)
        if isinstance(node, ast.Call) and call_name(node) == "get" and node.args and isinstance(node.args[0], ast.Constant):
            found = self.lookup(str(node.args[0].value))
            if isinstance(found, tuple) or len(node.args) < 2:
                return found
            return self.resolve(node.args[1], depth + 1)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            return self.lookup(node.slice.value)
        if isinstance(node, ast.Attribute):
            return self.lookup(node.attr)
        if isinstance(node, ast.Name):
            literal = self.an.literal(node)
            if literal is not None and not _is_missing(literal):
                return literal, "assigned"
            reached = self.an.defs_of(node)
            if reached and reached[0] and len(reached[0]) == 1:
                return self.resolve(reached[0][0], depth + 1)
            if reached and not reached[0]:  # a parameter: what its callers pass, else its default
                func = reached[1].node
                args = _call_site_arguments(self.an, func, node.id)
                answers = [self.resolve(a, depth + 1) for a in args[:3]]
                values = {json.dumps(a[0], default=repr) for a in answers if isinstance(a, tuple)}
                if answers and len(values) == 1 and all(isinstance(a, tuple) for a in answers):
                    return answers[0]
                default = reached[1].params.get(node.id)
                if not args and default is not None:
                    return self.resolve(default, depth + 1)
                return f"`{text}` is a parameter whose callers pass " + (
                    ", ".join(ast.unparse(a)[:30] for a in args[:3]) or "nothing sleuth can see")
            return self.lookup(node.id)
        return f"`{text}` is computed at run time"


_UNREAD = object()


def _is_missing(value: Any) -> bool:
    return type(value).__name__ == "Missing"


def _call_site_arguments(an: Analyzer, func: ast.AST | None, param: str) -> list[ast.expr]:
    """What the callers of `func` pass for `param`, leaving out calls of what it returns (`get_loss(name)(x, y)`
    calls get_loss once, with `name`; the outer call is of the function it returned)."""
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    positional = [a.arg for a in func.args.posonlyargs + func.args.args]
    if positional and positional[0] in {"self", "cls"}:
        positional = positional[1:]
    callee = func.name
    if callee == "__init__":
        cls = an.parents.get(func)
        callee = cls.name if isinstance(cls, ast.ClassDef) else ""
    found = []
    for call in an.calls_named(callee):
        if isinstance(call.func, ast.Call):
            continue
        arg = next((kw.value for kw in call.keywords if kw.arg == param), None)
        if arg is None and param in positional:
            i = positional.index(param)
            if i < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[: i + 1]):
                arg = call.args[i]
        if arg is not None:
            found.append(arg)
    return found


_STRING_METHODS = {"strip": str.strip, "lower": str.lower, "upper": str.upper, "casefold": str.casefold,
                   "lstrip": str.lstrip, "rstrip": str.rstrip}


def _registry_key(settings: _Settings, expr: ast.AST) -> str | None:
    """The string a registry is looked up with: resolved, with the string methods applied to it on the way
    (`name.strip().lower().replace("-", "_")`), or None."""
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
        inner = _registry_key(settings, expr.func.value)
        if inner is None:
            return None
        method = expr.func.attr
        if method in _STRING_METHODS and not expr.args:
            return _STRING_METHODS[method](inner)
        if method == "replace" and len(expr.args) == 2 and all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                                               for a in expr.args):
            return inner.replace(expr.args[0].value, expr.args[1].value)
        return None
    answer = settings.resolve(expr)
    return answer[0] if isinstance(answer, tuple) and isinstance(answer[0], str) else None


def _literal(node: ast.AST | None) -> Any:
    """A JSON-able literal (numbers, strings, bools, None, lists / tuples / dicts of them), else _UNREAD."""
    if node is None:
        return _UNREAD
    number = const_number(node)
    if number is not None:
        return number
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bool, type(None), int, float)):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_literal(e) for e in node.elts]
        return _UNREAD if any(i is _UNREAD for i in items) else items
    return _UNREAD


def _field_default(node: ast.expr) -> ast.expr | None:
    """`field(default=4.0)` / `Field(4.0)` / `field(default_factory=lambda: [1, 2])`: the default expression."""
    if isinstance(node, ast.Call) and call_name(node) in {"field", "Field"}:
        for kw in node.keywords:
            if kw.arg == "default":
                return kw.value
            if kw.arg == "default_factory" and isinstance(kw.value, ast.Lambda):
                return kw.value.body
        return node.args[0] if node.args else None
    return node


# --- what each kind of piece looks like ------------------------------------------------------------------------


def _returns(func: ast.AST) -> list[ast.expr]:
    return [n.value for n in ast.walk(func) if isinstance(n, ast.Return) and n.value is not None]


def _calls(func: ast.AST) -> set[str]:
    return {call_name(n) for n in ast.walk(func) if isinstance(n, ast.Call)}


def _param_names(func: ast.AST) -> list[str]:
    args = func.args
    return [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in {"self", "cls"}]


def _tokens_of(names: list[str]) -> set[str]:
    return {t for n in names for t in tokens(n)}


def _is_mask_mod(func: ast.AST) -> bool:
    names = _param_names(func)
    return len(names) in (2, 4) and any(set(tokens(n)) & {"q", "query"} or n.lower().startswith("q") for n in names[-2:-1]) \
        and any(set(tokens(n)) & {"kv", "k", "key"} or n.lower().startswith("k") for n in names[-1:])


def _indexes_param(expr: ast.AST, func: ast.AST) -> bool:
    """Whether an expression reads an entry of one of the function's parameters (through norms and names)."""
    params = set(_param_names(func))
    return any(isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id in params for n in ast.walk(expr))


def _returns_head_of_layer(func: ast.AST) -> bool:
    """`last = hidden_states[-2]; return lm_head(final_norm(last))`: a head applied to a stored layer."""
    for ret in _returns(func):
        for call in [n for n in ast.walk(ret) if isinstance(n, ast.Call)]:
            arg = head_input(call)
            if arg is None:
                continue
            names_used = {n.id for n in ast.walk(arg) if isinstance(n, ast.Name)}
            for stmt in ast.walk(func):
                if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id in names_used for t in stmt.targets) \
                        and _indexes_param(stmt.value, func):
                    return True
    return False


def _runs_target(func: ast.AST) -> bool:
    """Whether a function runs the target model for its hidden states (`model(..., output_hidden_states=True)`)."""
    return any(isinstance(n, ast.keyword) and n.arg == "output_hidden_states" for n in ast.walk(func))


def _gathers_layers(func: ast.AST) -> bool:
    """`cat([hidden_states[i + 1] for i in ids])`: a per-layer sequence indexed by each selected id."""
    for comp in ast.walk(func):
        if not isinstance(comp, (ast.ListComp, ast.GeneratorExp)):
            continue
        loop_vars = {g.target.id for g in comp.generators if isinstance(g.target, ast.Name)}
        element = comp.elt
        while isinstance(element, (ast.Subscript, ast.Attribute, ast.Call)) and not (
                isinstance(element, ast.Subscript) and {n.id for n in ast.walk(element.slice) if isinstance(n, ast.Name)} & loop_vars):
            element = element.value if isinstance(element, (ast.Subscript, ast.Attribute)) else element.func
        if isinstance(element, ast.Subscript) and not isinstance(element.value, ast.Subscript):
            return True
    return False


def _touches_requires_grad(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in {"requires_grad", "requires_grad_"}:
            return True
    return False


def _shape_kind(func: _Function) -> str | None:
    """The kind of piece a function's own code computes, from what it does (not what it is called)."""
    node = func.node
    calls = _calls(node)
    returns = _returns(node)
    params = _tokens_of(_param_names(node))
    if calls & OPTIMIZERS:
        return "optimizer"
    if _touches_requires_grad(node) and not calls & LOSS_CALLS:
        return "freeze"
    if not returns:
        return None
    nested = [n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not node]
    if any(_is_mask_mod(n) for n in nested) or "create_block_mask" in calls:
        return "mask"
    if calls & LOSS_CALLS:
        return "loss"
    if any(isinstance(n, ast.Call) and head_input(n) is not None and _indexes_param(head_input(n), node) for r in returns
           for n in ast.walk(r)) or _returns_head_of_layer(node):
        return "final_logits"
    comprehension_over_range = any(
        isinstance(n, ast.ListComp) and any(isinstance(g.iter, ast.Call) and call_name(g.iter) == "range" for g in n.generators)
        for n in ast.walk(node))
    if ((comprehension_over_range and calls & {"round", "int"}) or "linspace" in calls) and not calls & {"cat", "stack"}:
        return "layer_ids"
    if calls & {"cat", "stack", "concat"} and _gathers_layers(node):
        return "features"
    compares = [n for n in ast.walk(node) if isinstance(n, ast.Compare)]
    if compares and ({"anchor", "anchors", "starts"} & params) and calls & {"cat", "where", "arange", "masked_fill"}:
        return "mask"
    if "arange" in calls and calls & {"exp", "pow"}:
        return "weights"
    if "arange" in calls and ({"anchor", "anchors", "starts", "start", "anc"} & params):
        return "positions"  # or a gather index: what the result feeds decides (_sinks)
    if calls & {"argmax", "softmax", "log_softmax"} and params & {"logits", "teacher", "target", "verifier"}:
        return "teacher"
    return None


# Roles of the places a value goes to, read from the consumer (a keyword, a callee's parameter, a callee).
_SINK_ROLES = {
    "positions": {"pos", "position", "positions", "posids", "rope", "rotary", "rotate", "cos", "sin", "freqs"},
    "mask": {"mask", "attn", "attention", "bias", "allowed", "visible", "visibility", "blocked"},
    "loss": {"loss", "criterion", "ce", "kl", "entropy", "nll", "labels", "label", "targets", "teacher", "tgt"},
}


def _roles_of(name: str) -> set[str]:
    found = set(tokens(name))
    return {role for role, words in _SINK_ROLES.items() if found & words}


def _sinks(index: _Index, func: _Function, depth: int = 0) -> set[str]:
    """Where the values a function returns go on the run's path: 'positions' (a rotary call, position ids),
    'mask' (an attention mask), 'loss' (a loss call or its targets), 'index' (used to index a tensor),
    'metric' (compared, for logging)."""
    found: set[str] = set()
    for call, caller in index.call_sites.get(func.node, []):
        if caller is not None:
            found |= _value_sinks(index, call, caller, depth)
    return found


def _value_sinks(index: _Index, node: ast.AST, caller: _Function, depth: int) -> set[str]:
    an = index.an
    parent = an.parents.get(node)
    if parent is None or depth > 4:
        return set()
    if isinstance(parent, ast.keyword):
        return _roles_of(parent.arg or "") or _value_sinks(index, an.parents.get(parent), caller, depth + 1) \
            if parent.arg else set()
    if isinstance(parent, ast.Call):
        if parent.func is node:
            return set()
        name = call_name(parent)
        roles = _roles_of(name)
        if name in LOSS_CALLS:
            roles.add("loss")
        if name in {"cat", "stack", "concat", "flatten", "view", "reshape", "to", "float", "long", "cpu", "cuda",
                    "contiguous", "clone", "detach", "unsqueeze", "squeeze", "expand", "repeat"}:
            return roles | _value_sinks(index, parent, caller, depth + 1)
        if name in {"gather", "index_select", "take_along_dim"}:
            return roles | {"index"}
        forwards = index.module_forwards(parent)
        for target in index._targets(parent) + forwards:
            params = [a.arg for a in target.node.args.posonlyargs + target.node.args.args]
            # a method called on its object, or an instance called (`model(x)` runs forward(self, x))
            if params and params[0] in {"self", "cls"} and (isinstance(parent.func, ast.Attribute) or target in forwards):
                params = params[1:]
            if node in parent.args and parent.args.index(node) < len(params):
                roles |= _roles_of(params[parent.args.index(node)])
        return roles
    if isinstance(parent, (ast.List, ast.Tuple, ast.Starred)):
        return _value_sinks(index, parent, caller, depth + 1)
    if isinstance(parent, ast.Attribute):  # x.flatten() / x.to(...): the call on it carries the value on
        grand = an.parents.get(parent)
        return _value_sinks(index, grand, caller, depth + 1) if isinstance(grand, ast.Call) else set()
    if isinstance(parent, ast.Subscript):
        if parent.slice is node or node in getattr(parent.slice, "elts", []):
            # cos[pos] reads a rotary table at the positions; tokens[idx] / logits[idx] gathers at an index
            rotary = set(tokens(leaf_name(parent.value))) & {"cos", "sin", "freqs", "rope", "rotary", "inv"}
            return {"positions"} if rotary else {"index"}
        return _value_sinks(index, parent, caller, depth + 1)
    if isinstance(parent, ast.Compare):
        return {"metric"}
    if isinstance(parent, ast.BinOp):
        return _value_sinks(index, parent, caller, depth + 1)
    if isinstance(parent, ast.Return):
        return _sinks(index, caller, depth + 1)
    if isinstance(parent, (ast.Assign, ast.AnnAssign)):
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        names = {dotted(t) for t in targets if isinstance(t, (ast.Name, ast.Attribute))}
        roles = {r for n in names for r in _roles_of(n.rsplit(".", 1)[-1])} - {"loss"}
        for use in ast.walk(caller.node):
            if isinstance(use, (ast.Name, ast.Attribute)) and isinstance(getattr(use, "ctx", None), ast.Load) \
                    and dotted(use) in names and getattr(use, "lineno", 0) > parent.lineno:
                roles |= _value_sinks(index, use, caller, depth + 1)
        return roles
    return set()


# --- locating -------------------------------------------------------------------------------------------------


def locate(code: Path, config: dict[str, Any] | None = None, entry_modules: tuple[str, ...] = ()) -> Located:
    """Every piece the run uses, with how to import and call it (sleuth's process: nothing is imported)."""
    from sleuth.evidence.source import analyse_units

    code = Path(code).resolve()
    units, errors = load_units(code)
    excluded = harness_units(units, entry_modules)
    units = [u for u in units if u.path not in excluded]
    base = code if code.is_dir() else code.parent
    located = Located(root=str(base), sys_path=[], modules={}, pieces=[], missing={}, settings={},
                      packs_documents=None, excluded=excluded, errors=[f"{e.path}: {e.message}" for e in errors])
    if not units:
        located.missing = dict.fromkeys(PIECE_KINDS, "no Python implementation file to read")
        return located
    facts = analyse_units(units)
    an = Analyzer(units)
    index = _Index(an, units)
    settings = _Settings(an, index, config)
    index.link_registries(settings)
    located.settings = settings.values
    for unit in units:
        info = _module_info(_file_of(code, unit.path), unit)
        located.modules[info.name] = info
        index.module_names[unit.path] = info.name
        root = str(Path(info.file).parents[len(info.name.split(".")) - 1])
        if root not in located.sys_path:
            located.sys_path.append(root)
    located.packs_documents = _packs_documents(an, units)

    found: dict[str, list[tuple[_Function, str]]] = {kind: [] for kind in (*PIECE_KINDS, "freeze", "drafter")}
    inline: dict[str, list[str]] = {}
    for reader, readings in facts.readings.items():
        kind = _READING_KINDS.get(reader)
        if kind is None:
            continue
        for reading in readings:
            func = _function_at(index, reading.path, reading.line)
            if func is None:
                continue
            top = _piece_root(index, func)
            if top.node in index.drivers:  # computed inside the training step itself: nothing to call alone
                inline.setdefault(kind, []).append(f"{top.qualname} ({reading.path}:{reading.line})")
            else:
                found[kind].append((func, f"the static reading of {reader} at {reading.path}:{reading.line}"))
    for func in index.functions:
        kind = _shape_kind(func)
        if kind is not None and _piece_root(index, func).node not in index.drivers:
            found[kind].append((func, f"what {func.qualname} computes"))
    registered = {id(f.node): f for funcs in index.registered.values() for f in funcs}
    if any(_shape_kind(f) == "loss" for f in registered.values()):
        # a registry of losses: whichever one the configured key picks is the loss, whatever it computes
        for func in registered.values():
            if _shape_kind(func) != "loss":
                found["loss"].append((func, f"{func.qualname} is registered beside the losses"))
    for name, defs in index.classes.items():
        if index.is_module_class(name) and (_holds_vocab_modules(defs[0][0]) or _holds_layers(defs[0][0])):
            init = index.methods(name).get("__init__")
            if init is not None:
                what = "embedding / output modules" if _holds_vocab_modules(defs[0][0]) else "a stack of layers"
                found["drafter"].append((init, f"class {name} builds {what}"))
    for func in index.functions:  # builders returning such a module (build_drafter(config) -> Drafter(...))
        built = {call_name(r) for r in _returns(func.node) if isinstance(r, ast.Call)} | {
            call_name(n.value) for n in ast.walk(func.node) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)}
        if any(f.owner is not None and f.owner.name in built for f, _w in found["drafter"]) and func.node.name != "__init__" \
                and func.node not in index.drivers:
            found["drafter"].append((func, f"{func.qualname} builds the drafter module"))

    chain = 0
    for kind, candidates in found.items():
        seen: set[ast.AST] = set()
        rejected: list[str] = []
        for func, why in candidates:
            top = _piece_root(index, func)
            if top.node in seen:
                continue
            seen.add(top.node)
            reason = _not_a_piece(index, top, kind, why)
            if reason:
                rejected.append(f"{top.qualname} ({top.unit.path}:{top.node.lineno}) {reason}")
                if kind == "positions" and "loss" in _sinks(index, top):
                    # an anchor + j gather whose value the loss trains toward: the slot targets
                    found["teacher"].append((top, f"what {top.qualname} computes (its value is the loss's targets)"))
                continue
            if kind == "features" and top.node.name == "__init__" and top.owner is not None:
                forward = index.methods(top.owner.name).get("forward")
                if forward is None or not _gathers_layers(forward.node):
                    rejected.append(f"{top.owner.name} ({top.unit.path}:{top.node.lineno}) builds fc but its forward "
                                    "does not select the layers itself")
                    continue
                top = forward
            members = [top, *[u for u in _builders_above(index, top, kind) if u.node not in seen]]
            seen |= {m.node for m in members}
            chain += 1
            added = 0
            for member in reversed(members):  # the builder closest to the training step first
                if kind == "loss" and _takes_model(member):
                    continue
                piece = _piece(index, settings, member, kind, why if member is top else
                               f"it calls {top.qualname}, located by {why}", chain)
                if piece is not None:
                    located.pieces.append(piece)
                    added += 1
            if not added:
                rejected.append(f"{top.qualname} ({top.unit.path}:{top.node.lineno}) is not on the run's path "
                                "(nothing that trains calls it, or every concrete subclass overrides it)")
        if kind in PIECE_KINDS and not any(p.kind == kind for p in located.pieces):
            located.missing[kind] = _why_missing(kind, inline.get(kind, []), rejected)
    located.grad_sites = _grad_sites(index, located.modules)
    return located


def _file_of(code: Path, label: str) -> str:
    """The absolute file of a unit labelled as load_units labels it."""
    if code.is_file():
        return str(code)
    return str(code.parent / label)


def _module_info(file: str, unit: Unit) -> ModuleInfo:
    """The module name a file is imported by (its package path, from the first directory without __init__.py)."""
    path = Path(file)
    parts = [path.stem] if path.name != "__init__.py" else []
    parent = path.parent
    while (parent / "__init__.py").is_file():
        parts.insert(0, parent.name)
        parent = parent.parent
    if not parts:
        parts = [path.parent.name]
    return ModuleInfo(".".join(parts), str(path), _unsafe_top_level(unit.tree))


def _unsafe_top_level(tree: ast.Module) -> list[int]:
    """Top-level statements that would do work on import (train, parse argv, load a model): their lines."""
    unsafe = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Pass)):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        if isinstance(stmt, ast.If) and ("__main__" in ast.unparse(stmt.test) or "TYPE_CHECKING" in ast.unparse(stmt.test)):
            continue
        if isinstance(stmt, ast.Try) and all(isinstance(s, (ast.Import, ast.ImportFrom, ast.Assign, ast.Pass, ast.Expr))
                                             for block in (stmt.body, *[h.body for h in stmt.handlers]) for s in block):
            continue
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            value = stmt.value
            calls = [n for n in ast.walk(value) if isinstance(n, ast.Call)] if value is not None else []
            if all(call_name(c) in _SAFE_TOP_CALLS or (isinstance(c.func, ast.Attribute) and c.func.value.__class__ is ast.Name
                                                      and c.func.value.id in {"torch", "math", "re", "os", "np"}
                                                      and call_name(c) not in {"load", "save", "system", "compile"})
                   for c in calls):
                continue
        unsafe.append(stmt.lineno)
    return unsafe


_DOC_NAME = re.compile(r"(^|_)(doc|document|segment|seg|sample|seq)(_?ids?|_of_\w+|_index|_idx)($|_)|cu_?seq_?lens|seqlens|"
                       r"doc_(offsets|starts|bounds|boundaries)", re.I)


def _packs_documents(an: Analyzer, units: list[Unit]) -> str | None:
    """Where the code tracks which document each position of a row belongs to (ids or offsets), if anywhere."""
    for unit in units:
        for node in ast.walk(unit.tree):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else \
                node.arg if isinstance(node, ast.arg) else node.value if isinstance(node, ast.Constant) and \
                isinstance(node.value, str) else None
            if isinstance(name, str) and len(name) < 40 and _DOC_NAME.search(name):
                return f"`{name}` at {unit.path}:{getattr(node, 'lineno', 0)}"
    return None


def _function_at(index: _Index, path: str, line: int) -> _Function | None:
    best = None
    for func in index.functions:
        if func.unit.path == path and func.node.lineno <= line <= (func.node.end_lineno or func.node.lineno):
            if best is None or func.node.lineno >= best.node.lineno:
                best = func
    return best


def _piece_root(index: _Index, func: _Function) -> _Function:
    """A nested function (a mask_mod inside its factory) is probed through the outermost function around it."""
    while func.outer is not None and func.outer in index.by_node:
        func = index.by_node[func.outer]
    return func


def _builders_above(index: _Index, func: _Function, kind: str) -> list[_Function]:
    """Callers of a piece that only wrap it (they return what it builds and do not train): probing them
    exercises more of the run's path. Nearest first, at most two levels."""
    found, frontier = [], [func]
    for _level in range(2):
        nxt = []
        for current in frontier:
            for user in index.users(current, direct=True):
                if user.node in index.training or user in found or user.node is func.node:
                    continue
                if kind != "loss" and _returns_loss(index, user):
                    continue
                if _shape_kind(user) not in (None, kind, "freeze"):
                    continue
                if not _returns(user.node) and not (kind == "optimizer" and user.node.name == "__init__"):
                    continue
                found.append(user)
                nxt.append(user)
        frontier = nxt
    return found


def _holds_layers(cls: ast.ClassDef) -> bool:
    """A module class that builds a ModuleList of layers (a drafter, or a stack inside one)."""
    return any(isinstance(n, ast.Call) and call_name(n) == "ModuleList" for n in ast.walk(cls))


def _holds_vocab_modules(cls: ast.ClassDef) -> bool:
    """An nn.Module class that builds an embedding or an output projection (what must stay frozen)."""
    for node in ast.walk(cls):
        if isinstance(node, ast.Call) and call_name(node) == "Embedding":
            return True
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and call_name(node.value) == "Linear":
            target = node.targets[0]
            sizes = " ".join(ast.unparse(a) for a in node.value.args[1:2])
            if isinstance(target, ast.Attribute) and (set(tokens(target.attr)) & {"head", "unembed"}
                                                      or set(tokens(sizes)) & {"vocab", "vocabulary"}):
                return True
    return False


def _piece(index: _Index, settings: _Settings, func: _Function, kind: str, why: str, chain: int) -> Piece | None:
    path = index.training_path(func)
    if path is None and not (kind == "drafter" or func.node.name == "__init__"):
        return None
    owner = func.owner.name if func.owner is not None else None
    concrete = index.concrete_classes(func) if owner else []
    if owner and not concrete and kind != "drafter":
        return None  # every concrete class overrides it: not what runs
    module = index.module_names[func.unit.path]
    piece = Piece(kind=kind, name=func.node.name, qualname=func.qualname, module=module, path=func.unit.path,
                  line=func.node.lineno, owner=owner, concrete=concrete or ([owner] if owner else []),
                  owner_is_module=bool(owner and index.is_module_class(owner)), params=_params(func.node),
                  found_by=why, used_by=path or "", chain=chain)
    for cls in piece.concrete:
        defs = index.classes.get(cls)
        if defs:
            piece.class_modules[cls] = index.module_names[defs[0][1].path]
    if kind == "drafter":
        built = owner or next((call_name(r) for r in _returns(func.node) if isinstance(r, ast.Call)
                               and call_name(r) in index.classes), None) or next(
            (call_name(n.value) for n in ast.walk(func.node) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
             and call_name(n.value) in index.classes and index.is_module_class(call_name(n.value))), None)
        if not built or not index.is_module_class(built):
            return None  # a drafter is a module; a trainer class that freezes one is not
        piece.module_info = _module_layout(index, built)
    _bind_call_sites(index, settings, func, piece)
    return piece


def _module_layout(index: _Index, cls: str) -> dict[str, Any]:
    """What a module class holds, read from its __init__ and forward: which attribute is its ModuleList of
    layers, its rotary module, its embedding and its output head, and its forward's parameters."""
    layout: dict[str, Any] = {"class": cls, "module": index.module_names[index.classes[cls][0][1].path]}
    init = index.methods(cls).get("__init__")
    forward = index.methods(cls).get("forward")
    if forward is not None:
        layout["forward"] = [p.name for p in _params(forward.node)]
        layout["forward_where"] = f"{forward.unit.path}:{forward.node.lineno}"
        layout["returns_logits"] = any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "self" and set(tokens(n.func.attr)) & {"head", "unembed"}
            for r in _returns(forward.node) for n in ast.walk(r))
    for node in ast.walk(init.node) if init is not None else []:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute)
                and isinstance(node.targets[0].value, ast.Name) and node.targets[0].value.id == "self"
                and isinstance(node.value, ast.Call)):
            continue
        attr, made = node.targets[0].attr, call_name(node.value)
        if made == "ModuleList" and "layers" not in layout:
            layout["layers"] = attr
        elif set(tokens(made)) & {"rotary", "rope"} and "rotary" not in layout:
            layout["rotary"] = attr
        elif made == "Embedding" and "embed" not in layout:
            layout["embed"] = attr
        elif made == "Linear" and (set(tokens(attr)) & {"head", "unembed"} or set(tokens(
                " ".join(ast.unparse(a) for a in node.value.args[1:2]))) & {"vocab", "vocabulary"}) and "head" not in layout:
            layout["head"] = attr
    return layout


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Param]:
    args = node.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = []
    for arg, default in zip(positional, defaults):
        if arg.arg in {"self", "cls"}:
            continue
        out.append(_param(arg, default, "positional"))
    if args.vararg:
        out.append(Param(args.vararg.arg, "var_positional"))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out.append(_param(arg, default, "keyword"))
    if args.kwarg:
        out.append(Param(args.kwarg.arg, "var_keyword"))
    return out


def _param(arg: ast.arg, default: ast.expr | None, kind: str) -> Param:
    value = _literal(default) if default is not None else _UNREAD
    return Param(arg.arg, kind, has_default=default is not None, default=None if value is _UNREAD else value,
                 default_source=ast.unparse(default) if default is not None else "",
                 annotation=ast.unparse(arg.annotation) if arg.annotation is not None else "")


def _bind_call_sites(index: _Index, settings: _Settings, func: _Function, piece: Piece) -> None:
    """What the run passes for each parameter, read at the call sites on the training path."""
    positional = [a.arg for a in func.node.args.posonlyargs + func.node.args.args]
    if positional and positional[0] in {"self", "cls"}:
        positional = positional[1:]
    for call, caller in index.call_sites.get(func.node, []):
        if caller is None or index.training_path(caller) is None:
            continue
        statement = index.an.enclosing(call, (ast.stmt,)) or call
        text = " ".join(ast.unparse(statement).split())
        piece.call_sites.append(f"`{text[:140]}` ({caller.unit.path}:{call.lineno})")
        if any(isinstance(a, ast.Starred) for a in call.args) or any(kw.arg is None for kw in call.keywords):
            piece.unresolved.setdefault("*", f"{caller.qualname} passes *args / **kwargs at {caller.unit.path}:{call.lineno}")
            continue
        given = dict(zip(positional, call.args))
        given.update({kw.arg: kw.value for kw in call.keywords if kw.arg})
        for name, expr in given.items():
            answer = settings.resolve(expr)
            where = f"{caller.unit.path}:{call.lineno}"
            if isinstance(answer, tuple):
                previous = piece.passed.get(name, answer[0])
                if json.dumps(previous, default=repr) != json.dumps(answer[0], default=repr):
                    piece.unresolved[name] = f"the call sites pass different values ({previous!r}, {answer[0]!r})"
                    piece.passed.pop(name, None)
                elif name not in piece.unresolved:
                    piece.passed[name] = answer[0]
            else:
                piece.unresolved[name] = f"{answer} ({where})"
                piece.passed.pop(name, None)


def _not_a_piece(index: _Index, func: _Function, kind: str, why: str) -> str:
    """Why a candidate is not a piece of this kind, from where its value goes (empty when it is one)."""
    sinks = _sinks(index, func)
    from_reading = why.startswith("the static reading")
    if kind == "positions" and "positions" not in sinks:
        return "builds anchor + j indices that feed " + (" and ".join(sorted(sinks)) or "nothing") + ", not position ids"
    if kind == "teacher" and sinks and not sinks & {"loss", "index"}:
        return "is used only for " + " and ".join(sorted(sinks)) + ", not as the loss's targets"
    if kind == "mask" and not from_reading and "mask" not in sinks and not (
            "create_block_mask" in _calls(func.node) or any(_is_mask_mod(n) for n in ast.walk(func.node)
                                                              if isinstance(n, ast.FunctionDef) and n is not func.node)):
        return "is not used as an attention mask"
    if kind not in ("loss", "optimizer", "freeze", "drafter") and _returns_loss(index, func):
        return "returns the loss: the value is computed inline in it"
    if kind == "loss" and _takes_model(func):
        return "takes the model itself: it runs the drafter, so its logits cannot be replaced"
    return ""


def _takes_model(func: _Function) -> bool:
    return any(n in _MODEL_PARAMS or n.endswith(("_model", "_net")) for n in _param_names(func.node))


def _returns_loss(index: _Index, func: _Function, depth: int = 0) -> bool:
    """Whether a function returns a loss (its own loss call, or a local loss function's result)."""
    if depth > 2:
        return False
    if _shape_kind(func) == "loss":
        return True
    for value in _returns(func.node):
        for call in [n for n in ast.walk(value) if isinstance(n, ast.Call)]:
            if call_name(call) in LOSS_CALLS:
                return True
            if any(_shape_kind(t) == "loss" or _returns_loss(index, t, depth + 1) for t in index._targets(call)):
                return True
    return False


def _grad_sites(index: _Index, modules: dict[str, ModuleInfo]) -> list[str]:
    """`file:first line:qualname` of every function on the run's path whose code sets requires_grad (the first
    line as Python numbers a code object: its first decorator's)."""
    sites = set()
    for f in index.functions:
        if _touches_requires_grad(f.node) and index.training_path(f) is not None:
            first = min([f.node.lineno, *(d.lineno for d in f.node.decorator_list)])
            sites.add(f"{modules[index.module_names[f.unit.path]].file}:{first}:{f.qualname}")
    return sorted(sites)


def _why_missing(kind: str, inline: list[str], rejected: list[str]) -> str:
    if inline:
        return f"computed inline in {', '.join(sorted(set(inline))[:2])}, which also runs the training step: no " \
               "function computes it alone (an entry can offer it: sleuth probe init)"
    if rejected:
        return "; ".join(rejected[:3])
    return {
        "layer_ids": "no function computes the layer ids from the target's depth (a fixed list, or inline)",
        "features": "no function or module gathers the selected hidden states on its own",
        "mask": "no function builds the attention mask on its own",
        "positions": "no function computes the block positions on its own",
        "teacher": "no function takes the slot targets from the target's logits on its own",
        "final_logits": "no function recomputes the teacher logits from hidden states (the target's own output is used)",
        "weights": "no function computes the slot weights on its own",
        "loss": "no function computes the loss from logits and targets on its own",
        "optimizer": "no function builds the optimizer over a drafter module on its own",
    }.get(kind, "not found")


def generic_spec(code: Path, config: dict[str, Any] | None) -> dict[str, Any]:
    """The probe child's spec for located pieces: the plan, its import roots first on sys.path."""
    located = locate(code, config)
    return {"subject": "generic", "plan": located.to_json(), "sys_path": located.sys_path, "context": {"config": config}}
