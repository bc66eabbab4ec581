"""Which files of a tree are a probe harness (a probe entry, or a helper only it uses), not the implementation.

A user's probe adapter lives beside the trainer it wires (`probe_entry.py`, `trainer/probe.py`). It holds
stand-ins the training never has: parameter copies of the probe's embeddings and lm_head that nothing
freezes, a stand-in causal LM, an optimizer over everything. Read as the implementation, those are false
alarms ("the drafter holds the lm_head ... and nothing freezes it"), so static reading leaves such files
out and says so.

A file is a harness when it speaks the probe protocol (sleuth/probes/protocol.py), whatever it is called:
  * it imports sleuth.probes, or
  * it defines a class with both `describe` and `draft_logits` (the protocol's own pair), or
  * it reads an attribute only the protocol's objects have (`hooks.block_embeddings`, `target.embed_weight`,
    `target.lm_head_weight`, `batch.anchor_valid`, ...);
and a helper is a file that only harness files import and whose name says it serves them (probe, adapter,
shim, harness: `probe_shims.py`). The implementation a harness imports is often imported by nothing else,
so being imported by the entry alone does not make a file a helper.
"""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import PurePath

from sleuth.evidence.ast_index import Unit, tokens
from sleuth.probes.protocol import ProbeHooks

# Attributes only the protocol's objects have: the hooks (read off a `hooks`-like name), the target's shared
# tensors and config helpers (read off anything but `self`). A trainer's own `self.draft_logits` is not one.
HOOK_ATTRIBUTES = frozenset(f.name for f in fields(ProbeHooks))
TARGET_ATTRIBUTES = frozenset({"embed_weight", "lm_head_weight", "norm_weight", "config_kwargs", "qwen3_config"})
HELPER_WORDS = {"probe", "probes", "adapter", "adapters", "shim", "shims", "harness", "sleuth"}


def _module_names(path: str) -> set[str]:
    """The names other files may import this one by: `pkg/mod.py` is `mod`, `pkg.mod` (and `pkg` for
    `pkg/__init__.py`)."""
    parts = list(PurePath(path).with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return {".".join(parts[i:]) for i in range(len(parts))} if parts else set()


def _imports(tree: ast.Module) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            found |= {alias.name for alias in node.names}
            if node.module:
                found.add(node.module)
    return found


def _protocol_attributes(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            continue
        owner = node.value.id
        if node.attr in HOOK_ATTRIBUTES and "hook" in owner.lower():
            found.add(f"{owner}.{node.attr}")
        elif node.attr in TARGET_ATTRIBUTES and owner not in {"self", "cls"}:
            found.add(f"{owner}.{node.attr}")
    return found


def entry_reason(unit: Unit) -> str | None:
    """Why this file is a probe entry, or None."""
    if any(name == "sleuth.probes" or name.startswith("sleuth.probes.") for name in _imports(unit.tree)):
        return "it imports sleuth.probes"
    for node in ast.walk(unit.tree):
        if isinstance(node, ast.ClassDef):
            methods = {s.name for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
            if {"describe", "draft_logits"} <= methods:
                return f"class {node.name} implements the probe protocol (describe, draft_logits)"
    used = _protocol_attributes(unit.tree)
    if used:
        return f"it reads the probe protocol's {', '.join(sorted(used)[:3])}"
    return None


def harness_units(units: list[Unit], entry_modules: tuple[str, ...] = ()) -> dict[str, str]:
    """path -> why it is a harness file, for every probe entry and helper among `units`. `entry_modules`
    names the `--probe-entry` module when one was given (it is a harness whatever it contains). When every
    file is a harness (a protocol subject written in one file with its drafter, like
    examples/probe_protocol.py), none is left out: it is all the implementation there is."""
    found: dict[str, str] = {}
    for unit in units:
        names = _module_names(unit.path)
        if names & set(entry_modules):
            found[unit.path] = "it is the --probe-entry module"
            continue
        reason = entry_reason(unit)
        if reason:
            found[unit.path] = f"a probe entry: {reason}"
    if not found:
        return found
    imported_by: dict[str, set[str]] = {}
    for unit in units:
        for name in _imports(unit.tree):
            imported_by.setdefault(name, set()).add(unit.path)
    for unit in units:
        if unit.path in found:
            continue
        importers = set().union(*(imported_by.get(name, set()) for name in _module_names(unit.path)))
        if importers and importers <= set(found) and set(tokens(PurePath(unit.path).stem)) & HELPER_WORDS:
            entry = sorted(importers)[0]
            found[unit.path] = f"a helper of the probe entry {entry} (only it imports this file)"
    if len(found) == len(units):
        return {}
    return found
