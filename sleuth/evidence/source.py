"""The code reader: static analysis of DFlash source, read with `ast`, never imported or executed.

It parses the tree once (sleuth/evidence/ast_index.py, the analysis kit), then runs every detector
registered with `@detector("dflash.x")` (sleuth/evidence/registry.py; the detectors live in
sleuth/evidence/detectors/, one module per area of the rules) and returns their readings by id.
An unparseable file becomes an error entry; the other files are still analysed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sleuth.evidence.ast_index import (
    VARIANT_PATTERN,
    Analyzer,
    CodeReading,
    SourceError,
    Unit,
    in_variant_file,
    load_units,
    parse_texts,
)
from sleuth.evidence.harness import harness_units
from sleuth.evidence.registry import code_detectors

__all__ = ["CodeReading", "SourceError", "SourceFacts", "Unit", "analyse_path", "analyse_texts", "analyse_units"]


@dataclass
class SourceFacts:
    readings: dict[str, list[CodeReading]]
    errors: list[SourceError]
    files: list[str]
    # Files left out because they are a probe harness, not the implementation (path -> why).
    excluded: dict[str, str] = field(default_factory=dict)


# Static reading of one tree stops starting detectors after this long (the one running finishes): files are
# bounded too (ast_index.MAX_FILES, MAX_TOTAL_BYTES), so a tree that still takes this long is not a trainer's.
# Our own trainer's code/ takes about a second.
STATIC_READING_BUDGET_S = 60.0


def analyse_units(units: list[Unit], errors: list[SourceError] | None = None, *,
                  entry_modules: tuple[str, ...] = (), started: float | None = None,
                  budget_s: float = STATIC_READING_BUDGET_S) -> SourceFacts:
    """Every detector over `units`, less the probe harness among them (sleuth/evidence/harness.py)."""
    errors = list(errors or [])
    excluded = harness_units(units, entry_modules)
    units = [u for u in units if u.path not in excluded]
    readings: dict[str, list[CodeReading]] = {}
    started = time.monotonic() if started is None else started
    if units:
        an = Analyzer(units)
        errors += an.too_deep
        not_run: list[str] = []
        for key, entry in code_detectors().items():
            if time.monotonic() - started > budget_s:
                not_run.append(key)
                readings[key] = []
                continue
            try:
                readings[key] = _dedupe(entry.func(an), an)
            except RecursionError:
                errors.append(SourceError("<analysis>", f"{key}: analysis too deep"))
                readings[key] = []
        if not_run:
            errors.append(SourceError("<analysis>", f"static reading stopped at its {budget_s:g} s bound: "
                                      f"{len(not_run)} rule reader(s) not run ({', '.join(not_run[:4])}"
                                      f"{', ...' if len(not_run) > 4 else ''})"))
    skipped = {e.path for e in errors}
    return SourceFacts(readings, errors, [u.path for u in units if u.path not in skipped], excluded)


# Other algorithms' code (EAGLE, Domino, DSpark, DFlash2...) never counts as DFlash evidence: the patterns
# live in the analysis kit (sleuth/evidence/ast_index.py), where value paths skip that code too.
_in_variant_file = in_variant_file


def _dedupe(readings: list[CodeReading], an: Analyzer | None = None) -> list[CodeReading]:
    seen, out = set(), []
    for r in readings:
        if _in_variant_file(r.path) or VARIANT_PATTERN.search(r.scope or "") or r.mode == "variant":
            continue
        if an is not None and an.overridden_everywhere(r.scope):
            continue  # a base class's hook that every subclass overrides never runs
        key = (r.path, r.line, str(r.value), r.mode)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def analyse_path(code: Path, entry_modules: tuple[str, ...] = (), *,
                 budget_s: float = STATIC_READING_BUDGET_S) -> SourceFacts:
    started = time.monotonic()
    units, errors = load_units(code)
    return analyse_units(units, errors, entry_modules=entry_modules, started=started, budget_s=budget_s)


def analyse_texts(texts: Iterable[tuple[str, str, str | None]]) -> SourceFacts:
    units, errors = parse_texts(texts)
    return analyse_units(units, errors)
