"""The probe subprocess: `python -m sleuth.probes.worker SPEC.json OUT.json`.

Runs in the interpreter the user chose (`--probe-python`), on CPU, with no network: sockets are refused
before the subject's code is imported. The subject's import root goes first on sys.path, so the code under
diagnosis is what gets imported, never an installed copy. Every experiment runs even if another fails;
a failure becomes `unknown` verdicts carrying the error. The answer is one JSON object in OUT.json.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def refuse_network() -> None:
    """No experiment needs the network; any attempt fails loudly instead of reaching out."""

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise OSError("network access is disabled inside sleuth probes")

    socket.socket.connect = refuse  # type: ignore[method-assign]
    socket.socket.connect_ex = refuse  # type: ignore[method-assign]
    socket.create_connection = refuse  # type: ignore[assignment]
    socket.getaddrinfo = refuse  # type: ignore[assignment]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _within(module: Any, root: str) -> bool:
    files = [getattr(module, "__file__", None), *list(getattr(module, "__path__", []) or [])]
    base = Path(root).resolve()
    return any(f and (Path(f).resolve() == base or base in Path(f).resolve().parents) for f in files)


def load_subject(spec: dict[str, Any]) -> Any:
    import importlib

    kind = spec["subject"]
    if kind == "entry":
        module_name, _, function_name = spec["entry"].partition(":")
        module = importlib.import_module(module_name)
        for name, root in (spec.get("require_under") or {}).items():
            imported = sys.modules.get(name) or importlib.import_module(name)
            if not _within(imported, root):
                raise ImportError(f"{name} was imported from {getattr(imported, '__file__', '?')}, not from {root}")
        factory = getattr(module, function_name, None)
        if not callable(factory):
            raise AttributeError(f"{spec['entry']}: {module_name} has no callable {function_name!r}")
        return factory(spec.get("context") or {})
    if kind == "speculators":
        from sleuth.probes.adapters.speculators import SpeculatorsSubject

        return SpeculatorsSubject(spec["package_dir"], spec.get("context") or {})
    if kind == "specforge":
        from sleuth.probes.adapters.specforge import SpecForgeSubject

        return SpecForgeSubject(spec["package_dir"], spec.get("context") or {})
    raise ValueError(f"unknown probe subject kind {kind!r}")


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from sleuth.probes.experiments import Lab, probe_variants, randomize_drafter, run_experiments
    from sleuth.probes.target import make_target
    from sleuth.probes.verdict import DECIDES, Expectations

    torch.set_num_threads(int(spec.get("threads") or 1))
    seed = int(spec.get("seed") or 0)
    answer: dict[str, Any] = {"subject": None, "verdicts": [], "error": None, "python": sys.executable,
                              "torch": torch.__version__, "seconds": {}}
    started = time.perf_counter()
    try:
        subject = load_subject(spec)
        info = dict(subject.describe())
        answer["subject"] = info
        target = make_target(int(info["num_target_layers"]), seed)
        torch.manual_seed(seed)
        subject.build(target)
        randomize_drafter(subject, target, seed + 7)
        lab = Lab(subject, info, target, Expectations.from_json(spec.get("expectations")), seed)
        again = lab.logits()
        if not torch.equal(again, lab.baseline):
            raise RuntimeError("the drafter's logits differ between two identical calls: its forward is not deterministic")
    except Exception as exc:
        answer["error"] = f"cannot set up the subject: {_one_line(exc)}"
        answer["traceback"] = traceback.format_exc(limit=8)
        answer["seconds"]["setup"] = round(time.perf_counter() - started, 3)
        return answer
    answer["seconds"]["setup"] = round(time.perf_counter() - started, 3)
    verdicts, seconds = run_experiments(lab, DECIDES)
    answer["seconds"].update(seconds)
    # The other paths of the same code (its variants), when no run config fixes which one runs.
    verdicts = probe_variants(subject, verdicts, lab.expectations, seed, DECIDES)
    answer["verdicts"] = [verdict.to_json() for verdict in verdicts]
    answer["seconds"]["total"] = round(time.perf_counter() - started, 3)
    return answer


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    refuse_network()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    for entry in reversed(spec.get("sys_path") or []):
        sys.path.insert(0, entry)
    answer = run(spec)
    out_path.write_text(json.dumps(answer, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
