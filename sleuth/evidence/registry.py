"""One registry for every evidence reader, by the id the playbook names.

    @detector("dflash.x")             a code detector: (Analyzer) -> list[CodeReading]
    @config_reader("number")          a config reader: (config, keys, RunMeta) -> ConfigReading | None
    @checkpoint_reader("fc_layer_count")
                                      a checkpoint reader: (CheckpointInput) -> CheckpointReading

Readers register themselves where they are defined; the playbook loader checks every id a playbook names
against this registry (an unknown id is a one-line playbook error, not a silent `unknown`). The detectors
are imported on first use (`code_detectors()`), so reading a config never parses the analysis kit.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Registered:
    id: str
    kind: str  # code | config | checkpoint
    func: Callable[..., Any]
    module: str


_REGISTRY: dict[str, dict[str, Registered]] = {"code": {}, "config": {}, "checkpoint": {}}
# Where each kind's readers are defined (imported lazily, once).
_MODULES = {
    "code": "sleuth.evidence.detectors",
    "config": "sleuth.evidence.config",
    "checkpoint": "sleuth.evidence.checkpoint",
}


class RegistryError(Exception):
    pass


def _register(kind: str, reader_id: str) -> Callable[[F], F]:
    def decorate(func: F) -> F:
        known = _REGISTRY[kind].get(reader_id)
        if known is not None and known.func.__qualname__ != func.__qualname__:
            raise RegistryError(f"{kind} reader {reader_id!r} is registered twice ({known.module} and {func.__module__})")
        _REGISTRY[kind][reader_id] = Registered(reader_id, kind, func, func.__module__)
        return func

    return decorate


def detector(reader_id: str) -> Callable[[F], F]:
    """Register a code detector: `@detector("dflash.context_excludes_anchor")`."""
    return _register("code", reader_id)


def config_reader(reader_id: str) -> Callable[[F], F]:
    return _register("config", reader_id)


def checkpoint_reader(reader_id: str) -> Callable[[F], F]:
    return _register("checkpoint", reader_id)


def registered(kind: str) -> dict[str, Registered]:
    """Every reader of one kind (code | config | checkpoint), importing where they are defined."""
    importlib.import_module(_MODULES[kind])
    return dict(_REGISTRY[kind])


def code_detectors() -> dict[str, Registered]:
    return registered("code")
