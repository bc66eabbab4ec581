"""A drafter's attention as each serving engine builds it: `trainer eval --served-as ENGINE`.

The engines and their window semantics are data, playbooks/serving/engines.yaml, the table sleuth's
`dflash.sliding_window_served` reads too (neither package imports the other). This module turns a row into
what the drafter needs at inference: the mask of its sliding layers for one block over a KV cache
(full-attention layers are bidirectional over everything before the anchor in every engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from trainer.model.attention_mask import WINDOW_FROM_ANCHOR, WINDOW_FROM_QUERY, DraftAttention, decode_window_mask

ENGINES_FILE = Path(__file__).resolve().parents[2] / "playbooks" / "serving" / "engines.yaml"
WINDOW_IGNORED = "none"


class ServedAsError(ValueError):
    """An engine the table does not know, or cannot emulate; the message is one line."""


@dataclass(frozen=True)
class ServedAs:
    """One engine's row: how it builds a sliding layer (the table's header explains the fields)."""

    engine: str
    title: str
    version: str
    window_origin: str  # "anchor" | "query" | "none"
    sliding_block_causal: bool | None  # None: from the drafter config's sliding_window_non_causal
    emulated: bool

    def sliding_non_causal(self, attention: DraftAttention) -> bool:
        """Whether this engine's sliding layers are bidirectional within the block, for this drafter."""
        if self.sliding_block_causal is None:
            return attention.sliding_window_non_causal
        return not self.sliding_block_causal

    def serves_as_trained(self, attention: DraftAttention) -> bool:
        """Our trainer trains speculators' rule (anchor windows, the config's block causality)."""
        if not attention.slides:
            return True
        return self.window_origin == WINDOW_FROM_ANCHOR and self.sliding_non_causal(attention) == \
            attention.sliding_window_non_causal

    def semantics(self, attention: DraftAttention) -> tuple[str, bool]:
        """(window origin, sliding layers bidirectional): engines with equal semantics decode identically."""
        return self.window_origin, self.sliding_non_causal(attention)

    def sliding_mask(self, attention: DraftAttention, context_length: int, block_size: int, device: Any) -> Any:
        """The sliding layers' mask for one block whose anchor sits at `context_length` ([1, 1, B, C+B] bool),
        or None where the engine ignores the window and attends to everything (a full layer's mask)."""
        if self.window_origin == WINDOW_IGNORED:
            if self.sliding_non_causal(attention):
                return None
            # A window-less causal block: the anchor rule with a window wider than any context.
            return decode_window_mask(context_length, block_size, context_length + block_size, False, device)
        assert attention.sliding_window is not None
        return decode_window_mask(context_length, block_size, attention.sliding_window,
                                  self.sliding_non_causal(attention), device, self.window_origin)


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    with ENGINES_FILE.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def default_engine() -> str:
    return str(_table()["default"])


def engine_names(emulated_only: bool = False) -> list[str]:
    return [name for name, row in _table()["engines"].items() if row.get("emulated") or not emulated_only]


def served_as(name: str | None) -> ServedAs:
    """The engine named (its key or an alias, case-insensitive); None = the default (speculators / vLLM)."""
    engines = _table()["engines"]
    wanted = (name or default_engine()).strip().lower()
    for key, row in engines.items():
        if wanted == key.lower() or wanted in [str(a).lower() for a in row.get("aliases") or []]:
            if not row.get("emulated"):
                raise ServedAsError(f"{key}'s window semantics are only partly documented ({row.get('basis')}): "
                                    f"--served-as supports {', '.join(engine_names(True))}")
            origin = row["window_origin"]
            if origin not in (WINDOW_FROM_ANCHOR, WINDOW_FROM_QUERY, WINDOW_IGNORED):
                raise ServedAsError(f"{ENGINES_FILE}: {key} has an unknown window_origin {origin!r}")
            causal = row.get("sliding_block_causal")
            return ServedAs(engine=key, title=str(row.get("title", key)), version=str(row.get("version", "")),
                            window_origin=origin, sliding_block_causal=None if causal == "config" else bool(causal),
                            emulated=True)
    raise ServedAsError(f"unknown serving engine {name!r}; choose from {', '.join(engine_names(True))}")
