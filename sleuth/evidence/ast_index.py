"""The analysis kit: parsed source indexed for static reading, with public names for detectors.

What is here (no detector lives here; detectors are in sleuth/evidence/detectors/, registered by id):
    loading      load_units / parse_texts: every .py file parsed with `ast` (never imported); a file that
                 does not parse, is too large or too deeply nested becomes a SourceError, the rest is read
    Analyzer     every unit indexed together: parents, scopes (assignments, parameters, defaults), nodes by
                 type (`nodes_of`), local functions (`function_return`), a light dataflow (`defs_of`,
                 `literal`, `tags`, `block_index_offsets`, `const_offset`), switches (`switch_of`)
    names        tokens / name_tags / is_blocksize_name: names rank candidates; value origins
                 (sleuth/evidence/origins.py) decide where a value comes from
    readings     CodeReading (what one site says, with how it is set: hardcoded | default | switch) and
                 `reading_at`, which records its location and enclosing scope

Each reading says how the behaviour is set:
    hardcoded  the code does it unconditionally
    default    a default value that a config may override
    switch     the behaviour sits behind a runtime switch (an `if`/conditional on a flag): the engine
               must take the value from the run's config instead
"""


from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

Mode = str  # "hardcoded" | "default" | "switch"

MAX_FILES = 400
# All files together: a trainer's source is a few MiB at most (ours: 0.4 MiB); a tree past this (a code/ that
# is the Python library) would take many minutes to analyse. What is left out is named.
MAX_TOTAL_BYTES = 4 * 1024 * 1024
# The analysis recurses over the tree: deeper files (generated code, long chained expressions) are skipped
# with an error entry, far below Python's recursion limit, so one odd file never stops the others.
MAX_TREE_DEPTH = 120
MAX_FILE_BYTES = 2_000_000
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", "node_modules", ".tox", "build", "dist", "site-packages"}


@dataclass
class CodeReading:
    invariant: str
    value: object
    path: str
    line: int
    snippet: str
    confidence: float
    mode: Mode = "hardcoded"
    switch: str | None = None  # the condition the behaviour depends on, as source text
    detail: str = ""
    commit: str | None = None
    scope: str | None = None  # enclosing class / function names, outermost first


@dataclass
class SourceError:
    path: str
    message: str


@dataclass
class Unit:
    path: str  # label: relative path (or reference path)
    text: str
    tree: ast.Module
    commit: str | None = None
    lines: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------
# loading


def iter_python_files(root: Path) -> Iterator[Path]:
    """The .py files under `root` (or `root` itself), sorted, skipping environment folders. No link is
    followed (a file or folder that is a link may point anywhere) and only regular files are listed (a FIFO
    named like a module would block the read forever)."""
    from sleuth.artifacts import find_files

    if root.is_file():
        yield root
        return
    files, _ = find_files(root, lambda name: name.endswith(".py"), max_depth=32, max_entries=200_000,
                          skip_dirs=SKIP_DIRS)
    yield from files


def load_units(code: Path) -> tuple[list[Unit], list[SourceError]]:
    """Parse every .py file under `code` (or the one file); never imports them. At most MAX_FILES files and
    MAX_TOTAL_BYTES together; what is left out is an error entry that says so."""
    from sleuth.artifacts import ArtifactError, read_bytes, shown

    code = Path(code)
    texts: list[tuple[str, str, str | None]] = []
    errors: list[SourceError] = []
    if not code.exists():
        return [], [SourceError(shown(code), "path does not exist")]
    base = code if code.is_dir() else code.parent
    total, left_out = 0, 0
    for path in iter_python_files(code):
        label = str(path.relative_to(base)) if code.is_dir() else path.name
        label = shown(Path(code.name) / label) if code.is_dir() else shown(code)
        if len(texts) >= MAX_FILES or total >= MAX_TOTAL_BYTES:
            left_out += 1
            continue
        try:
            data = read_bytes(path, max_bytes=MAX_FILE_BYTES)
        except ArtifactError as exc:
            errors.append(SourceError(label, "file too large to analyse" if "bytes, more than" in exc.reason
                                      else exc.reason))
            continue
        except OSError as exc:
            errors.append(SourceError(label, f"cannot read: {exc.strerror or exc}"))
            continue
        total += len(data)
        texts.append((label, data.decode("utf-8", errors="replace"), None))
    if left_out:
        errors.append(SourceError(shown(code), f"static reading is bounded to {MAX_FILES} files and "
                                  f"{MAX_TOTAL_BYTES >> 20} MiB: {left_out} more .py file(s) not read"))
    units, parse_errors = parse_texts(texts)
    return units, errors + parse_errors


def parse_texts(texts: Iterable[tuple[str, str, str | None]]) -> tuple[list[Unit], list[SourceError]]:
    units: list[Unit] = []
    errors: list[SourceError] = []
    for label, text, commit in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError) as exc:
            line = getattr(exc, "lineno", None)
            errors.append(SourceError(label, f"does not parse ({exc.__class__.__name__} at line {line})"))
            continue
        except (RecursionError, MemoryError):
            # A 200,000-term expression: the parser itself gives up; that file is skipped, the rest is read.
            errors.append(SourceError(label, "too deeply nested for Python's parser"))
            continue
        units.append(Unit(label, text, tree, commit, text.splitlines()))
    return units, errors


# ---------------------------------------------------------------------------------------------------------
# names and tags


@lru_cache(maxsize=8192)
def tokens(name: str) -> list[str]:
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return [t for t in re.split(r"[_\W\d]+", name.lower()) if t]


ANCHOR_TOKENS = {"anchor", "anchors", "start", "starts", "anc"}
KV_TOKENS = {"kv", "key", "keys", "kvidx", "kidx", "kpos"}
Q_TOKENS = {"q", "query", "queries", "qidx", "qpos"}
CONTEXT_TOKENS = {"target", "ctx", "context", "feature", "features", "feat", "feats", "fused", "aux", "teacher",
                  "verifier", "cond", "memory", "enc", "encoder", "prefix"}
LOGITS_TOKENS = {"logit", "logits", "hidden", "hiddens", "prob", "probs", "distribution", "dist", "scores",
                 "teacher", "verifier", "logprobs", "lp"}
TOKEN_ID_TOKENS = {"ids", "id", "tokens", "token", "labels", "label", "input", "inputs", "tok", "toks"}
POSITION_TOKENS = {"pos", "position", "positions", "posids", "rope"}
WEIGHTISH_TOKENS = {"weight", "weights", "w", "mask", "decay", "loss", "scale", "coef", "lw", "wts"}
BLOCKED_TOKENS = {"blocked", "disallow", "disallowed", "forbid", "forbidden", "masked", "hide", "invalid"}


@lru_cache(maxsize=8192)
def _name_tags(name: str) -> frozenset[str]:
    return frozenset(_compute_name_tags(name))


def name_tags(name: str) -> set[str]:
    return set(_name_tags(name))


def _compute_name_tags(name: str) -> set[str]:
    toks = tokens(name)
    tags: set[str] = set()
    lower = name.lower()
    # max_anchors, num_anchors, anchor_valid, anchor_mask: counts and flags about anchors, not positions
    if ANCHOR_TOKENS & set(toks) and not set(toks) & {"max", "num", "n", "count", "total", "valid", "mask", "len", "size", "keep"}:
        tags.add("anchor")
    if KV_TOKENS & set(toks) or re.fullmatch(r"_?k_?(pos|idx|index|indices|positions?)", lower):
        tags.add("kv")
    if Q_TOKENS & set(toks):
        tags.add("q")
    return tags


@lru_cache(maxsize=8192)
def is_blocksize_name(name: str) -> bool:
    lower = name.lower()
    toks = set(tokens(name))
    return (
        name in {"B", "bs", "blk", "BS", "BLOCK", "BLOCK_SIZE"}
        or ("block" in toks and bool(toks & {"size", "len", "length", "sz"}))
        or lower in {"blocksize", "block_len", "draft_len", "n_draft", "num_draft_tokens", "spec_len", "gamma_len",
                     "spec_tokens", "num_spec_tokens", "n_spec", "draft_tokens", "block_length", "blk_size", "chunk_size"}
    )


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return dotted(node.func) + "()"
    if isinstance(node, ast.Subscript):
        return dotted(node.value) + "[]"
    return ""


def leaf_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return leaf_name(node.func)
    if isinstance(node, ast.Subscript):
        return leaf_name(node.value)
    return ""


def call_name(node: ast.Call) -> str:
    return leaf_name(node.func)


def kwarg(node: ast.Call, name: str) -> ast.expr | None:
    for kw in node.keywords:
        if kw.arg == name:
            return kw.value
    return None


def const_number(node: ast.AST | None) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = const_number(node.operand)
        return -inner if inner is not None else None
    return None


def is_neg_inf(node: ast.AST) -> bool:
    """-inf, float('-inf'), -math.inf, torch.finfo(...).min, a large negative constant, or False."""
    if isinstance(node, ast.Constant) and node.value is False:
        return True
    number = const_number(node)
    if number is not None:
        return number <= -1e4
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = node.operand
        if isinstance(inner, (ast.Name, ast.Attribute)) and leaf_name(inner) in {"inf", "INF", "infinity"}:
            return True
        if isinstance(inner, ast.Call) and call_name(inner) == "float":
            return True
    if isinstance(node, ast.Call) and call_name(node) == "float" and node.args:
        arg = node.args[0]
        return isinstance(arg, ast.Constant) and str(arg.value).strip().lower() in {"-inf", "-infinity"}
    if isinstance(node, ast.Attribute) and node.attr == "min" and isinstance(node.value, ast.Call):
        return call_name(node.value) in {"finfo", "iinfo"}
    if isinstance(node, (ast.Name, ast.Attribute)):
        lower = leaf_name(node).lower()
        return "neg" in lower and "inf" in lower or lower in {"mask_value", "min_value", "neg_inf"}
    return False


# ---------------------------------------------------------------------------------------------------------
# scopes and a light dataflow


class Scope:
    def __init__(self, node: ast.AST | None, parent: Scope | None, unit: Unit):
        self.node = node
        self.parent = parent
        self.unit = unit
        self.defs: dict[str, list[ast.expr]] = {}
        self.params: dict[str, ast.expr | None] = {}
        self.param_tags: dict[str, set[str]] = {}

    def lookup(self, name: str) -> tuple[list[ast.expr], Scope] | None:
        scope: Scope | None = self
        while scope is not None:
            if name in scope.defs:
                return scope.defs[name], scope
            if name in scope.params:
                return [], scope
            scope = scope.parent
        return None

    def param_default(self, name: str) -> tuple[bool, ast.expr | None, Scope] | None:
        scope: Scope | None = self
        while scope is not None:
            if name in scope.params:
                return True, scope.params[name], scope
            if name in scope.defs:
                return None
            scope = scope.parent
        return None


PRESERVING_METHODS = {
    "view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "repeat", "repeat_interleave", "to",
    "long", "int", "float", "double", "half", "bfloat16", "clamp", "clamp_", "clamp_min", "clamp_max", "clip",
    "contiguous", "flatten", "cuda", "cpu", "detach", "type_as", "type", "clone", "view_as", "reshape_as",
    "broadcast_to", "t", "transpose", "permute", "narrow", "index_select", "masked_fill", "where", "sort",
    "values", "abs", "item", "tolist", "numpy",
}
TORCH_UNION_FUNCS = {"remainder", "fmod", "clamp", "clip", "repeat_interleave", "where", "gather", "take_along_dim",
                     "minimum", "maximum", "broadcast_to", "add", "sub", "cat", "stack", "index_select"}


COMPARISON_CALLS: dict[str, type[ast.cmpop]] = {
    "lt": ast.Lt, "le": ast.LtE, "gt": ast.Gt, "ge": ast.GtE, "less": ast.Lt, "less_equal": ast.LtE,
    "greater": ast.Gt, "greater_equal": ast.GtE, "eq": ast.Eq, "equal": ast.Eq,
}
_NAMED = {ast.Name, ast.arg, ast.Attribute}
_BINDING = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr, ast.For, ast.comprehension)
# nodes without children worth visiting
_PLAIN_LEAVES = {ast.Name, ast.Constant, ast.Load, ast.Store, ast.Del, ast.Pass, ast.Break, ast.Continue,
                 ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.Not, ast.Invert,
                 ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.And, ast.Or, ast.BitAnd, ast.BitOr,
                 ast.Is, ast.IsNot, ast.In, ast.NotIn, ast.MatMult, ast.UAdd, ast.LShift, ast.RShift, ast.BitXor}


class _TooDeep(Exception):
    def __init__(self, unit: Unit) -> None:
        super().__init__(unit.path)
        self.unit = unit


class Analyzer:
    """All units together, so dataflow follows local function calls across files."""

    def __init__(self, units: list[Unit]):
        self.units = units
        self.parents: dict[ast.AST, ast.AST] = {}
        self.scope_of: dict[ast.AST, Scope] = {}  # every node -> its innermost function (or module) scope
        self.functions: dict[str, list[tuple[ast.FunctionDef, Scope]]] = {}
        self.unit_of: dict[ast.AST, Unit] = {}
        self.field_defaults: dict[str, list[tuple[ast.expr, Unit, ast.AST]]] = {}
        self.all_nodes: list[ast.AST] = []
        self._mentions: dict[int, tuple[bool, bool]] = {}
        self.outer_of: dict[ast.AST, ast.AST | None] = {}
        self.by_type: dict[type, list[ast.AST]] = {}
        self._cache: dict[object, object] = {}
        # Files nested deeper than the analysis recurses (generated code, a 200,000-term expression): left
        # out with their reason, the others analysed. Found while indexing, so ordinary files pay nothing.
        self.too_deep: list[SourceError] = []
        try:
            for unit in units:
                self._index(unit)
        except _TooDeep as exc:
            rest = [u for u in units if u is not exc.unit]
            self.__init__(rest)  # type: ignore[misc]  # index again without it: no half-indexed file stays
            self.too_deep.insert(0, SourceError(exc.unit.path, f"nested more than {MAX_TREE_DEPTH} levels deep: not analysed"))
            return
        self._index_comparison_calls()

    def _index_comparison_calls(self) -> None:
        """`torch.le(a, b)` / `a.lt(b)` / `jnp.greater_equal(a, b)` are comparisons too: each is indexed as the
        Compare it spells (same place in the tree), so every rule about comparisons reads them."""
        for call in list(self.by_type.get(ast.Call, [])):
            op = COMPARISON_CALLS.get(call_name(call))
            if op is None or call.keywords:
                continue
            if isinstance(call.func, ast.Attribute) and not is_module_name(call.func.value) and len(call.args) == 1:
                left, right = call.func.value, call.args[0]
            elif len(call.args) == 2:
                left, right = call.args
            else:
                continue
            compare = ast.Compare(left=left, ops=[op()], comparators=[right])
            ast.copy_location(compare, call)
            compare.end_lineno, compare.end_col_offset = call.end_lineno, call.end_col_offset
            parent = self.parents.get(call)
            if parent is not None:
                self.parents[compare] = parent
            self.unit_of[compare] = self.unit_of.get(call, self.units[0])
            self.outer_of[compare] = self.outer_of.get(call)
            self.by_type.setdefault(ast.Compare, []).append(compare)
            self.all_nodes.append(compare)

    def overridden_everywhere(self, scope: str | None) -> bool:
        """Whether a method (`Class.method`, a reading's scope) never runs: its class is abstract (an
        unimplemented @abstractmethod remains) and every subclass in the analysed code overrides the method.
        A base class's correct hook never vouches for the override that runs instead."""
        if not scope or "." not in scope:
            return False
        parts = scope.split(".")
        owner, method = parts[-2], parts[-1]
        classes = self.memo("classes-by-name", lambda: {n.name: n for n in self.by_type.get(ast.ClassDef, [])})
        if owner not in classes:
            return False
        subclasses = [c for c in classes.values() if owner in {leaf_name(b) for b in c.bases}]
        if not subclasses or not self._abstract_class(owner, classes):
            return False

        def defines(cls: ast.ClassDef) -> bool:
            return any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == method for s in cls.body)

        return all(defines(c) for c in subclasses)

    def _abstract_class(self, name: str, classes: dict[str, ast.ClassDef], depth: int = 0) -> bool:
        cls = classes.get(name)
        if cls is None or depth > 8:
            return False
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    leaf_name(d) == "abstractmethod" for d in stmt.decorator_list):
                return True
        return any(self._abstract_class(leaf_name(b), classes, depth + 1) for b in cls.bases)

    def memo(self, key: object, compute):  # noqa: ANN001, ANN201 - any zero-argument callable
        """A value computed once per analysis (detectors that share work, e.g. fc and fc_norm)."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    # --- indexing ---------------------------------------------------------------------------------------
    def _index(self, unit: Unit) -> None:
        module_scope = Scope(unit.tree, None, unit)
        self.all_nodes.append(unit.tree)
        self._walk(unit.tree, module_scope, unit, None)

    def _note(self, child: ast.AST, outer: ast.AST | None) -> None:
        """One pass collects every node, its type index, its outermost function, and what that function mentions."""
        self.all_nodes.append(child)
        kind = type(child)
        bucket = self.by_type.get(kind)
        if bucket is None:
            bucket = self.by_type[kind] = []
        bucket.append(child)
        self.outer_of[child] = outer
        if outer is not None and kind in _NAMED:
            name = child.id if kind is ast.Name else child.arg if kind is ast.arg else child.attr
            if name:
                anchor, block = self._mentions.get(id(outer), (False, False))
                if not (anchor and block):
                    self._mentions[id(outer)] = (anchor or "anchor" in _name_tags(name), block or is_blocksize_name(name))

    def _walk(self, node: ast.AST, scope: Scope, unit: Unit, outer: ast.AST | None, depth: int = 0) -> None:
        if depth > MAX_TREE_DEPTH:
            raise _TooDeep(unit)
        for child in ast.iter_child_nodes(node):
            self.parents[child] = node
            self.unit_of[child] = unit
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and outer is None:
                self._mentions.setdefault(id(child), (False, False))
            self._note(child, outer if outer is not None or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else child)
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = Scope(child, scope, unit)
                args = child.args
                positional = args.posonlyargs + args.args
                defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
                for arg, default in zip(positional, defaults):
                    inner.params[arg.arg] = default
                for arg, default in zip(args.kwonlyargs, args.kw_defaults):
                    inner.params[arg.arg] = default
                names = [a.arg for a in positional if a.arg not in {"self", "cls"}]
                # flex-attention's mask_mod(b, h, q_idx, kv_idx): the last two are query and key indices
                # (only with a head index second: make_mask(anchors, docs, n_ctx, block) is not one).
                if len(names) == 4 and names[1].lower().lstrip("_").startswith("h"):
                    inner.param_tags[names[2]] = {"q"}
                    inner.param_tags[names[3]] = {"kv"}
                if not isinstance(child, ast.Lambda):
                    self.functions.setdefault(child.name, []).append((child, inner))
                    for deco in child.decorator_list:
                        self.parents[deco] = child
                        self.scope_of[deco] = scope
                    for default in args.defaults + [d for d in args.kw_defaults if d is not None]:
                        self.parents[default] = child
                        self.scope_of[default] = scope
                        self.unit_of[default] = unit
                        for sub in ast.walk(default):
                            self.unit_of.setdefault(sub, unit)
                self.scope_of[child] = scope
                body = child.body if isinstance(child.body, list) else [child.body]
                inner_outer = outer if outer is not None else (child if not isinstance(child, ast.Lambda) else None)
                others = [n for n in ast.iter_child_nodes(child) if n not in body]
                for other in others:
                    # arguments, defaults, decorators, annotations: indexed, not re-bound
                    self.parents[other] = child
                    self.unit_of[other] = unit
                    self.scope_of.setdefault(other, scope)
                    self._note(other, inner_outer)
                    self._walk(other, scope, unit, inner_outer, depth + 1)
                for stmt in body:
                    self.parents[stmt] = child
                    self.unit_of[stmt] = unit
                    self.scope_of[stmt] = inner
                    self._note(stmt, inner_outer)
                    self._record(stmt, inner)
                    self._walk(stmt, inner, unit, inner_outer, depth + 1)
                continue
            self.scope_of[child] = scope
            if type(child) in _PLAIN_LEAVES:
                continue
            if isinstance(child, ast.ClassDef):
                for stmt in child.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                        self.field_defaults.setdefault(stmt.target.id, []).append((stmt.value, unit, stmt))
                    elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                        self.field_defaults.setdefault(stmt.targets[0].id, []).append((stmt.value, unit, stmt))
            if isinstance(child, _BINDING):
                self._record(child, scope)
            self._walk(child, scope, unit, outer, depth + 1)

    def _record(self, stmt: ast.AST, scope: Scope) -> None:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                self._bind(target, stmt.value, scope)
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            self._bind(stmt.target, stmt.value, scope)
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
            scope.defs.setdefault(stmt.target.id, []).append(ast.BinOp(left=ast.Name(stmt.target.id), op=stmt.op, right=stmt.value))
        elif isinstance(stmt, ast.NamedExpr):
            self._bind(stmt.target, stmt.value, scope)
        elif isinstance(stmt, (ast.For, ast.comprehension)):
            self._bind_loop(stmt.target, stmt.iter, scope)

    def _bind_loop(self, target: ast.AST, iterable: ast.expr, scope: Scope) -> None:
        """`for j in range(B)`: j is a slot index (an arange over the block, whatever the start);
        `for p in anchors` / `for a, p in enumerate(anchors)`: p is one anchor."""
        if isinstance(iterable, ast.Call) and call_name(iterable) == "enumerate" and iterable.args and isinstance(target, ast.Tuple) and len(target.elts) == 2:
            self._bind_loop(target.elts[1], iterable.args[0], scope)
            if isinstance(target.elts[0], ast.Name):
                # the counter of `enumerate(anchors)` numbers the blocks (resolved lazily in tags)
                counter = ast.Call(func=ast.Name("__enumerate_index__", ast.Load()), args=[iterable.args[0]], keywords=[])
                ast.copy_location(counter, iterable)
                self.parents[counter] = iterable
                scope.defs.setdefault(target.elts[0].id, []).append(counter)
            return
        if not isinstance(target, ast.Name):
            return
        if isinstance(iterable, ast.Call) and call_name(iterable) == "range" and iterable.args:
            upper = iterable.args[1] if len(iterable.args) >= 2 else iterable.args[0]
            synthetic = ast.Call(func=ast.Name("arange", ast.Load()), args=[upper], keywords=[])
            synthetic.range_start = iterable.args[0] if len(iterable.args) >= 2 else None  # type: ignore[attr-defined]
            ast.copy_location(synthetic, iterable)
            self.parents[synthetic] = iterable
            scope.defs.setdefault(target.id, []).append(synthetic)
        else:
            element = ast.Subscript(value=iterable, slice=ast.Constant(0), ctx=ast.Load())
            ast.copy_location(element, iterable)
            self.parents[element] = iterable
            scope.defs.setdefault(target.id, []).append(element)

    def _bind(self, target: ast.AST, value: ast.expr, scope: Scope) -> None:
        if isinstance(target, ast.Name):
            scope.defs.setdefault(target.id, []).append(value)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            # self.x = ... : visible to every method of the class through the name "self.x"
            scope.defs.setdefault("self." + target.attr, []).append(value)
            class_scope = scope.parent
            if class_scope is not None:
                class_scope.defs.setdefault("self." + target.attr, []).append(value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                for t, v in zip(target.elts, value.elts):
                    self._bind(t, v, scope)
            else:
                for t in target.elts:
                    if isinstance(t, ast.Name):
                        # a tuple-returning call: the element's meaning comes from its name only
                        scope.defs.setdefault(t.id, [])

    # --- helpers ----------------------------------------------------------------------------------------
    def scope(self, node: ast.AST) -> Scope:
        current: ast.AST | None = node
        while current is not None:
            if current in self.scope_of:
                return self.scope_of[current]
            current = self.parents.get(current)
        return Scope(None, None, self.units[0])

    def unit(self, node: ast.AST) -> Unit:
        return self.unit_of.get(node, self.units[0])

    def snippet(self, node: ast.AST) -> str:
        unit = self.unit(node)
        line = getattr(node, "lineno", 1)
        end = min(getattr(node, "end_lineno", line) or line, line + 2)
        return "\n".join(unit.lines[line - 1 : end]).strip()[:300]

    def enclosing(self, node: ast.AST, kinds: tuple[type, ...]) -> ast.AST | None:
        current = self.parents.get(node)
        while current is not None and not isinstance(current, kinds):
            current = self.parents.get(current)
        return current

    def enclosing_function(self, node: ast.AST) -> ast.AST | None:
        return self.enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef))

    def outermost_function(self, node: ast.AST) -> ast.AST | None:
        if node in self.outer_of:
            outer = self.outer_of[node]
            return outer if outer is not node else None
        found, current = None, self.parents.get(node)
        while current is not None:
            if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found = current
            current = self.parents.get(current)
        return found

    def defs_of(self, node: ast.expr) -> tuple[list[ast.expr], Scope] | None:
        key = None
        if isinstance(node, ast.Name):
            key = node.id
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            key = "self." + node.attr
        if key is None:
            return None
        return self.scope(node).lookup(key)

    def switch_of(self, node: ast.AST, stop: ast.AST | None = None) -> str | None:
        """The condition a node's evaluation depends on (an enclosing if / conditional expression), if any.

        Conditions on shapes (`x.numel() < n`) pick between equivalent implementations and are not switches.
        A condition on a variant flag (DSpark's `sample_from_anchor`) returns VARIANT in the variant's branch
        and is skipped in the DFlash branch."""
        child, current = node, self.parents.get(node)
        while current is not None and current is not stop:
            if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Module)):
                return None
            if isinstance(current, (ast.IfExp, ast.If)) and child is not current.test:
                in_body = child is current.body or (isinstance(current.body, list) and child in current.body)
                label = condition_label(current.test, in_body)
                if label is not None:
                    return label
            child, current = current, self.parents.get(current)
        return None

    def is_blocksize(self, node: ast.AST, depth: int = 0) -> bool:
        if isinstance(node, (ast.Name, ast.Attribute)):
            if is_blocksize_name(leaf_name(node)):
                return True
            if depth < 3:
                found = self.defs_of(node)
                if found and found[0]:
                    return all(self.is_blocksize(d, depth + 1) for d in found[0])
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
            return False
        return False

    # --- tags: what a value means (anchor / key position / query position / block id / arange) --------
    def tags(self, node: ast.AST | None, depth: int = 0, seen: frozenset = frozenset()) -> set[str]:
        if node is None or depth > 10 or id(node) in seen:
            return set()
        seen = seen | {id(node)}
        if isinstance(node, ast.Name) or (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        ):
            name = leaf_name(node)
            result = name_tags(name)
            scope = self.scope(node)
            s: Scope | None = scope
            while s is not None:
                if name in s.param_tags:
                    result |= s.param_tags[name]
                    break
                s = s.parent
            found = self.defs_of(node)
            if found:
                for definition in found[0][-3:]:
                    result |= self.tags(definition, depth + 1, seen)
                if not found[0] and isinstance(node, ast.Name) and not result & {"anchor", "arange"}:
                    # a parameter is an anchor (or a slot range) when every caller passes one
                    # (`visibility(n, q_anchor + 1)`, `position(start, torch.arange(B))`)
                    args = self.parameter_arguments(node)
                    if args:
                        common = {"anchor", "arange"}
                        for a in args:
                            common &= self.tags(a, depth + 1, seen)
                        result |= common
            return result
        if isinstance(node, ast.Attribute):
            return name_tags(node.attr)
        if isinstance(node, ast.Subscript):
            return self.tags(node.value, depth + 1, seen)
        if isinstance(node, ast.Starred):
            return self.tags(node.value, depth + 1, seen)
        if isinstance(node, ast.Call):
            name = call_name(node)
            if name == "__enumerate_index__" or (name == "arange" and hasattr(node, "range_start") and node.args
                                                 and isinstance(node.args[-1], ast.Call) and call_name(node.args[-1]) == "len"
                                                 and node.args[-1].args):
                # enumerate(anchors)'s counter / range(len(anchors)): one index per block
                over = node.args[0] if name == "__enumerate_index__" else node.args[-1].args[0]
                return {"blockid"} if "anchor" in self.tags(over, depth + 1, seen) else set()
            rounding = kwarg(node, "rounding_mode")
            if (name in {"floor_divide", "floor_divide_"} or (name in {"div", "divide"} and isinstance(rounding, ast.Constant)
                                                              and rounding.value == "floor")) and node.args \
                    and self.is_blocksize(node.args[-1]):
                # floor division spelled as a call, like `//` below: a block index
                numer = node.func.value if isinstance(node.func, ast.Attribute) and len(node.args) == 1 else node.args[0]
                return {"blockid"} | (self.tags(numer, depth + 1, seen) & {"q", "kv"})
            if name == "arange":
                start = node.args[0] if len(node.args) >= 2 else None
                return {"arange"} | (self.tags(start, depth + 1, seen) if start is not None else set())
            if isinstance(node.func, ast.Attribute) and name in PRESERVING_METHODS and not is_module_name(node.func.value):
                return self.tags(node.func.value, depth + 1, seen)
            if name in TORCH_UNION_FUNCS or name in PRESERVING_METHODS:
                out: set[str] = set()
                for arg in node.args[:2]:
                    out |= self.tags(arg, depth + 1, seen)
                return out - {"blockid"}
            summary = self.function_return(name)
            if summary is not None:
                return self.tags(summary, depth + 1, seen) | (name_tags(name) & {"anchor"})
            out = name_tags(name) & {"anchor"}
            if isinstance(node.func, ast.Attribute) and not is_module_name(node.func.value):
                out |= self.tags(node.func.value, depth + 1, seen) & {"anchor"}
            for arg in node.args:
                out |= self.tags(arg, depth + 1, seen) & {"anchor"}
            return out
        if isinstance(node, ast.BinOp):
            left = self.tags(node.left, depth + 1, seen)
            right = self.tags(node.right, depth + 1, seen)
            if isinstance(node.op, ast.FloorDiv) and self.is_blocksize(node.right):
                return {"blockid"} | (left & {"q", "kv"})
            if isinstance(node.op, ast.Mod) and self.is_blocksize(node.right):
                return {"slot"} | (left & {"q", "kv"})
            return (left | right) - {"blockid", "slot"} | ((left | right) & {"slot"})
        if isinstance(node, ast.IfExp):
            return self.tags(node.body, depth + 1, seen) | self.tags(node.orelse, depth + 1, seen)
        if isinstance(node, ast.UnaryOp):
            return self.tags(node.operand, depth + 1, seen)
        return set()

    def function_return(self, name: str) -> ast.expr | None:
        """The return expression of a local function with this name (first found), for dataflow through calls."""
        for func, _scope in self.functions.get(name, []):
            for stmt in ast.walk(func):
                if isinstance(stmt, ast.Return) and stmt.value is not None and self.enclosing_function(stmt) is func:
                    return stmt.value
        return None

    # --- constant offsets, block indices -----------------------------------------------------------------
    def block_index_offsets(self, node: ast.AST, depth: int = 0) -> list[tuple[int, str | None]]:
        """For an expression `anchor + arange(B) + c`, the offsets c (+ arange start) it can take, with the
        condition each depends on. Empty when the expression is not such a block index."""
        if depth > 14:
            return []
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            c_right = const_number(node.right)
            if c_right is not None and float(c_right).is_integer():
                sign = 1 if isinstance(node.op, ast.Add) else -1
                return [(o + sign * int(c_right), s) for o, s in self.block_index_offsets(node.left, depth + 1)]
            c_left = const_number(node.left)
            if c_left is not None and isinstance(node.op, ast.Add) and float(c_left).is_integer():
                return [(o + int(c_left), s) for o, s in self.block_index_offsets(node.right, depth + 1)]
            if isinstance(node.op, ast.Add):
                left, right = self.tags(node.left), self.tags(node.right)
                for anchor_side, range_side, a_tags, r_tags in (
                    (node.left, node.right, left, right),
                    (node.right, node.left, right, left),
                ):
                    if "anchor" in a_tags and "arange" in r_tags and "anchor" not in r_tags:
                        start = self.arange_start(range_side)
                        if start is None:
                            continue
                        return [(start + self.const_offset(anchor_side), None)]
            return []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            return self.block_index_offsets(node.left, depth + 1)
        if isinstance(node, ast.Subscript):
            return self.block_index_offsets(node.value, depth + 1)
        if isinstance(node, ast.Call):
            name = call_name(node)
            if name == "arange" and len(node.args) >= 2 and "anchor" in self.tags(node.args[1]):
                # arange(lo, anchor + B + c): the block part ends at anchor + B - 1 + c
                upper = node.args[1]
                if any(self.is_blocksize(n) for n in ast.walk(upper) if isinstance(n, (ast.Name, ast.Attribute))):
                    return [(self.const_offset(upper), None)]
                return []
            if isinstance(node.func, ast.Attribute) and name in PRESERVING_METHODS and not is_module_name(node.func.value):
                return self.block_index_offsets(node.func.value, depth + 1)
            if name in {"clamp", "clip", "remainder", "fmod"} and node.args:
                return self.block_index_offsets(node.args[0], depth + 1)
            if name in {"max", "min", "maximum", "minimum"} and isinstance(node.func, (ast.Name, ast.Attribute)):
                for arg in node.args:  # max(p + j - 1, 0): the bound only keeps the index in range
                    found = self.block_index_offsets(arg, depth + 1)
                    if found:
                        return found
                return []
            summary = self.function_return(name)
            if summary is not None:
                # arguments count: `positions(anchor + 1)` whose helper returns `start + arange(B)` is anchor+1+j
                extra = self._argument_offset(node, name)
                return [(o + extra, sw) for o, sw in self.block_index_offsets(summary, depth + 1)]
            return []
        if isinstance(node, ast.IfExp):
            body_label, else_label = condition_label(node.test, True), condition_label(node.test, False)
            return [(o, s or body_label) for o, s in self.block_index_offsets(node.body, depth + 1)] + [
                (o, s or else_label) for o, s in self.block_index_offsets(node.orelse, depth + 1)
            ]
        if isinstance(node, (ast.Name, ast.Attribute)):
            found = self.defs_of(node)
            if found and found[0]:
                out: list[tuple[int, str | None]] = []
                for definition in found[0][-2:]:
                    switch = self.switch_of(definition) if len(found[0]) > 1 else None
                    out += [(o, s or switch) for o, s in self.block_index_offsets(definition, depth + 1)]
                return out
        return []

    def _argument_offset(self, call: ast.Call, name: str) -> int:
        """The constant offset on the anchor-derived argument of a call into a local function."""
        functions = self.functions.get(name, [])
        if not functions:
            return 0
        func = functions[0][0]
        params = [a.arg for a in func.args.posonlyargs + func.args.args]
        if params and params[0] in {"self", "cls"} and isinstance(call.func, ast.Attribute):
            params = params[1:]
        pairs = list(zip(params, call.args)) + [(kw.arg, kw.value) for kw in call.keywords if kw.arg]
        offsets = [self.const_offset(arg) for _param, arg in pairs
                   if not isinstance(arg, ast.Starred) and "anchor" in self.tags(arg)]
        return offsets[0] if len(offsets) == 1 else 0

    def arange_start(self, node: ast.AST, depth: int = 0) -> int | None:
        if isinstance(node, ast.Subscript):
            return self.arange_start(node.value, depth + 1)
        if isinstance(node, ast.Call):
            name = call_name(node)
            if name == "arange":
                if len(node.args) >= 2:
                    start = const_number(node.args[0])
                    return int(start) if start is not None else None
                start_kw = kwarg(node, "start")
                if start_kw is not None:
                    start = const_number(start_kw)
                    return int(start) if start is not None else None
                return 0
            if isinstance(node.func, ast.Attribute) and name in PRESERVING_METHODS:
                return self.arange_start(node.func.value, depth + 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            c = const_number(node.right)
            if c is not None:
                inner = self.arange_start(node.left, depth + 1)
                return None if inner is None else inner + int(c) * (1 if isinstance(node.op, ast.Add) else -1)
        if isinstance(node, (ast.Name, ast.Attribute)) and depth < 4:
            found = self.defs_of(node)
            if found and len(found[0]) == 1:
                return self.arange_start(found[0][0], depth + 1)
            if found and not found[0] and isinstance(node, ast.Name):
                starts = {self.arange_start(a, depth + 1) for a in self.parameter_arguments(node)}
                if len(starts) == 1:
                    return starts.pop()
        return None

    def const_offset(self, node: ast.AST, depth: int = 0) -> int:
        """c in `x + c` / `x - c`, following single assignments; 0 when there is none."""
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            c = const_number(node.right)
            if c is not None and float(c).is_integer():
                return self.const_offset(node.left, depth + 1) + int(c) * (1 if isinstance(node.op, ast.Add) else -1)
            c = const_number(node.left)
            if c is not None and isinstance(node.op, ast.Add) and float(c).is_integer():
                return self.const_offset(node.right, depth + 1) + int(c)
        if isinstance(node, ast.Subscript):
            return self.const_offset(node.value, depth + 1)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and call_name(node) in PRESERVING_METHODS:
            return self.const_offset(node.func.value, depth + 1)
        # follow `limit = anchor + 1`, but an anchor-named value is the anchor itself (offset 0)
        if isinstance(node, ast.Name) and depth < 4 and "anchor" not in name_tags(node.id):
            found = self.defs_of(node)
            if found and len(found[0]) == 1:
                return self.const_offset(found[0][0], depth + 1)
            if found and not found[0]:
                # a parameter: the offset its callers put on the argument (`helper(anchor + 1)`) counts
                offsets = {self.const_offset(a, depth + 1) for a in self.parameter_arguments(node)}
                if len(offsets) == 1:
                    return offsets.pop()
        return 0

    def parameter_arguments(self, node: ast.Name) -> list[ast.expr]:
        """For a name that is a function's parameter: the arguments its call sites pass for it."""
        found = self.defs_of(node)
        if not found or found[0]:
            return []
        func = found[1].node
        return self.call_site_arguments(func, node.id)

    def calls_named(self, name: str) -> list[ast.Call]:
        """Every call whose callee's last name is `name` (`f(...)`, `obj.f(...)`), indexed once."""
        index = self._cache.get("calls-by-name")
        if index is None:
            index = {}
            for call in self.by_type.get(ast.Call, []):
                index.setdefault(call_name(call), []).append(call)
            self._cache["calls-by-name"] = index
        return index.get(name, []) if name else []  # type: ignore[union-attr]

    def call_site_arguments(self, func: ast.AST | None, param: str) -> list[ast.expr]:
        """The arguments passed for `param` where `func` is called (the class name for `__init__`)."""
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return []
        key = ("call-sites", id(func), param)
        if key in self._cache:
            return self._cache[key]  # type: ignore[return-value]
        positional = [a.arg for a in func.args.posonlyargs + func.args.args]
        callee = func.name
        if callee == "__init__":
            cls = self.parents.get(func)
            callee = cls.name if isinstance(cls, ast.ClassDef) else ""
        if positional and positional[0] in {"self", "cls"}:
            positional = positional[1:]
        index = positional.index(param) if param in positional else None
        found: list[ast.expr] = []
        for call in self.calls_named(callee):
            arg = kwarg(call, param)
            if arg is None and index is not None and index < len(call.args) and not any(
                    isinstance(a, ast.Starred) for a in call.args[: index + 1]):
                arg = call.args[index]
            if arg is not None:
                found.append(arg)
        self._cache[key] = found
        return found

    def nonconst_offset(self, node: ast.AST) -> ast.expr | None:
        """A non-constant term added to an anchor (e.g. `anchor + int(include)`): a runtime switch."""
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            for side, other in ((node.right, node.left), (node.left, node.right)):
                if const_number(side) is None and "anchor" in self.tags(other) and (
                    "anchor" not in self.tags(side) or re.search(r"include|flag|use_|with_|^int\(|^bool\(", ast.unparse(side))
                ):
                    return side
        return None

    # --- default values -----------------------------------------------------------------------------------
    def literal(self, node: ast.AST | None, depth: int = 0) -> object:
        """The constant value of an expression, resolving names, Field(default=...), kwargs.get(k, d)."""
        if node is None or depth > 5:
            return MISSING
        number = const_number(node)
        if number is not None:
            return number
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Call):
            name = call_name(node)
            if name in {"Field", "field"}:
                default = kwarg(node, "default")
                if default is None and node.args:
                    default = node.args[0]
                return self.literal(default, depth + 1) if default is not None else MISSING
            if name in {"get", "getattr", "pop", "setdefault"} and len(node.args) >= 2:
                return self.literal(node.args[-1], depth + 1)
            if name in {"float", "int"} and node.args:
                return self.literal(node.args[0], depth + 1)
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and len(node.values) == 2:
            return self.literal(node.values[1], depth + 1)
        if isinstance(node, (ast.Name, ast.Attribute)):
            found = self.defs_of(node)
            if found and found[0] and len(found[0]) == 1:
                return self.literal(found[0][0], depth + 1)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and self._parsed_args(node.value):
            default = self.argparse_defaults().get(node.attr)  # args.hs_offset: the option's default
            return self.literal(default, depth + 1) if default is not None else MISSING
        return MISSING

    def argparse_defaults(self) -> dict[str, ast.expr]:
        """dest -> default expression of every `add_argument` call in the analysed code (`--hs-offset` -> hs_offset)."""
        def compute() -> dict[str, ast.expr]:
            found: dict[str, ast.expr] = {}
            for call in self.calls_named("add_argument"):
                flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                dest = kwarg(call, "dest")
                name = dest.value if isinstance(dest, ast.Constant) else next(
                    (f.lstrip("-").replace("-", "_") for f in flags if f.startswith("--")), None)
                default = kwarg(call, "default")
                if name and default is not None:
                    found.setdefault(name, default)
            return found
        return self.memo("argparse-defaults", compute)

    def _parsed_args(self, node: ast.Name) -> bool:
        """Whether a name holds what `parser.parse_args()` returned."""
        found = self.defs_of(node)
        return bool(found and found[0] and all(isinstance(d, ast.Call) and call_name(d) in {"parse_args", "parse_known_args"}
                                               for d in found[0]))


VARIANT = "<variant branch>"
VARIANT_FLAG = re.compile(r"sample_from_anchor|dspark|use_dspark", re.I)
SHAPE_CONDITION = re.compile(r"\.numel\(\)|\.shape\b|\.size\(|\blen\(|\.dim\(\)|\.ndim\b")


def condition_label(test: ast.expr, in_body: bool) -> str | None:
    text = ast.unparse(test)
    if SHAPE_CONDITION.search(text):
        return None
    if VARIANT_FLAG.search(text):
        negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
        variant_branch = in_body != negated
        return VARIANT if variant_branch else None
    return text


class Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING = Missing()


def is_module_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in {"torch", "F", "nn", "np", "numpy", "math", "jnp", "mx"}


# ---------------------------------------------------------------------------------------------------------
# helpers for detectors: where a node sits, and the reading it gives


def mentions_window(an: Analyzer, node: ast.AST, switch: str) -> bool:
    """Whether a condition is about sliding-window layers, also through the names it uses."""
    if re.search(r"window|sliding", switch, re.I):
        return True
    try:
        test = ast.parse(switch, mode="eval").body
    except SyntaxError:
        return False
    scope = an.scope(node)
    for name in {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}:
        found = scope.lookup(name)
        if found and any(re.search(r"window|sliding", ast.unparse(d), re.I) for d in found[0]):
            return True
    return False


# Other speculative-decoding algorithms that live beside DFlash in a repository (EAGLE, Domino, DSpark,
# DFlash2...): their code follows their own rules, so it never counts as DFlash evidence.
VARIANT_PATTERN = re.compile(r"eagle|medusa|domino|dspark|dflash2|mtp|hydra|xpress", re.I)
# In paths, "hydra" is far more often the config library than Hydra heads: only scopes (class HydraHead) count.
VARIANT_PATH_PATTERN = re.compile(r"eagle|medusa|domino|dspark|dflash2|mtp|xpress", re.I)


def in_variant_file(path: str) -> bool:
    """A file of another algorithm: judged below the analysed root (the root's own name is the user's choice)."""
    parts = Path(path).parts
    return bool(VARIANT_PATH_PATTERN.search("/".join(parts[1:] if len(parts) > 1 else parts)))


def in_variant_code(an: Analyzer, node: ast.AST) -> bool:
    """Whether `node` sits in another algorithm's code: its file, or an enclosing class / function named
    for it (a DFlash value path never runs through there)."""
    if in_variant_file(an.unit(node).path):
        return True
    current = an.parents.get(node)
    while current is not None:
        if isinstance(current, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and VARIANT_PATTERN.search(current.name):
            return True
        current = an.parents.get(current)
    return False


def in_draft_class(an: Analyzer, node: ast.AST) -> bool:
    current = an.parents.get(node)
    while current is not None:
        if isinstance(current, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            lower = current.name.lower()
            if any(w in lower for w in ("draft", "dflash", "spec")):
                return True
        current = an.parents.get(current)
    return False


def reading_at(an: Analyzer, invariant: str, value: object, node: ast.AST, confidence: float, *, mode: Mode = "hardcoded",
             switch: str | None = None, detail: str = "") -> CodeReading:
    unit = an.unit(node)
    names, current = [], an.parents.get(node)
    while current is not None:
        if isinstance(current, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(current.name)
        current = an.parents.get(current)
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        names.insert(0, node.name)
    if switch == VARIANT:
        mode, detail = "variant", detail + " (in the DSpark-variant branch)"
    return CodeReading(invariant, value, unit.path, getattr(node, "lineno", 0), an.snippet(node), confidence, mode,
                       switch, detail, unit.commit, ".".join(reversed(names)) or None)


def nodes_of(an: Analyzer, kind: type | tuple[type, ...]) -> list[ast.AST]:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if len(kinds) == 1:
        return an.by_type.get(kinds[0], [])
    return [n for n in an.all_nodes if isinstance(n, kinds)]


def function_mentions(an: Analyzer, node: ast.AST) -> tuple[bool, bool]:
    """(mentions an anchor, mentions a block size) anywhere in the outermost enclosing function."""
    func = an.outermost_function(node)
    if func is None:
        return False, False
    return an._mentions.get(id(func), (False, False))


def scope_mentions_anchor(an: Analyzer, node: ast.AST) -> bool:
    return function_mentions(an, node)[0]


def scope_mentions_block(an: Analyzer, node: ast.AST) -> bool:
    anchor, block = function_mentions(an, node)
    return anchor or block
