"""Mutation operators: plant one known DFlash defect (or one meaning-preserving rewrite) in real source.

Each operator knows the invariant it breaks and where it applies. Sites are found in the source itself:
around the lines the unmutated diagnosis cited for that invariant (the enclosing function of each cited
line), or over the whole tree for rules that hold at every site (every freeze of embeddings and lm_head).
An operator is the oracle, like a person planting a defect: it may use names to find the anchor comparison
or the frozen head, because the corpus and upstream code name them truthfully; sleuth may not.

A mutant is a text edit of one file (spliced at the node's exact columns, so the rest of the file keeps its
formatting and lines). `breaks` is None for a rewrite that must change no verdict (a rename through an
intermediate variable, a slice moved into a variable, an expression moved into a helper).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Edit:
    """Replace the text of lines [line, end_line] columns [col, end_col) with `text`; optionally insert
    `before` as whole lines above `stmt_line` (indented like it) and `append` at the end of the file."""

    line: int
    col: int
    end_line: int
    end_col: int
    text: str
    before: str | None = None
    stmt_line: int | None = None
    append: str | None = None


@dataclass(frozen=True)
class Mutant:
    operator: str
    breaks: str | None  # the invariant the mutant violates; None: a rewrite that must keep every verdict
    path: str  # file, relative to the implementation's root
    line: int
    description: str
    edit: Edit

    def apply(self, text: str) -> str:
        return apply_edit(text, self.edit)


def apply_edit(text: str, edit: Edit) -> str:
    lines = text.splitlines(keepends=True)
    start = _offset(lines, edit.line, edit.col)
    end = _offset(lines, edit.end_line, edit.end_col)
    joined = "".join(lines)
    out = joined[:start] + edit.text + joined[end:]
    if edit.before is not None and edit.stmt_line is not None:
        out_lines = out.splitlines(keepends=True)
        target = out_lines[edit.stmt_line - 1]
        indent = target[: len(target) - len(target.lstrip())]
        out_lines.insert(edit.stmt_line - 1, indent + edit.before + "\n")
        out = "".join(out_lines)
    if edit.append:
        out = out.rstrip("\n") + "\n\n\n" + edit.append + "\n"
    return out


def _offset(lines: list[str], line: int, col: int) -> int:
    # ast columns are UTF-8 byte offsets
    prefix = lines[line - 1].encode("utf-8")[:col].decode("utf-8", errors="ignore")
    return sum(len(x) for x in lines[: line - 1]) + len(prefix)


@dataclass
class Source:
    """One parsed file of an implementation."""

    path: str
    text: str
    tree: ast.Module
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)

    @classmethod
    def parse(cls, path: str, text: str) -> Source | None:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError):
            return None
        src = cls(path, text, tree)
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                src.parents[child] = node
        return src

    def seg(self, node: ast.AST) -> str:
        return ast.get_source_segment(self.text, node) or ast.unparse(node)

    def statement(self, node: ast.AST) -> ast.stmt | None:
        current: ast.AST | None = node
        while current is not None and not isinstance(current, ast.stmt):
            current = self.parents.get(current)
        return current  # type: ignore[return-value]

    def region(self, line: int) -> list[ast.AST]:
        """Nodes of the function that holds `line` (the whole statement at module level)."""
        best: ast.AST | None = None
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (node.end_lineno or node.lineno):
                if best is None or node.lineno >= best.lineno:
                    best = node
        if best is None:
            for stmt in self.tree.body:
                if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
                    best = stmt
        return list(ast.walk(best)) if best is not None else []


def _edit(node: ast.AST, text: str, **extra) -> Edit:
    return Edit(node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, text, **extra)  # type: ignore[attr-defined]


def _in_scoped_expr(src: Source, node: ast.AST) -> bool:
    """Inside a lambda or comprehension (where a hoisted expression would lose its variables), a default
    argument, a decorator, or a loop/branch header (hoisting would not re-evaluate it)."""
    current, child = src.parents.get(node), node
    while current is not None and not isinstance(current, ast.stmt):
        if isinstance(current, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.arguments)):
            return True
        child, current = current, src.parents.get(current)
    if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.For, ast.While, ast.If, ast.With,
                            ast.Return)) and not isinstance(current, ast.Return):
        return True
    return current is None


# --- the operators ---------------------------------------------------------------------------------------

ANCHOR_WORDS = re.compile(r"anchor|\bstart|\banc\b|\bp\b|block_start|\bpos0", re.I)
FREEZE_TARGET = re.compile(r"embed|lm_head|\bhead\b|tok_emb|wte|vocab", re.I)
STRICT_FLIP = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">"}


def strict_flip(src: Source, lines: list[int]) -> Iterator[tuple[ast.AST, Edit, str]]:
    """kv < anchor -> kv <= anchor (and the blocked-side mirror): the anchor's own position leaks."""
    for node in _region_nodes(src, lines):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in STRICT_FLIP:
            left, right = src.seg(node.left), src.seg(node.comparators[0])
            if not (ANCHOR_WORDS.search(left) or ANCHOR_WORDS.search(right)) or re.search(r"seq_len|len\(|\.shape", left + right):
                continue
            if re.search(r"window|sliding", left + right) or re.search(r"-\s*[A-Za-z_]", left + right):
                continue  # a window's lower bound, not the anchor's exclusion
            op = STRICT_FLIP[type(node.ops[0])]
            yield node, _edit(node, f"{left} {op} {right}"), f"`{src.seg(node)}` -> `{left} {op} {right}`"


def remove_shift(src: Source, lines: list[int]) -> Iterator[tuple[ast.AST, Edit, str]]:
    """x - 1 -> x where the target index is built; roll(x, 1) -> roll(x, 0)."""
    for node in _region_nodes(src, lines):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and isinstance(node.right, ast.Constant) \
                and node.right.value == 1 and not re.search(r"gamma|decay|len|size|shape|num|\bk\b", src.seg(node.left)) \
                and not _inside_call(src, node, {"exp", "pow", "range", "arange"}) and _feeds_an_index(src, node):
            yield node, _edit(node, f"({src.seg(node.left)})"), f"`{src.seg(node)}` -> `{src.seg(node.left)}`"
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)) and \
                (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "roll":
            for kw in node.keywords:
                if kw.arg == "shifts" and isinstance(kw.value, ast.Constant) and kw.value.value == 1:
                    yield node, _edit(kw.value, "0"), "roll shift 1 -> 0"
            args = node.args[1:] if isinstance(node.func, ast.Name) or _is_module_call(node) else node.args
            for arg in args[:1]:
                if isinstance(arg, ast.Constant) and arg.value == 1:
                    yield node, _edit(arg, "0"), "roll shift 1 -> 0"


def _inside_call(src: Source, node: ast.AST, names: set[str]) -> bool:
    current = src.parents.get(node)
    while current is not None and not isinstance(current, ast.stmt):
        if isinstance(current, ast.Call) and _call_name(current) in names:
            return True
        current = src.parents.get(current)
    return False


def _call_name(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id if isinstance(node.func, ast.Name) else ""


def _feeds_an_index(src: Source, node: ast.AST) -> bool:
    """The shifted value is used to index the target: it sits in a subscript's index or a gather, or the
    variable it is assigned to does, later in the same function."""
    current = src.parents.get(node)
    while current is not None and not isinstance(current, ast.stmt):
        parent = src.parents.get(current)
        if isinstance(parent, ast.Subscript) and current is parent.slice:
            return True
        if isinstance(parent, ast.Call) and _call_name(parent) in {"gather", "take_along_dim", "take_along_axis", "index_select", "take"}:
            return True
        current = parent
    stmt = src.statement(node)
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        name = stmt.targets[0].id
        scope = src.parents.get(stmt)
        for other in ast.walk(scope) if scope is not None else []:
            if isinstance(other, ast.Subscript) and any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(other.slice)):
                return True
            if isinstance(other, ast.Call) and _call_name(other) in {"gather", "take_along_dim", "index_select", "take"} and \
                    any(isinstance(n, ast.Name) and n.id == name for a in other.args for n in ast.walk(a)):
                return True
    return False


def _in_branch(src: Source, node: ast.AST) -> bool:
    current = src.parents.get(node)
    while current is not None and not isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
        if isinstance(current, ast.If):
            return True
        current = src.parents.get(current)
    return False


def _is_module_call(node: ast.Call) -> bool:
    return isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) and node.func.value.id in {"torch", "np", "jnp"}


def slot0_weighted(src: Source, lines: list[int]) -> Iterator[tuple[ast.AST, Edit, str]]:
    """w[0] = 0 deleted; arange(1, B) -> arange(0, B); j >= 1 / j > 0 -> j >= 0."""
    for node in _region_nodes(src, lines):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript) \
                and isinstance(node.value, ast.Constant) and node.value.value in (0, 0.0, False):
            index = src.seg(node.targets[0].slice)
            if re.fullmatch(r"(\.\.\.,\s*|:,\s*)*0", index.strip()):
                yield node, _edit(node, "pass"), f"deleted `{src.seg(node)}`"
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.comparators[0], ast.Constant):
            op, c = type(node.ops[0]), node.comparators[0].value
            if (op is ast.GtE and c == 1) or (op is ast.Gt and c == 0) or (op is ast.NotEq and c == 0):
                if re.search(r"slot|\bj\b|\bk\b|offset|pos_in_block|idx", src.seg(node.left)):
                    yield node, _edit(node, f"{src.seg(node.left)} >= 0"), f"`{src.seg(node)}` -> `... >= 0`"


def disable_decay(src: Source, lines: list[int]) -> Iterator[tuple[ast.AST, Edit, str]]:
    """exp(-(k-1)/gamma) -> ones_like(...): the decay is gone, the gamma default stays behind unread."""
    for node in _region_nodes(src, lines):
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)) and \
                (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "exp" and node.args:
            if re.search(r"gamma|decay", src.seg(node)):
                arg = src.seg(node.args[0])
                yield node, _edit(node, f"torch.ones_like({arg})"), f"`{src.seg(node)}` -> `torch.ones_like(...)`"


def layer_off_by_one(src: Source, lines: list[int]) -> Iterator[tuple[ast.AST, Edit, str]]:
    """The layer rule's start (round(1 + ...)) or the first listed id moved by one."""
    for node in _region_nodes(src, lines):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.Constant) \
                and node.left.value == 1 and isinstance(node.right, ast.BinOp):
            yield node, _edit(node.left, "2"), "layer rule starts at 2"
            return
        if isinstance(node, ast.Assign) and re.search(r"start", src.seg(node.targets[0])) and isinstance(node.value, ast.Tuple):
            first = node.value.elts[0]
            if isinstance(first, ast.Constant) and first.value == 1:
                yield node, _edit(first, "2"), "layer rule starts at 2"
                return
        if isinstance(node, ast.List) and len(node.elts) >= 3 and all(isinstance(e, ast.Constant) and isinstance(e.value, int) for e in node.elts):
            first = node.elts[0]
            yield node, _edit(first, str(first.value + 1)), f"first layer id {first.value} -> {first.value + 1}"
            return


def intermediate_teacher(src: Source, lines: list[int]) -> Iterator[tuple[ast.AST, Edit, str]]:
    """outputs.logits / hidden_states[-1] -> lm_head(norm(hidden_states[LAYER_IDS[-1] + 1])): the teacher
    becomes the last selected layer, projected. The model's own `.logits` is the teacher's main path; a
    `hidden_states[-1]` elsewhere in the region may be a branch the run's config does not take, so it is
    only a site when there is no `.logits` one."""
    logits_sites, last_sites = [], []
    for node in _region_nodes(src, lines):
        stmt = src.statement(node)
        # only the teacher's expression: its statement names logits or the head (not the drafter's context)
        if stmt is None or not re.search(r"logit|lm_head|teacher|target_prob|soft", src.seg(stmt), re.I):
            continue
        if isinstance(node, ast.Attribute) and node.attr == "logits" and isinstance(node.ctx, ast.Load) \
                and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            recv = src.seg(node.value)
            text = f"lm_head(final_norm({recv}.hidden_states[TARGET_LAYER_IDS[-1] + 1]))"
            logits_sites.append((node, _edit(node, text), f"`{src.seg(node)}` -> `{text}`"))
        if _in_branch(src, node):
            continue  # a branch the run's config may not take (trainer: the layer-id path of logits_source)
        if isinstance(node, ast.Subscript) and re.search(r"hidden", src.seg(node.value)) and \
                isinstance(node.slice, ast.UnaryOp) and isinstance(node.slice.op, ast.USub) and \
                isinstance(node.slice.operand, ast.Constant) and node.slice.operand.value == 1:
            last_sites.append((node, _edit(node.slice, "-4"), f"`{src.seg(node)}` -> index -4 (an intermediate layer)"))
    yield from logits_sites or last_sites


def helper_arg_offset(src: Source, lines: list[int]) -> Iterator[tuple[ast.AST, Edit, str]]:
    """anchor + j -> _slot_position(anchor + 1, j), the offset inside a helper: positions one too far."""
    for node in _region_nodes(src, lines):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and ANCHOR_WORDS.search(src.seg(node.left)) \
                and re.search(r"arange|offset|offs|slot|\bj\b|range|\bk\b", src.seg(node.right)):
            left, right = src.seg(node.left), src.seg(node.right)
            helper = "def _slot_position(start, offset):\n    return start + offset"
            yield node, _edit(node, f"_slot_position({left} + 1, {right})", append=helper), \
                f"`{src.seg(node)}` -> `_slot_position({left} + 1, {right})`"
            return


WHOLE_MODEL = re.compile(r"^(self\.)?(verifier|target|teacher|base_model|base|model)(\.eval\(\))?(\.parameters\(\))?$")


def delete_freeze_line(src_files: list[Source]) -> Iterator[tuple[Source, ast.AST, Edit, str]]:
    """One of several freezes of the embeddings or lm_head undone (needs at least two). A freeze that is
    the value of an assignment (`self.tok = emb.requires_grad_(False)`) loses only the freeze. Not applied
    when the whole verifier/target is frozen too: the shared tables would stay frozen through it."""
    sites: list[tuple[Source, ast.AST]] = []
    for src in src_files:
        for node in ast.walk(src.tree):
            if isinstance(node, ast.Call) and _call_name(node) == "requires_grad_" and isinstance(node.func, ast.Attribute) \
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value is False:
                owner = src.seg(node.func.value)
                if WHOLE_MODEL.match(owner):
                    return
                loop = src.parents.get(src.statement(node))
                if isinstance(loop, ast.For) and WHOLE_MODEL.match(src.seg(loop.iter)):
                    return
            if not isinstance(node, (ast.Expr, ast.Assign)):
                continue
            text = src.seg(node)
            freezes = re.search(r"requires_grad_\(\s*False\s*\)|\.requires_grad\s*=\s*False", text)
            if freezes and FREEZE_TARGET.search(text) and not re.search(r"\bfor\b", text):
                sites.append((src, node))
    if len(sites) < 2:
        return
    for src, node in sites:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _call_name(node.value) == "requires_grad_" \
                and isinstance(node.value.func, ast.Attribute):
            receiver = src.seg(node.value.func.value)
            yield src, node, _edit(node.value, receiver), f"`{src.seg(node)}` without the freeze"
        else:
            yield src, node, _edit(node, "pass"), f"deleted `{src.seg(node)}`"


# --- meaning-preserving rewrites (composed with the ones above, or alone) --------------------------------


def hoist(src: Source, node: ast.AST, replacement: str, name: str) -> Edit | None:
    """Move an expression into a variable named `name` on the line above its statement."""
    if _in_scoped_expr(src, node):
        return None
    stmt = src.statement(node)
    if stmt is None or stmt.lineno != node.lineno:  # keep it simple: the expression starts on its statement's line
        return None
    return Edit(node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, name,  # type: ignore[attr-defined]
                before=f"{name} = {replacement}", stmt_line=stmt.lineno)


def slices_in(src: Source, lines: list[int]) -> Iterator[tuple[ast.AST, Edit, str]]:
    """An inline slice or index expression assigned to a variable first (must change no verdict)."""
    for node in _region_nodes(src, lines):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            edit = hoist(src, node, src.seg(node), "sliced_value")
            if edit is not None:
                yield node, edit, f"`{src.seg(node)}` assigned to a variable first"
                return


def _region_nodes(src: Source, lines: list[int]) -> list[ast.AST]:
    seen: set[int] = set()
    out: list[ast.AST] = []
    for line in lines:
        for node in src.region(line):
            if id(node) not in seen and hasattr(node, "lineno"):
                seen.add(id(node))
                out.append(node)
    return sorted(out, key=lambda n: (n.lineno, n.col_offset))  # type: ignore[attr-defined]


SiteFinder = Callable[[Source, list[int]], Iterator[tuple[ast.AST, Edit, str]]]


@dataclass(frozen=True)
class Operator:
    name: str
    breaks: str | None
    find: SiteFinder
    # A misleading name for the rename-through-a-variable variant (None: no such variant).
    decoy: str | None = None


OPERATORS: list[Operator] = [
    Operator("strict_to_nonstrict", "dflash.context_excludes_anchor", strict_flip, decoy="before_anchor"),
    Operator("remove_shift", "dflash.target_shift", remove_shift, decoy="shifted_index"),
    Operator("slot0_weighted", "dflash.anchor_slot_untrained", slot0_weighted),
    Operator("disable_decay", "dflash.loss_decay_gamma", disable_decay, decoy="decayed"),
    Operator("layer_off_by_one", "dflash.target_layer_ids", layer_off_by_one),
    Operator("intermediate_teacher", "dflash.target_logits_source", intermediate_teacher, decoy="last"),
    Operator("helper_arg_offset", "dflash.block_position_ids", helper_arg_offset),
]
# Rewrites that must keep every verdict (a rename or slice through a variable).
REWRITES: list[Operator] = [
    Operator("slice_through_variable", None, slices_in),
]


def read_sources(root: Path) -> list[Source]:
    out = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        src = Source.parse(str(path.relative_to(root)), path.read_text(encoding="utf-8", errors="replace"))
        if src is not None:
            out.append(src)
    return out
