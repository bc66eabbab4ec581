"""Which member of the DFlash family a run, an export or a checkpoint holds: one reader, used by every check.

The variants change what a drafter must satisfy (shared DFLASH_FAMILY.md): DFlash2 adds grouped dynamic
convolutions and a candidate selector; DSpark a Markov head and a confidence head, and drafts from the anchor;
Domino a prefix GRU; JetSpec keeps DFlash's weights and runs the block causally. The marker is read, in order:

    1. our trainer's `drafter_kind` (config.json, or run.json's config copy)
    2. speculators' `speculators_model_type` / `speculators_config.algorithm` (speculators 0.9.0 registers
       `dflash`, `dflash2`, `dspark`: models/*/config.py)
    3. a z-lab / SGLang / SpecForge nested `dflash_config`: `projector_type` (SpecForge's `--to hf` export),
       `architectures` (vLLM #52816 dispatches on `DFlash2DraftModel`); only without any of these, the variant's
       own fields set to a non-zero value
    4. the checkpoint's tensor names: the modules only that variant owns

A later source that names another variant is kept as a conflict note (the weights show what was trained).
No marker at all reads as plain DFlash. Import-light: plain dicts and names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

DFLASH, DFLASH2, DSPARK, DOMINO, JETSPEC = "dflash", "dflash2", "dspark", "domino", "jetspec"
VARIANTS = (DFLASH, DFLASH2, DSPARK, DOMINO, JETSPEC)
# speculators_model_type values of the family (speculators 0.9.0 registers the first three).
SPECULATORS_TYPES = (DFLASH, DFLASH2, DSPARK, DOMINO)

# Modules only one variant owns, as tensor-name patterns (any prefix): speculators 0.9.0
# models/dflash2/model_definitions.py:130-131,193-196,261-263; models/dspark/model_definitions.py:35-42,89;
# SpecForge modeling/draft/domino.py:36-62.
VARIANT_MODULES: dict[str, tuple[str, ...]] = {
    DFLASH2: (r"(^|\.)candidate_selector\.", r"(^|\.)(attention|mlp)_conv\."),
    DSPARK: (r"(^|\.)markov_head\.", r"(^|\.)confidence_head\."),
    DOMINO: (r"(^|\.)prefix_gru\.", r"(^|\.)embed_proj\."),
}

# Config fields that exist for one variant only (flat speculators fields or nested dflash_config fields).
VARIANT_FIELDS: dict[str, tuple[str, ...]] = {
    DFLASH2: ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
    DSPARK: ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"),
    DOMINO: ("emb_dim", "gru_hidden_dim", "pure_draft_prefix_len"),
}


@dataclass
class Variant:
    kind: str  # one of VARIANTS
    source: str  # where it was read: "config.json drafter_kind", "checkpoint tensors", "no variant marker"
    marked: bool = True  # False: nothing named a variant (plain DFlash assumed)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"{self.kind} ({self.source})" + (f"; {'; '.join(self.notes)}" if self.notes else "")


def owned_by(name: str) -> str | None:
    """The variant whose own module a tensor belongs to, or None for a tensor every variant has."""
    for kind, patterns in VARIANT_MODULES.items():
        if any(re.search(p, name) for p in patterns):
            return kind
    return None


def _kind_of_word(value: Any) -> str | None:
    """A marker word as a variant: exact (`dspark`), or inside a class name (`DFlash2DraftModel`)."""
    if not isinstance(value, str):
        return None
    word = value.strip().lower()
    if word in VARIANTS:
        return word
    for kind in (DFLASH2, DSPARK, DOMINO, JETSPEC):  # dflash last: it is inside "dflash2"
        if kind in word:
            return kind
    return DFLASH if DFLASH in word else None


def _nonzero(value: Any) -> bool:
    # [Z] reads absent conv / selector fields as 0 (module off); booleans count as set when true
    return (isinstance(value, (int, float)) and value != 0) or value is True or (isinstance(value, str) and bool(value))


def _config_markers(config: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """(variant, source) pairs a config names, strongest first."""
    found: list[tuple[str, str]] = []
    kind = _kind_of_word(config.get("drafter_kind"))
    if kind:
        found.append((kind, f"{where} drafter_kind"))
    for key in ("speculators_model_type",):
        kind = _kind_of_word(config.get(key))
        if kind and config.get(key) in SPECULATORS_TYPES + (JETSPEC,):
            found.append((kind, f"{where} {key}"))
    algorithm = (config.get("speculators_config") or {}).get("algorithm") if isinstance(config.get("speculators_config"), dict) else None
    if isinstance(algorithm, str) and algorithm in VARIANTS:
        found.append((algorithm, f"{where} speculators_config.algorithm"))
    nested = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    for key in ("projector_type", "method", "algorithm"):
        kind = _kind_of_word(nested.get(key))
        if kind and nested.get(key) in VARIANTS:
            found.append((kind, f"{where} dflash_config.{key}"))
    for arch in config.get("architectures") or []:
        kind = _kind_of_word(arch)
        if kind and kind != DFLASH:
            found.append((kind, f"{where} architectures {arch}"))
    if found:
        # A named variant decides: a trainer that writes its whole resolved config carries every variant's
        # fields at their defaults (conv_kernel_size 2 in a plain DFlash run), which name nothing.
        return found
    for kind, keys in VARIANT_FIELDS.items():
        for holder, label in ((nested, "dflash_config."), (config, "")):
            set_keys = [k for k in keys if _nonzero(holder.get(k))]
            if set_keys:
                found.append((kind, f"{where} {label}{set_keys[0]}"))
                break
    return found


def detect_variant(config: dict[str, Any] | None, *, run_json: dict[str, Any] | None = None,
                   tensor_names: Iterable[str] | None = None, where: str = "config.json") -> Variant:
    """The variant a run / export / checkpoint holds, with where it was read and any disagreement."""
    markers: list[tuple[str, str]] = []
    if isinstance(config, dict):
        markers += _config_markers(config, where)
    recorded = (run_json or {}).get("config") if isinstance(run_json, dict) else None
    if isinstance(recorded, dict):
        markers += _config_markers(recorded, "run.json config")
    if isinstance(run_json, dict) and _kind_of_word(run_json.get("drafter_kind")):
        markers.append((_kind_of_word(run_json.get("drafter_kind")), "run.json drafter_kind"))  # type: ignore[arg-type]
    owned = sorted({k for k in (owned_by(n) for n in tensor_names or []) if k})
    markers += [(kind, "checkpoint tensors") for kind in owned]
    if not markers:
        return Variant(DFLASH, "no variant marker: plain DFlash", marked=False)
    kind, source = markers[0]
    others = sorted({f"{k} ({s})" for k, s in markers[1:] if k != kind})
    notes = [f"conflict: also named {', '.join(others)}"] if others else []
    return Variant(kind, source, notes=notes)
