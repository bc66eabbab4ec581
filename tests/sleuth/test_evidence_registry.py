"""The evidence layer as a registry: one place for every reader, checked against the playbook, no circles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from sleuth.evidence.registry import RegistryError, detector, registered
from sleuth.invariants.playbook import PlaybookError, load_playbook, unregistered_readers

REPO = Path(__file__).resolve().parents[2]


def test_every_reader_the_playbook_names_is_registered() -> None:
    playbook = load_playbook("dflash")
    assert unregistered_readers(playbook) == []
    codes = set(registered("code"))
    assert {inv.observed.code for inv in playbook.invariants if inv.observed.code} <= codes
    assert {"fc_layer_count", "fc_norm_present", "embed_head_absent"} <= set(registered("checkpoint"))
    assert {"number", "fc_layers", "target_layer_ids"} <= set(registered("config"))


def test_an_unknown_reader_id_is_a_one_line_playbook_error(tmp_path: Path) -> None:
    data = yaml.safe_load((REPO / "playbooks" / "dflash.yaml").read_text())
    data["invariants"][0]["observed"]["code"] = "dflash.no_such_detector"
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlaybookError) as caught:
        load_playbook(path)
    message = str(caught.value)
    assert "dflash.no_such_detector" in message and "\n" not in message


def test_registering_two_functions_under_one_id_is_refused() -> None:
    from sleuth.evidence import registry

    try:
        @detector("test.registry_twice")
        def first(an):  # noqa: ANN001, ANN202
            return []

        with pytest.raises(RegistryError):
            @detector("test.registry_twice")
            def second(an):  # noqa: ANN001, ANN202
                return []
    finally:
        registry._REGISTRY["code"].pop("test.registry_twice", None)  # leave the real registry as it was


def _imports(path: Path, package: str) -> set[str]:
    """Every sleuth module a file imports, at module level or inside functions."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith(package)}
    return out


def test_the_evidence_layer_has_no_import_circle() -> None:
    root = REPO / "sleuth"
    modules = {}
    for path in (root / "evidence").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {name: {m for m in _imports(path, "sleuth.evidence") if m in modules and m != name}
             for name, path in modules.items()}
    # A package's __init__ importing its own submodules to register them is not a circle back into it.
    graph = {name: {m for m in deps if not (m.startswith(name + "."))} for name, deps in graph.items()}

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return path + [nxt]
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [c for c in (cycle_from(m) for m in graph) if c]
    assert not cycles, cycles[0]


def test_detectors_use_only_public_names_of_the_kit() -> None:
    for path in (REPO / "sleuth" / "evidence" / "detectors").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sleuth."):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports private names {private} from {node.module}"
