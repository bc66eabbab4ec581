"""The verifier (target model) a drafter names, found without the network, for its depth and hidden size.

speculators records it as `speculators_config.verifier.name_or_path`: a local directory (often relative
to where training ran) or a Hugging Face hub id. A directory is looked for relative to the drafter, each
directory above it, and the working directory; a hub id only in the local Hugging Face cache (offline,
`huggingface_hub.try_to_load_from_cache`), never downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.artifacts import exists, optional_json_object, shown


@dataclass
class Verifier:
    name_or_path: str | None
    config_path: Path | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    tried: list[str] = field(default_factory=list)
    problem: str | None = None  # why the config found could not be read

    @property
    def reason(self) -> str:
        """Why the depth is unknown (empty when it is known)."""
        if self.num_layers is not None:
            return ""
        if self.name_or_path is None:
            return "the config names no verifier (speculators_config.verifier.name_or_path)"
        if self.config_path is not None:
            return self.problem or f"{shown(self.config_path)} has no num_hidden_layers"
        return f"verifier {self.name_or_path!r} not found offline (tried {', '.join(self.tried)})"


def relocated_candidates(recorded: str, near: Path, *, max_up: int = 4, max_tail: int = 3) -> list[Path]:
    """An absolute path a trainer recorded, then its last 1..`max_tail` components under `near`, each
    directory above it, and the cwd: a run copied off the machine that trained it keeps its target beside it."""
    given = Path(recorded).expanduser()
    candidates = [given]
    if not given.is_absolute():
        return candidates
    bases, base = [], near.resolve()
    for _ in range(max_up + 1):
        bases.append(base)
        if base.parent == base:
            break
        base = base.parent
    bases.append(Path.cwd())
    parts = given.parts[1:]
    for length in range(1, min(max_tail, len(parts)) + 1):
        tail = Path(*parts[-length:])
        candidates += [b / tail for b in bases]
    return candidates


def find_verifier(name_or_path: Any, near: Path, *, max_up: int = 4, relocatable: bool = False) -> Verifier:
    """Look up `name_or_path` next to `near` (a drafter directory) and above it, in the cwd, in the HF cache.

    `relocatable`: an absolute path that is missing is also looked for by its trailing components near the
    run (SpecForge records absolute paths of the machine that trained).
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        return Verifier(None)
    verifier = Verifier(name_or_path)
    given = Path(name_or_path).expanduser()
    candidates: list[Path] = []
    if given.is_absolute():
        candidates += relocated_candidates(name_or_path, near, max_up=max_up) if relocatable else [given]
    else:
        base = near.resolve()
        for _ in range(max_up + 1):
            candidates.append(base / given)
            if base.parent == base:
                break
            base = base.parent
        candidates.append(Path.cwd() / given)
    for candidate in candidates:
        config = candidate / "config.json"
        if exists(config):
            return _read(verifier, config)
    verifier.tried.append(f"{len(candidates)} local paths")
    cached = _hub_cache_config(name_or_path)
    if cached is not None:
        return _read(verifier, cached)
    verifier.tried.append("the local Hugging Face cache")
    return verifier


def _hub_cache_config(repo_id: str) -> Path | None:
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an invalid repo id: not in the cache either
        return None
    return Path(found) if isinstance(found, str) else None


def _read(verifier: Verifier, config_path: Path) -> Verifier:
    verifier.config_path = config_path
    why: list[str] = []
    # A model directory beside a shared run is as foreign as the run: bounded, regular files only.
    config = optional_json_object(config_path, why, label=shown(config_path))
    if config is None:
        verifier.problem = why[0] if why else f"{shown(config_path)} cannot be read"
        return verifier
    # Multimodal verifiers (Qwen3-VL, ...) keep the language model's shape in text_config.
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for attr, key in (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"), ("vocab_size", "vocab_size")):
        value = text.get(key, config.get(key))
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(verifier, attr, value)
    return verifier
