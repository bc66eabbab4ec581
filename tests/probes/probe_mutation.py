"""Mutation testing of the probes themselves: can they fail?

Generic operators (AST level: comparison strictness, +/-1 index shifts, repeat <-> repeat_interleave, cat
order, dropped factors and mask terms, swapped arguments, detach / requires_grad / no_grad removed,
constants changed, booleans flipped) are applied automatically to the functions of a DFlash implementation
that hold its rules (a site map per implementation, not a list of hand-made copies). Each mutant is then

  1. checked for a change of behaviour on tiny tensors, under each configuration of the implementation's
     list: its draft logits, d loss / d logits at two logit values (scale-free), the anchors its sampler
     draws for fixed seeds, the block tokens it feeds, its layer ids (at several target depths) and what
     one optimizer step changes. A mutant that changes none of these is equivalent: counted, printed, dropped;
  2. probed (sleuth.probes.worker.run) under the first configuration where it changed behaviour.

Outcomes: `detected` (some verdict is a mismatch), `unknown` (no mismatch, but a verdict the unmodified
code had as match is now unknown: honest), `SILENT` (every verdict as on the unmodified code: the probes
vouched for changed code). The suite fails on any SILENT mutant and on any mismatch of the unmodified code.

Upstream packages run one process per mutant (the copy first on sys.path); the example file runs in the
test's process, each mutant loaded as its own module.

    python tests/probes/probe_mutation.py example                 (the examples/probe_protocol.py part)
    python tests/probes/probe_mutation.py worker SPEC.json OUT.json
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
for entry in (str(REPO), str(REPO / "tests" / "mutation")):
    if entry not in sys.path:
        sys.path.insert(0, entry)

from mutation_operators import Edit, Source, apply_edit  # noqa: E402

EXAMPLE = REPO / "examples" / "probe_protocol.py"

# --- operators -------------------------------------------------------------------------------------------------

Op = Callable[[Source, ast.AST], Iterator[tuple[str, str]]]  # (replacement text of the node, description)
_FLIP = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">", ast.Eq: "!=", ast.NotEq: "=="}


def op_compare(src: Source, node: ast.AST) -> Iterator[tuple[str, str]]:
    """a < b -> a <= b (and the other strictness / equality flips): the off-by-one of a mask or a bound."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIP:
        new = f"{src.seg(node.left)} {_FLIP[type(node.ops[0])]} {src.seg(node.comparators[0])}"
        yield new, f"`{src.seg(node)}` -> `{new}`"


def op_shift(src: Source, node: ast.AST) -> Iterator[tuple[str, str]]:
    """x +/- 1 -> x, and an index i -> i + 1: the shifted position of a label, a block, a layer id."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)) and isinstance(node.right, ast.Constant) \
            and node.right.value == 1:
        yield f"({src.seg(node.left)})", f"`{src.seg(node)}` -> `{src.seg(node.left)}`"
    parent = src.parents.get(node)
    if isinstance(parent, ast.Subscript) and node is parent.slice and isinstance(node, (ast.Name, ast.Attribute)):
        yield f"{src.seg(node)} + 1", f"index `{src.seg(node)}` -> `{src.seg(node)} + 1`"


def op_repeat(src: Source, node: ast.AST) -> Iterator[tuple[str, str]]:
    """repeat_interleave(r, dim=d) -> the same count tiled (repeat): blocks assigned per query the wrong way."""
    if not (isinstance(node, ast.Call) and _call_name(node) == "repeat_interleave"):
        return
    func = node.func
    assert isinstance(func, ast.Attribute)
    if isinstance(func.value, ast.Name) and func.value.id == "torch":  # torch.repeat_interleave(x, r[, dim])
        if len(node.args) < 2:
            return
        tensor, count, rest = node.args[0], node.args[1], node.args[2:]
    else:
        if not node.args:
            return
        tensor, count, rest = func.value, node.args[0], node.args[1:]
    dim = next((src.seg(k.value) for k in node.keywords if k.arg == "dim"), src.seg(rest[0]) if rest else None)
    tiled = f"torch.cat([{src.seg(tensor)}] * ({src.seg(count)}), dim={dim if dim is not None else 0})"
    yield tiled, f"`{src.seg(node)}` tiled with repeat instead of repeat_interleave"


def op_cat_order(src: Source, node: ast.AST) -> Iterator[tuple[str, str]]:
    """torch.cat([a, b, ...]) -> torch.cat([b, a, ...]): context and block swapped, features reordered."""
    if isinstance(node, ast.List) and len(node.elts) >= 2 and isinstance(src.parents.get(node), ast.Call) \
            and _call_name(src.parents[node]) in ("cat", "concat", "stack"):
        a, b = src.seg(node.elts[0]), src.seg(node.elts[1])
        if a != b:
            rest = "".join(", " + src.seg(e) for e in node.elts[2:])
            yield f"[{b}, {a}{rest}]", f"cat order `{a}, {b}` swapped"


def op_drop(src: Source, node: ast.AST) -> Iterator[tuple[str, str]]:
    """a * b -> a, a & b -> a, a + b -> a (and -> b): a mask term, a weight, a correction dropped."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.BitAnd, ast.BitOr)) and not _shape_context(src, node):
        yield f"({src.seg(node.left)})", f"`{src.seg(node)}` -> `{src.seg(node.left)}`"
        yield f"({src.seg(node.right)})", f"`{src.seg(node)}` -> `{src.seg(node.right)}`"
    if isinstance(node, ast.BoolOp) and len(node.values) == 2:
        yield f"({src.seg(node.values[0])})", f"`{src.seg(node)}` -> `{src.seg(node.values[0])}`"


# Calls whose arguments are shapes, dims or attribute names: swapping or changing them only crashes.
_SHAPE_CALLS = {"getattr", "setattr", "hasattr", "isinstance", "issubclass", "view", "reshape", "expand", "permute",
                "transpose", "unsqueeze", "squeeze", "full", "zeros", "ones", "empty", "arange", "randperm", "flatten",
                "unflatten", "split", "chunk", "narrow", "new_zeros", "new_full", "size", "range", "len", "max", "min",
                "register_buffer", "Linear", "Embedding", "get", "pop", "format", "startswith", "join"}
_DIM_KEYWORDS = {"dim", "dims", "axis", "keepdim", "dtype", "device", "stacklevel"}


def _shape_context(src: Source, node: ast.AST) -> bool:
    """The node is (inside) an argument of a shape call or of a constructor (a class: its sizes are the
    architecture's, a design choice, not a DFlash rule), or a dim / dtype keyword."""
    current, child = src.parents.get(node), node
    while current is not None and not isinstance(current, ast.stmt):
        if isinstance(current, ast.keyword) and current.arg in _DIM_KEYWORDS:
            return True
        if isinstance(current, ast.Call) and child is not current.func and (
                _call_name(current) in _SHAPE_CALLS or _call_name(current)[:1].isupper()):
            return True
        child, current = current, src.parents.get(current)
    return False


def op_swap_args(src: Source, node: ast.AST) -> Iterator[tuple[str, str]]:
    """f(a, b, ...) -> f(b, a, ...)."""
    if isinstance(node, ast.Call) and _call_name(node) in _SHAPE_CALLS:
        return
    if isinstance(node, ast.Call) and len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args[:2]) \
            and not any(isinstance(a, ast.Constant) and isinstance(a.value, (int, str)) for a in node.args[:2]):
        a, b = src.seg(node.args[0]), src.seg(node.args[1])
        if a != b:
            head = src.text[_offset(src, node.lineno, node.col_offset):_offset(src, node.args[0].lineno, node.args[0].col_offset)]
            if "\n" not in head:
                rest = src.text[_offset(src, node.args[1].end_lineno, node.args[1].end_col_offset):
                                _offset(src, node.end_lineno, node.end_col_offset)]
                yield f"{head}{b}, {a}{rest}", f"`{_call_name(node)}` arguments `{a}`, `{b}` swapped"


def op_grad(src: Source, node: ast.AST) -> Iterator[tuple[str, str]]:
    """detach() dropped, requires_grad False -> True, torch.no_grad() -> a null context."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "detach" and not node.args:
            yield src.seg(node.func.value), f"`{src.seg(node)}` -> `{src.seg(node.func.value)}`"
        if node.func.attr == "requires_grad_" and node.args and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value is False:
            yield f"{src.seg(node.func.value)}.requires_grad_(True)", f"`{src.seg(node)}` -> requires_grad_(True)"
        if node.func.attr == "no_grad" and src.seg(node.func.value) == "torch":
            yield "__import__('contextlib').nullcontext()", "`torch.no_grad()` -> a null context"
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute) \
            and node.targets[0].attr == "requires_grad" and isinstance(node.value, ast.Constant) and node.value.value is False:
        yield f"{src.seg(node.targets[0])} = True", f"`{src.seg(node)}` -> True"


def op_constant(src: Source, node: ast.AST) -> Iterator[tuple[str, str]]:
    """n -> n + 1 for small integers, x -> 2x for floats, True <-> False."""
    if isinstance(node, ast.Constant) and not isinstance(src.parents.get(node), (ast.Subscript,)) \
            and not _shape_context(src, node):
        value = node.value
        if isinstance(value, bool):
            yield repr(not value), f"`{value}` -> `{not value}`"
        elif isinstance(value, int) and 0 <= value <= 16:
            yield repr(value + 1), f"constant `{value}` -> `{value + 1}`"
        elif isinstance(value, float) and value not in (0.0,):
            yield repr(value * 2), f"constant `{value}` -> `{value * 2}`"


def op_negate(src: Source, node: ast.AST) -> Iterator[tuple[str, str]]:
    """not x -> x; ~mask -> mask."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.Invert)):
        yield f"({src.seg(node.operand)})", f"`{src.seg(node)}` -> `{src.seg(node.operand)}`"


OPERATORS: dict[str, Op] = {
    "compare": op_compare, "shift": op_shift, "repeat": op_repeat, "cat-order": op_cat_order, "drop": op_drop,
    "swap-args": op_swap_args, "grad": op_grad, "constant": op_constant, "negate": op_negate,
}


def _call_name(node: ast.AST) -> str:
    if not isinstance(node, ast.Call):
        return ""
    return node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id if isinstance(node.func, ast.Name) else ""


def _offset(src: Source, line: int, col: int) -> int:
    lines = src.text.splitlines(keepends=True)
    prefix = lines[line - 1].encode("utf-8")[:col].decode("utf-8", errors="ignore")
    return sum(len(x) for x in lines[: line - 1]) + len(prefix)


# --- sites and mutants -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    operator: str
    path: str  # relative to the implementation's root
    line: int
    function: str
    description: str
    edit: Edit

    def label(self) -> str:
        return f"{self.operator} {self.path}:{self.line} {self.function}: {self.description}"


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")

    yield from walk(tree, "")


def _skip(src: Source, node: ast.AST) -> bool:
    """Nodes whose mutation is no behaviour at all: docstrings, messages, defaults, checks that only raise."""
    current: ast.AST | None = node
    while current is not None and not isinstance(current, ast.stmt):
        parent = src.parents.get(current)
        if isinstance(parent, ast.arguments) or isinstance(current, ast.JoinedStr):
            return True
        if isinstance(parent, ast.Call) and _call_name(parent) in ("warn", "warning", "info", "debug", "ValueError",
                                                                  "RuntimeError", "TypeError", "_check"):
            return True
        current = parent
    if isinstance(current, ast.Expr) and isinstance(current.value, ast.Constant):
        return True  # a docstring
    return isinstance(current, (ast.Raise, ast.Assert, ast.Import, ast.ImportFrom))


def mutants_for(root: Path, sites: dict[str, tuple[str, ...]], per_operator: int, total: int,
                seed: int = 0) -> list[Mutant]:
    """Every mutant of the sites (file -> function qualnames, "*" for all), then a seeded sample: at most
    `per_operator` of each operator per file, at most `total` in all."""
    found: dict[tuple[str, str], list[Mutant]] = {}
    for relative, functions in sites.items():
        src = Source.parse(relative, (root / relative).read_text(encoding="utf-8"))
        if src is None:
            raise ValueError(f"{relative} does not parse")
        chosen = [(n, f) for n, f in _functions(src.tree) if "*" in functions or n in functions]
        missing = set(functions) - {"*"} - {n for n, _ in chosen}
        if missing:
            raise ValueError(f"{relative}: no function {sorted(missing)} (the upstream moved: update the site map)")
        seen: set[tuple[int, int, int, int, str]] = set()
        for name, function in chosen:
            for node in ast.walk(function):
                if not hasattr(node, "lineno") or _skip(src, node):
                    continue
                for op_name, op in OPERATORS.items():
                    for text, description in op(src, node):
                        edit = Edit(node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, text)
                        key = (edit.line, edit.col, edit.end_line, edit.end_col, text)
                        if key in seen:
                            continue
                        seen.add(key)
                        mutated = apply_edit(src.text, edit)
                        try:
                            ast.parse(mutated)
                        except SyntaxError:
                            continue
                        found.setdefault((relative, op_name), []).append(
                            Mutant(op_name, relative, node.lineno, name, description, edit))
    rng = random.Random(seed)
    picked: list[Mutant] = []
    for key in sorted(found):
        group = found[key]
        rng.shuffle(group)
        picked += group[:per_operator]
    rng.shuffle(picked)
    return sorted(picked[:total], key=lambda m: (m.path, m.line, m.operator))


# --- behaviour on tiny tensors ---------------------------------------------------------------------------------


def fingerprint(subject: Any, context_seed: int = 0) -> dict[str, Any]:
    """What the implementation does on the probe's tiny batch, in numbers that do not depend on its
    parameter names or the loss's scale."""
    import torch

    from sleuth.probes.experiments import Lab, randomize_drafter
    from sleuth.probes.experiments.inputs import _capture_block_tokens
    from sleuth.probes.experiments.loss import _gradient_at
    from sleuth.probes.target import make_target
    from sleuth.probes.verdict import Expectations

    torch.manual_seed(0)
    info = dict(subject.describe())
    target = make_target(int(info["num_target_layers"]), 0)
    subject.build(target)
    randomize_drafter(subject, target, 7)
    lab = Lab(subject, info, target, Expectations(), 0)
    found: dict[str, Any] = {"layer_ids": list(lab.info.get("layer_ids") or [])}
    rule = getattr(subject, "layer_ids_for", None)
    ids_source = (lab.configured.get("target_layer_ids") or {}).get("source") or ""
    if callable(rule) and "run config" not in ids_source:  # the rule is on the run's path only without explicit ids
        found["layer_ids_for"] = {d: list(rule(d)) for d in (8, 36, 64)}
    # Logits of real blocks only: a padded anchor slot's output is discarded by every trainer (the protocol: its
    # block stays out of the loss); whether padding is trained shows in the gradients below.
    found["logits"] = lab.baseline[lab.batch.anchor_valid]
    n, a = lab.batch.anchors.shape
    v = target.vocab_size
    g = torch.Generator().manual_seed(5)
    for name, z in (("grad0", torch.zeros(n, a, lab.block_size, v, dtype=torch.float64)),
                    ("grad2", 2.0 * torch.randn(n, a, lab.block_size, v, generator=g, dtype=torch.float64))):
        grad = _gradient_at(lab, z)
        found[name] = None if grad is None else grad / grad.abs().max().clamp_min(1e-30)
    tokens, _ = _capture_block_tokens(lab)
    found["block_tokens"] = tokens
    sampler = getattr(subject, "sample_anchors", None)
    if callable(sampler):
        draws = []
        for draw in range(3):
            torch.manual_seed(100 + draw)
            anchors, valid = sampler(lab.batch, 5)
            draws.append((anchors.reshape(-1).tolist(), valid.reshape(-1).tolist()))
        found["anchors"] = draws
    params = subject.parameters()
    before = {k: p.detach().clone() for k, p in params.items()}
    shared = (target.embed_weight.clone(), target.lm_head_weight.clone())
    subject.train_step(lab.batch)
    found["step_changed"] = sorted(k for k, p in params.items() if not torch.equal(before[k], p.detach()))
    found["step_shared_changed"] = [not torch.equal(shared[0], target.embed_weight),
                                    not torch.equal(shared[1], target.lm_head_weight)]
    return found


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The fingerprint entries that differ (tensors beyond float rounding)."""
    import torch

    changed = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or not torch.allclose(x.double(), y.double(), rtol=1e-5, atol=1e-6 * max(
                    float(x.abs().max()), 1e-30)):
                changed.append(key)
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            changed.append(key)
        elif x != y:
            changed.append(key)
    return changed


def _probe(spec: dict[str, Any]) -> dict[str, Any]:
    from sleuth.probes.worker import run

    answer = run({**spec, "threads": 1, "seed": 0})
    return {"error": answer.get("error"), "verdicts": {v["invariant"]: [v["status"], v["observed"] or v["reason"]]
                                                        for v in answer["verdicts"]},
            "seconds": answer.get("seconds", {}).get("total")}


def run_mutant(spec: dict[str, Any], load: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """In one process: the fingerprint under each configuration until one differs from the reference, then
    the probes under that configuration. Without a reference (the unmodified code): every fingerprint, and
    the probes under every configuration."""
    reference = spec.get("reference")
    result: dict[str, Any] = {"fingerprints": [], "probes": {}, "changed": None, "crash": None}
    for index, config in enumerate(spec["configs"]):
        context = {"config": config.get("config"), "config_path": config.get("config_path")}
        try:
            found = fingerprint(load({**spec, "context": context}))
        except Exception as exc:  # a mutant that crashes on tiny tensors changed behaviour
            found = None
            crash = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        if reference is None:
            result["fingerprints"].append(found)
            result["probes"][index] = _probe({**spec, "context": context})
            continue
        if found is None:
            result["changed"], result["crash"] = index, crash
            result["probes"][index] = _probe({**spec, "context": context})
            return result
        diff = differences(reference[index], found)
        if diff:
            result["changed"] = index
            result["differs"] = diff
            result["probes"][index] = _probe({**spec, "context": context})
            return result
    return result


# --- the harness -----------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    mutant: Mutant
    status: str  # equivalent | crash | detected | unknown | SILENT
    config: int | None = None
    detail: str = ""


@dataclass
class Score:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    baseline_mismatches: list[str] = field(default_factory=list)
    baseline_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def planted(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status not in ("equivalent", "crash")]

    @property
    def silent(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "SILENT"]

    def summary(self) -> str:
        counts = Counter(o.status for o in self.outcomes)
        planted = len(self.planted)
        recall = counts["detected"] / planted if planted else 1.0
        return (f"{self.name}: {len(self.outcomes)} mutants, {counts['equivalent']} equivalent (dropped), "
                f"{counts['crash']} crash on tiny tensors (dropped), {planted} changed behaviour: {counts['detected']} detected (recall {recall:.0%}), {counts['unknown']} unknown, "
                f"{counts['SILENT']} SILENT; unmodified: {len(self.baseline_mismatches)} mismatches"
                f"{', errors ' + '; '.join(self.baseline_errors) if self.baseline_errors else ''}; {self.seconds:.0f} s")

    def table(self) -> str:
        lines = [f"  {o.status:10} cfg {'-' if o.config is None else o.config}  {o.mutant.label()[:150]}"
                 + (f"  [{o.detail[:120]}]" if o.detail else "") for o in self.outcomes]
        return "\n".join([*lines, *[f"  unmodified mismatch: {m}" for m in self.baseline_mismatches], self.summary()])


def classify(mutant: Mutant, result: dict[str, Any], baseline: dict[int, dict[str, Any]]) -> Outcome:
    index = result.get("changed")
    if index is None:
        return Outcome(mutant, "equivalent")
    probes = result["probes"][index]
    detail = result.get("crash") or ", ".join(result.get("differs") or [])
    if result.get("crash"):  # it raises on the probe's tiny batch: any run shows it, no probe question
        return Outcome(mutant, "crash", index, result["crash"])
    if probes.get("error"):
        return Outcome(mutant, "unknown", index, f"no experiment ran: {probes['error'][:100]}")
    verdicts = probes["verdicts"]
    mismatched = sorted(k for k, (s, _) in verdicts.items() if s == "mismatch")
    if mismatched:
        return Outcome(mutant, "detected", index, ", ".join(k.removeprefix("dflash.") for k in mismatched))
    before = baseline[index]["verdicts"]
    lost = sorted(k for k, (s, _) in verdicts.items() if before.get(k, ["?"])[0] == "match" and s != "match")
    if lost:
        return Outcome(mutant, "unknown", index, "unknown: " + ", ".join(k.removeprefix("dflash.") for k in lost)
                       + f" (changed: {detail})")
    return Outcome(mutant, "SILENT", index, f"changed: {detail}")


def score_package(name: str, kind: str, package: Path, sites: dict[str, tuple[str, ...]], configs: list[dict[str, Any]],
                  python: str, *, per_operator: int, total: int, jobs: int = 2, timeout_s: float = 300) -> Score:
    """Mutants of an installed package, one child process each (copy of the package first on sys.path)."""
    from concurrent.futures import ThreadPoolExecutor

    started = time.monotonic()
    result = Score(name)
    mutants = mutants_for(package, sites, per_operator, total)
    with tempfile.TemporaryDirectory(prefix=f"probe-mutants-{name}-") as tmp:
        root = Path(tmp)

        def child(label: str, mutant: Mutant | None, reference: list | None) -> dict[str, Any]:
            work = root / label / package.name
            shutil.copytree(package, work, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            if mutant is not None:
                path = work / mutant.path
                path.write_text(apply_edit(path.read_text(encoding="utf-8"), mutant.edit), encoding="utf-8")
            spec = {"subject": kind, "package_dir": str(work), "sys_path": [str(work.parent)], "configs": configs,
                    "reference_file": None}
            if reference is not None:
                ref_path = root / label / "reference.pt"
                import torch

                torch.save(reference, ref_path)
                spec["reference_file"] = str(ref_path)
            spec_path, out_path = root / label / "spec.json", root / label / "out.pt"
            spec_path.write_text(json.dumps(spec))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(work.parent), str(REPO)]), "OMP_NUM_THREADS": "1",
                   "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "TORCHDYNAMO_DISABLE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
            try:
                subprocess.run([python, str(Path(__file__)), "worker", str(spec_path), str(out_path)], cwd=root / label,
                               env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired:
                return {"changed": 0, "crash": f"timed out after {timeout_s:.0f} s",
                        "probes": {0: {"error": "timed out", "verdicts": {}}}}
            import torch

            if not out_path.is_file():
                return {"changed": 0, "crash": "the worker wrote no answer", "probes": {0: {"error": "no answer", "verdicts": {}}}}
            return torch.load(out_path, weights_only=False)

        base = child("unmodified", None, None)
        reference = base["fingerprints"]
        if any(f is None for f in reference):
            result.baseline_errors.append("the unmodified code does not run on the probe's batch")
        for index, probes in base["probes"].items():
            if probes.get("error"):
                result.baseline_errors.append(f"config {index}: {probes['error']}")
            result.baseline_mismatches += [f"config {index}: {k}: {o}" for k, (s, o) in probes["verdicts"].items()
                                           if s == "mismatch"]
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            answers = list(pool.map(lambda im: child(f"m{im[0]:03d}", im[1], reference), enumerate(mutants)))
        result.outcomes = [classify(m, a, base["probes"]) for m, a in zip(mutants, answers)]
    result.seconds = time.monotonic() - started
    return result


def score_example(per_operator: int = 5, total: int = 40) -> Score:
    """Mutants of examples/probe_protocol.py, each loaded as its own module in this process."""
    started = time.monotonic()
    result = Score("examples/probe_protocol.py")
    sites = {"probe_protocol.py": ("rotate", "Rotary.forward", "Layer.forward", "Drafter.forward",
                                   "reference_layer_ids", "TinyDFlash.build", "TinyDFlash.mask", "TinyDFlash._logits",
                                   "TinyDFlash.loss", "TinyDFlash.sample_anchors", "TinyDFlash.parameters")}
    configs = EXAMPLE_CONFIGS
    with tempfile.TemporaryDirectory(prefix="probe-mutants-example-") as tmp:
        root = Path(tmp)
        shutil.copy(EXAMPLE, root / "probe_protocol.py")
        mutants = mutants_for(root, sites, per_operator, total)
        original = (root / "probe_protocol.py").read_text(encoding="utf-8")

        def loader(text: str, tag: str) -> Callable[[dict[str, Any]], Any]:
            path = root / f"probe_protocol_{tag}.py"
            path.write_text(text, encoding="utf-8")
            spec = importlib.util.spec_from_file_location(f"probe_protocol_{tag}", path)
            module = importlib.util.module_from_spec(spec)
            assert spec.loader is not None
            spec.loader.exec_module(module)
            return lambda s: module.subject(s.get("context") or {})

        base_load = loader(original, "unmodified")
        base = run_in_process({"configs": configs}, base_load)
        for index, probes in base["probes"].items():
            result.baseline_mismatches += [f"config {index}: {k}: {o}" for k, (s, o) in probes["verdicts"].items()
                                           if s == "mismatch"]
        for number, mutant in enumerate(mutants):
            try:
                load = loader(apply_edit(original, mutant.edit), f"m{number:03d}")
            except Exception as exc:  # the module does not even import: a crash, which any run shows
                result.outcomes.append(Outcome(mutant, "equivalent", None, f"does not import: {exc}"))
                continue
            answer = run_in_process({"configs": configs, "reference": base["fingerprints"]}, load)
            result.outcomes.append(classify(mutant, answer, base["probes"]))
    result.seconds = time.monotonic() - started
    return result


# Configurations of the example the mutants run under: a run config with a non-default gamma (so a gamma the
# code ignores shows), D-PACE weighting, and KL; each mutant is probed under the first one it changes.
EXAMPLE_CONFIGS = [{"config": {"gamma": 7.0}}, {"config": {"weighting": "dpace"}}, {"config": {"loss": "kl"}}]


def run_in_process(spec: dict[str, Any], load: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """run_mutant for a subject loaded in this process (the probes run on a fresh subject from `load`)."""
    import sleuth.probes.worker as worker

    original = worker.load_subject
    worker.load_subject = load
    try:
        return run_mutant(spec, load)
    finally:
        worker.load_subject = original


def worker_main(spec_path: Path, out_path: Path) -> int:
    import torch

    from sleuth.probes.worker import load_subject, refuse_network

    spec = json.loads(spec_path.read_text())
    refuse_network()
    torch.set_num_threads(1)
    if spec.get("reference_file"):
        spec["reference"] = torch.load(spec["reference_file"], weights_only=False)
    for entry in reversed(spec.get("sys_path") or []):
        sys.path.insert(0, entry)
    import warnings

    warnings.simplefilter("ignore")
    answer = run_mutant(spec, load_subject)
    torch.save(answer, out_path)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        raise SystemExit(worker_main(Path(sys.argv[2]), Path(sys.argv[3])))
    if sys.argv[1:2] == ["example"]:
        score = score_example()
        print(score.table())
        raise SystemExit(1 if score.silent or score.baseline_mismatches else 0)
    raise SystemExit(__doc__)
