"""Each serving engine's window semantics, read from playbooks/serving/engines.yaml: the table `trainer eval
--served-as` decodes with too (data shared by both packages; sleuth never imports the trainer).

A drafter trained with sliding-window layers is served as trained by an engine only if that engine counts the
window from the same origin (the anchor: every slot sees the W context positions before it; or each query's
own position) and builds the same block causality. Import-light: YAML and plain values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

ANCHOR, QUERY, IGNORED = "anchor", "query", "none"
ORIGINS = (ANCHOR, QUERY, IGNORED)


class EngineError(ValueError):
    """An engine the table does not know; the message is one line."""


@dataclass(frozen=True)
class Engine:
    key: str
    title: str
    version: str
    read_from: str
    window_origin: str  # anchor | query | none
    sliding_block_causal: bool | str | None  # True / False, "config" (sliding_window_non_causal), None = unknown
    basis: str  # read | run | documented
    fix: str | None
    aliases: tuple[str, ...] = field(default_factory=tuple)
    # How it serves the family's variants ({"dflash2": {...}, "dspark": {...}}); a variant absent = not served.
    family: dict[str, dict[str, Any]] = field(default_factory=dict)

    def sliding_non_causal(self, trained_non_causal: bool | None) -> bool | None:
        """Whether this engine builds the sliding layers bidirectional within the block; None = unknown."""
        if self.sliding_block_causal == "config":
            return trained_non_causal  # the exported config carries the trained flag (speculators' key)
        if self.sliding_block_causal is None:
            return None
        return not self.sliding_block_causal

    def differences(self, trained_origin: str, trained_non_causal: bool | None) -> list[str] | None:
        """How this engine builds a sliding layer unlike the drafter trained it; [] = as trained, None = not
        known (the table leaves part of the engine's semantics undocumented, and nothing else differs)."""
        problems: list[str] = []
        if self.window_origin != trained_origin:
            problems.append(f"it {describe_origin(self.window_origin)}; training {describe_origin(trained_origin)}")
        served = self.sliding_non_causal(trained_non_causal)
        if served is None or trained_non_causal is None:
            return problems or None
        if served != trained_non_causal:
            problems.append(f"its sliding layers are {'bidirectional' if served else 'causal'} within the block, "
                            f"trained {'bidirectional' if trained_non_causal else 'causal'}")
        return problems


def describe_origin(origin: str) -> str:
    return {ANCHOR: "counts the window from the anchor (every slot sees the W positions before it)",
            QUERY: "counts the window from each query (slot j sees only W-1-j context positions)",
            IGNORED: "ignores the window (every layer attends to the whole context)"}.get(origin, origin)


def engines_file() -> Path:
    # The playbooks root moves with SLEUTH_PLAYBOOKS_DIR, as for the invariants and the references.
    override = os.environ.get("SLEUTH_PLAYBOOKS_DIR")
    root = Path(override) if override else Path(__file__).resolve().parents[2] / "playbooks"
    path = root / "serving" / "engines.yaml"
    return path if path.is_file() else Path(__file__).resolve().parents[2] / "playbooks" / "serving" / "engines.yaml"


@lru_cache(maxsize=4)
def _load(path: Path) -> tuple[str, dict[str, Engine]]:
    from sleuth.safe_yaml import load_yaml

    data = load_yaml(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("engines"), dict):
        raise EngineError(f"{path}: no `engines` table")
    engines: dict[str, Engine] = {}
    for key, row in data["engines"].items():
        if not isinstance(row, dict) or row.get("window_origin") not in ORIGINS:
            raise EngineError(f"{path}: engine {key!r} has no valid window_origin (one of {', '.join(ORIGINS)})")
        causal = row.get("sliding_block_causal")
        engines[str(key)] = Engine(
            key=str(key), title=str(row.get("title", key)), version=str(row.get("version", "")),
            read_from=" ".join(str(row.get("read_from", "")).split()), window_origin=row["window_origin"],
            sliding_block_causal=causal if causal in (True, False, None, "config") else None,
            basis=str(row.get("basis", "read")), fix=row.get("fix"),
            aliases=tuple(str(a) for a in row.get("aliases") or []),
            family={str(k): dict(v) for k, v in (row.get("family") or {}).items() if isinstance(v, dict)},
        )
    return str(data.get("default", "speculators")), engines


def load_engines() -> dict[str, Engine]:
    return _load(engines_file())[1]


def default_engine() -> Engine:
    default, engines = _load(engines_file())
    return engines[default]


def resolve_engine(name: str) -> Engine:
    """The engine by key or alias, case-insensitive."""
    wanted = name.strip().lower()
    for engine in load_engines().values():
        if wanted == engine.key.lower() or wanted in (a.lower() for a in engine.aliases):
            return engine
    names = ", ".join(e.key + (f" ({', '.join(e.aliases)})" if e.aliases else "") for e in load_engines().values())
    raise EngineError(f"unknown serving engine {name!r}; known: {names}")


def engine_names() -> list[str]:
    return list(load_engines())


def trained_origin(record: dict[str, Any] | None) -> str:
    """Where the training mask counted the window from: run.json / dflash_training `drafter.window_origin`; our
    trainer has always trained speculators' anchor window (records before the field existed included)."""
    origin = (record or {}).get("window_origin")
    return origin if origin in (ANCHOR, QUERY) else ANCHOR
