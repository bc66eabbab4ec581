"""The probe subprocess: `python -m sleuth.probes.worker SPEC.json OUT.json`.

Runs in the interpreter the user chose (`--probe-python`), inside the sandbox sleuth built for it
(sandbox.py: no network, a read-only view, a scratch box, limits), on copies of the code and the run
files. Two halves:
  * process-level set-up (`prepare_process`): the worker's own heavy dependency (torch) is imported first,
    before any root of the subject is on sys.path, so nothing the subject ships can replace it; a root
    that holds a package the stack imports by name (a `torch/` beside the code) is refused; sockets are
    refused in-process too (behind the sandbox's network namespace, the only guard at the `process`
    isolation level); then the subject's roots go first on sys.path, so the code under diagnosis is what
    gets imported, never an installed copy;
  * the subject and its experiments (`load_subject`, `run`): every experiment runs even if another
    fails; a failure becomes `unknown` verdicts carrying the error.
The answer is one JSON object in OUT.json; sleuth validates it (answer.py) and trusts nothing in it: the
subject runs in this process and can write anything there. The child gets a copy of sleuth's `probes/`
package only, so nothing here imports sleuth outside it.
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


# Top-level packages the worker or the subject's stack imports by name: a subject root holding one would
# replace the real one for the whole process (sleuth's copy of the code leaves them out; refused here too).
SHADOWING = frozenset({"torch", "transformers", "safetensors", "tokenizers", "huggingface_hub", "numpy", "sleuth"})


def refuse_network() -> None:
    """No experiment needs the network; any attempt fails loudly instead of reaching out."""

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise OSError("network access is disabled inside sleuth probes")

    socket.socket.connect = refuse  # type: ignore[method-assign]
    socket.socket.connect_ex = refuse  # type: ignore[method-assign]
    socket.create_connection = refuse  # type: ignore[assignment]
    socket.getaddrinfo = refuse  # type: ignore[assignment]


def _one_line(exc: BaseException, limit: int = 400) -> str:
    # All of the message on one line, not its first line: a pydantic ValidationError's first line is only
    # "1 validation error for Config", and what was wrong is on the next.
    lines = [" ".join(line.split()) for line in str(exc).strip().splitlines()]
    text = " ".join(line for line in lines if line and not line.startswith("For further information visit"))
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
    if kind == "generic":
        from sleuth.probes.adapters.generic import GenericSubject

        return GenericSubject(spec)
    raise ValueError(f"unknown probe subject kind {kind!r}")


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from sleuth.probes.experiments import Lab, probe_variants, randomize_drafter, run_experiments
    from sleuth.probes.protocol import NotProvided, PartialSubject, check_description
    from sleuth.probes.target import make_target
    from sleuth.probes.verdict import DECIDES, Expectations

    torch.set_num_threads(int(spec.get("threads") or 1))
    seed = int(spec.get("seed") or 0)
    answer: dict[str, Any] = {"subject": None, "verdicts": [], "error": None, "python": sys.executable,
                              "torch": torch.__version__, "seconds": {}}
    started = time.perf_counter()
    expectations = Expectations.from_json(spec.get("expectations"))
    try:
        loaded = load_subject(spec)
        if spec.get("mode") == "check":  # `sleuth probe check`: the entry's conformance, no experiment
            from sleuth.probes.conformance import check_subject

            answer["checks"] = check_subject(loaded, seed)
            return answer
        if spec.get("subject") == "generic":  # located pieces called one by one (sleuth/probes/adapters/generic.py)
            return loaded.run(answer, expectations, seed, started)
        # Every protocol method is optional: one the entry lacks makes the experiments needing it unknown.
        subject = PartialSubject(loaded)
        absent = {method: NotProvided(method) for method in subject.missing()}  # method -> why
        info = check_description(subject.describe())
        answer["subject"] = info
        target = make_target(int(info["num_target_layers"]), seed)
        torch.manual_seed(seed)
        lab = None
        for step in ("build", "parameters", "draft_logits"):
            if step == "draft_logits":
                # after build: the Lab reads describe() again (building decides some of what it reports)
                lab = Lab(subject, info, target, expectations, seed)
            if step in absent or (step != "build" and "build" in absent):
                continue
            try:
                if step == "build":
                    subject.build(target)
                elif step == "parameters":
                    randomize_drafter(subject, target, seed + 7)
                elif not torch.equal(lab.logits(), lab.baseline):
                    raise RuntimeError("the drafter's logits differ between two identical calls: its forward is not "
                                       "deterministic")
            except NotProvided as exc:
                absent[exc.method] = exc
        answer["subject"] = dict(lab.info)
    except Exception as exc:
        answer["error"] = f"cannot set up the subject: {exc.reason if isinstance(exc, NotProvided) else _one_line(exc)}"
        answer["traceback"] = traceback.format_exc(limit=8)
        answer["seconds"]["setup"] = round(time.perf_counter() - started, 3)
        return answer
    answer["seconds"]["setup"] = round(time.perf_counter() - started, 3)
    answer["not_provided"] = {method: exc.reason for method, exc in sorted(absent.items())}
    verdicts, seconds = run_experiments(lab, DECIDES, absent)
    answer["seconds"].update(seconds)
    # The other paths of the same code (its variants), when no run config fixes which one runs.
    verdicts = probe_variants(subject, verdicts, lab.expectations, seed, DECIDES)
    answer["verdicts"] = [verdict.to_json() for verdict in verdicts]
    answer["seconds"]["total"] = round(time.perf_counter() - started, 3)
    return answer


def prepare_process(spec: dict[str, Any]) -> str | None:
    """The process-level set-up before the subject exists; why the probe cannot go on, or None."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        import torch  # noqa: F401 - imported before the subject's roots are on sys.path
    except Exception as exc:
        return (f"the probe interpreter {sys.executable} cannot import torch ({_one_line(exc)}): give "
                "--probe-python an environment where `import torch` works")
    refuse_network()
    roots = [str(root) for root in spec.get("sys_path") or []]
    for root in roots:
        for name in sorted(SHADOWING):
            if (Path(root) / name).exists() or (Path(root) / f"{name}.py").exists():
                return f"refusing to import from {root}: its {name} would shadow the probe's own {name}"
    for root in reversed(roots):
        sys.path.insert(0, root)
    return None


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    problem = prepare_process(spec)
    if problem is not None:
        answer: dict[str, Any] = {"subject": None, "verdicts": [], "error": problem, "python": sys.executable,
                                  "seconds": {}}
    else:
        answer = run(spec)
    out_path.write_text(json.dumps(answer, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
