"""sleuth's side of a probe: which subject, in which interpreter, and the isolated child process that runs it.

The experiments never run in sleuth's own process. For each probe sleuth
  1. copies what the child needs into a fresh scratch box (sandbox.Box): the code under diagnosis (a run's
     `code/trainer` Python files, a speculators / SpecForge package, the directory of a `--probe-entry`),
     the run's config.json and run.json, and sleuth's own worker; links, special files and anything that
     would shadow the worker's own packages (a `torch/` beside the code) are left out;
  2. hashes that copy (trust.tree_sha256) and, when the user did not ask for probes, runs it only if the
     user's own trainer recorded that tree (trust.py): copy first, hash the copy, run the copy;
  3. runs `sleuth.probes.worker` on the copy under sandbox.run_confined (no network, a read-only view,
     limits, no survivors) and reads back its answer through answer.read_answer (bounded, validated).
Whatever the subject does (crash, hang, flood its output, forge or mangle its answer) turns into `unknown`
verdicts with one reason; nothing of it reaches sleuth unchecked.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.probes.answer import AnswerError, read_answer, safe_text
from sleuth.probes.sandbox import (
    Box,
    Isolation,
    Limits,
    SandboxError,
    child_environment,
    interpreter_facts,
    planned_level,
    read_paths_for,
    run_confined,
)
from sleuth.probes.trust import check_trust, tree_sha256
from sleuth.probes.verdict import DECIDES, PROBED_INVARIANTS, Expectations, Verdict
from sleuth.probes.worker import SHADOWING  # the worker's module is torch-free at import

DEFAULT_TIMEOUT_S = 120.0
TRAINER_ENTRY = "trainer.probe:probe_subject"
# The sleuth package: the child gets a copy of its __init__ and probes/ (all the worker imports).
SLEUTH_PACKAGE = Path(__file__).resolve().parents[1]
# Copy bounds: a code tree is source, not data.
MAX_COPY_FILES = 20_000
MAX_COPY_BYTES = 256 * 2**20
MAX_FILE_BYTES = 64 * 2**20
RUN_FILES = ("config.json", "run.json")
MAX_RUN_FILE_BYTES = 16 * 2**20
_SKIPPED_DIRS = frozenset({"node_modules", "site-packages"})
_BYTECODE = (".pyc", ".pyo")


class ProbeError(Exception):
    """A probe option the user got wrong (a missing interpreter, a malformed entry); one line."""


@dataclass
class CodeCopy:
    """The code tree the child gets a copy of, under its box `code/`, which goes first on its sys.path."""

    source: Path  # a directory (its contents are copied) or one file
    only: str | None = None  # copy only this entry of `source` (a run's "trainer", a package's own name)
    python_only: bool = False  # *.py files only (a run's code/ holds nothing else that the trainer wrote)


@dataclass
class ProbePlan:
    """What to probe. `spec` is the worker's input with the user's paths (the box copies replace them when
    it runs); None with `reason` when there is nothing to run."""

    subject: str  # a short name for the report: "run v5", "speculators at PATH", "entry mod:fn"
    spec: dict[str, Any] | None = None
    reason: str | None = None
    copy: CodeCopy | None = None
    run_dir: Path | None = None  # the run whose config.json and run.json the child gets copies of
    # The user asked (--probe / --probe-entry). False: sleuth's default for a run, which runs the code only
    # when the user's own trainer recorded it (trust.py).
    asked: bool = True
    trust_applies: bool = False  # a run's code/: the trust record says whether the user's trainer wrote it


@dataclass
class ProbeOutcome:
    subject: str
    verdicts: list[Verdict] = field(default_factory=list)
    info: dict[str, Any] | None = None  # the subject's describe()
    python: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None  # why no experiment ran (then every verdict is unknown with this reason)
    declined: str | None = None  # why sleuth chose not to run the code (no consent); not an error
    asked: bool = True  # the user asked for probes
    trusted: bool = False  # the code is a tree the user's own trainer recorded
    trust: str | None = None  # what the trust record said
    code_sha256: str | None = None  # tree hash of the copy that ran (or would have)
    code_files: int = 0
    isolation: Isolation | None = None
    notes: list[str] = field(default_factory=list)  # what the copy left out, the isolation's fallback, ...
    # Beyond verdicts (validated like them, answer.ProbeAnswer): `sleuth probe check`'s one line per method,
    # and the protocol methods an entry does not provide (method -> why).
    checks: dict[str, str] | None = None
    not_provided: dict[str, str] = field(default_factory=dict)

    @property
    def ran(self) -> bool:
        """Experiments ran (their verdicts may still be unknown each for its own reason)."""
        return self.error is None and self.declined is None

    @property
    def expected(self) -> bool:
        """Probes were due: the user asked, or the code is the user's own trainer's."""
        return self.asked or self.trusted


def plan_for_run(run_dir: Path, code_dir: Path | None, name: str) -> ProbePlan:
    """A run is probed through the entry point its own `code/` copy exposes, imported from a copy of it."""
    subject = f"run {name}"
    if code_dir is None or not code_dir.is_dir():
        return ProbePlan(subject, reason="the run has no code/ copy, so there is no code to run")
    if not (code_dir / "trainer" / "probe.py").is_file():
        return ProbePlan(subject, reason="the run's code/ has no trainer/probe.py: it was recorded before the trainer "
                         "exposed a probe entry point, so its code cannot be run by sleuth")
    spec = {
        "subject": "entry",
        "entry": TRAINER_ENTRY,
        "sys_path": [str(code_dir)],
        "require_under": {"trainer": str(code_dir / "trainer")},
        "context": {"run_dir": str(run_dir)},
    }
    return ProbePlan(subject, spec=spec, copy=CodeCopy(code_dir, only="trainer", python_only=True), run_dir=run_dir,
                     asked=False, trust_applies=True)


def plan_for_code(code: Path, config: dict[str, Any] | None, config_path: Path | None = None) -> ProbePlan:
    """speculators or SpecForge source (a package directory or a checkout), by its layout. The run's config
    (and its path: a SpecForge recipe names its draft config relative to itself) reach the adapter."""
    code = code.resolve()
    for kind, package, marker in (
        ("speculators", "speculators", Path("models") / "dflash" / "core.py"),
        ("specforge", "specforge", Path("modeling") / "draft" / "dflash.py"),
    ):
        for candidate in (code, code / package, code / "src" / package):
            if (candidate / "__init__.py").is_file() and (candidate / marker).is_file() and candidate.name == package:
                spec = {"subject": kind, "package_dir": str(candidate), "sys_path": [str(candidate.parent)],
                        "context": {"config": config, **_recipe_files(kind, config, config_path, code)}}
                return ProbePlan(f"{kind} at {candidate}", spec=spec, copy=CodeCopy(candidate.parent, only=package))
    # Any other trainer: its pieces are located statically and called one by one (sleuth/probes/locate.py).
    from sleuth.probes.locate import locate

    located = locate(code, config)
    if not located.pieces:
        return ProbePlan(f"code at {code}", reason=f"{code} is neither speculators nor SpecForge source, and sleuth "
                         "located no DFlash piece in it to call; give --probe-entry module:function "
                         "(`sleuth probe init --code PATH` writes one)")
    return plan_for_located(code, located, config)


def _recipe_files(kind: str, config: dict[str, Any] | None, config_path: Path | None,
                  code: Path | None = None) -> dict[str, Any]:
    """What the run's config names beside itself, read here and handed over by value (the child sees only its
    box): a SpecForge recipe's `model.draft_model_config`.

    SpecForge resolves that path against the directory `specforge train` runs in, which is its checkout's root
    for the recipes it ships (`examples/configs/x.yaml` names `configs/x.json`); sleuth runs elsewhere. So the
    name is looked for next to the recipe, then (never in the home directory or above it) in the recipe's
    ancestors, the checkout that holds `--code`, and the current directory; the first file found is read, and
    the report says which (`draft_config_from`).
    What is read goes to code sleuth is asked to run, whose sandbox keeps the user's files from it, so the name
    must be a `.json` file outside hidden directories and without `..`: a recipe from elsewhere naming
    `.docker/config.json` or `../../.aws/x.json` must not hand that file to the child."""
    model = (config or {}).get("model") if kind == "specforge" else None
    name = model.get("draft_model_config") if isinstance(model, dict) else None
    if not isinstance(name, str) or not name:
        return {}
    from sleuth.artifacts import optional_json_object

    given = Path(name)
    if given.suffix != ".json" or any(part == ".." or (part.startswith(".") and part != ".") for part in given.parts):
        return {"draft_config_problem": f"the recipe's model.draft_model_config {name!r} is not read: sleuth reads a "
                                        "draft config only as a .json file outside hidden directories, without '..'"}
    if given.is_absolute():
        candidates = [given]
    else:
        home = Path.home().resolve()
        above_home = {home, *home.parents}  # a checkout lives below them, the user's own files in them
        here = config_path.resolve().parent if config_path is not None else None
        bases = ([here] if here else []) + [base for base in (
            *(list(here.parents)[:3] if here else []),
            *([code.resolve().parent, *list(code.resolve().parent.parents)[:1]] if code is not None else []),
            Path.cwd().resolve()) if base not in above_home]
        candidates = list(dict.fromkeys(base / name for base in bases))
    for candidate in candidates:
        problems: list[str] = []
        data = optional_json_object(candidate, problems)
        if data is not None:
            return {"draft_config": data, "draft_config_from": str(candidate)}
        if problems:
            return {"draft_config_problem": f"the recipe's model.draft_model_config {problems[0]}"}
    looked = ", ".join(str(c.parent) for c in candidates[:4]) + (", ..." if len(candidates) > 4 else "")
    return {"draft_config_problem": f"the recipe's model.draft_model_config {name} was not found next to the "
                                    f"recipe ({config_path or 'its location was not given'}) nor above it, in "
                                    f"the checkout of --code or here (looked in {looked}); pass the recipe with "
                                    "that path made absolute"}


def plan_for_located(code: Path, located: Any, config: dict[str, Any] | None) -> ProbePlan:
    """The located pieces of `code` (a locate.Located), called in the child on a copy of the tree they are in.
    The copy holds every import root the pieces need: a package's root is the folder above its top
    `__init__.py`, which can be above `code` itself (then only the branch that leads to `code` is copied)."""
    code = Path(code).resolve()
    base = code if code.is_dir() else code.parent
    plan = located.to_json()
    spec = {"subject": "generic", "plan": plan, "sys_path": list(located.sys_path), "context": {"config": config}}
    above = [Path(root) for root in located.sys_path if Path(root) == base or Path(root) in base.parents]
    top = min(above, key=lambda root: len(root.parts)) if above else base
    if top != base:
        copy = CodeCopy(top, only=base.relative_to(top).parts[0], python_only=True)
    elif code.is_file():
        copy = CodeCopy(base, only=code.name, python_only=True)
    else:
        copy = CodeCopy(base, python_only=True)
    return ProbePlan(f"located pieces of {code}", spec=spec, copy=copy)


def check_entry(entry: str) -> None:
    module, _, function = entry.partition(":")
    if not module or not function or not all(part.isidentifier() for part in module.split(".")) \
            or not function.isidentifier():
        raise ProbeError(f"--probe-entry must be module:function (e.g. my_trainer.probe:subject), got {entry!r}")


def check_options(python: str | None, entry: str | None) -> None:
    """Fail fast on probe options a user got wrong, before any slow step."""
    check_python(python)
    if entry is not None:
        check_entry(entry)


def plan_for_entry(entry: str, code: Path | None, run_dir: Path | None, config: dict[str, Any] | None) -> ProbePlan:
    check_entry(entry)
    roots, copy = [], None
    if code is not None:
        code = code.resolve()
        roots.append(str(code if code.is_dir() else code.parent))
        # A file alone: only that file (its directory may be a home folder); a directory: its contents.
        copy = CodeCopy(code.parent, only=code.name) if code.is_file() else CodeCopy(code)
    spec = {"subject": "entry", "entry": entry, "sys_path": roots,
            "context": {"run_dir": str(run_dir.resolve()) if run_dir else None,
                        "code": str(code) if code else None, "config": config}}
    return ProbePlan(f"entry {entry}", spec=spec, copy=copy, run_dir=run_dir.resolve() if run_dir else None)


def check_python(python: str | None) -> str:
    """The interpreter to probe in: --probe-python (relative to the user's cwd, not the child's), else this one.
    Not resolved through links: a virtual environment's bin/python is a link, and it is what selects the venv."""
    if python is None:
        return sys.executable
    path = Path(os.path.abspath(Path(python).expanduser()))
    if not path.exists():
        raise ProbeError(f"--probe-python {python} does not exist")
    if not os.access(path, os.X_OK) or path.is_dir():
        raise ProbeError(f"--probe-python {python} is not an executable interpreter")
    return str(path)


def run_plan(plan: ProbePlan, *, python: str | None = None, expectations: Expectations | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = None,
             announce: Callable[[str], None] | None = None) -> ProbeOutcome:
    """Run the plan's experiments in an isolated child process; never raises for what the subject does.
    `announce` hears, before anything runs, what will run and how it is isolated (or why it will not)."""
    outcome = ProbeOutcome(subject=plan.subject, asked=plan.asked)
    started = time.perf_counter()
    announce = _printable(announce)
    if plan.spec is None:
        return _failed(outcome, plan.reason or "nothing to probe")
    interpreter = check_python(python)
    outcome.python = interpreter
    threads = threads or 1  # tiny tensors: a second thread only adds contention (docs/benchmarks.md, probe time)
    box = Box.create()
    try:
        try:
            spec, files = _fill_box(plan, box, outcome)
        except CopyError as exc:
            return _failed(outcome, str(exc))
        if plan.trust_applies and plan.run_dir is not None:
            trust = check_trust(files, plan.run_dir)
            outcome.trusted, outcome.trust = trust.trusted, trust.reason
        if not plan.asked and not outcome.trusted:
            outcome.declined = (f"not run: {outcome.trust}; the code of a run from elsewhere runs only with --probe "
                                "(isolated), since probe results are only as honest as the code that produces them")
            if announce:
                announce(f"probes: {plan.subject}: {outcome.declined}")
            outcome.verdicts = unknown_verdicts(outcome.declined)
            return outcome
        steering = steering_problem(box.run) if plan.run_dir is not None else None
        if steering is not None:  # checked on the copies the child would read
            return _failed(outcome, f"not run: {steering}")
        env = child_environment(box, interpreter, threads)
        try:
            facts = interpreter_facts(interpreter, env, box.work)
        except SandboxError as exc:
            return _failed(outcome, str(exc))
        if facts.torch is None:
            return _failed(outcome, f"the probe interpreter {interpreter} has no torch (Python {facts.version}): "
                           "give --probe-python an environment where `import torch` works")
        spec.update(expectations=(expectations or Expectations()).to_json(), threads=threads, seed=0)
        spec_path, answer_path = box.box / "spec.json", box.answer
        spec_path.write_text(json.dumps(spec))
        limits = Limits.for_timeout(timeout_s, threads)
        if announce:
            announce(_announcement(plan, outcome, interpreter, timeout_s))
        try:
            finished = run_confined([interpreter, "-m", "sleuth.probes.worker", str(spec_path), str(answer_path)],
                                    box=box, env=env, read_paths=read_paths_for(facts, interpreter),
                                    timeout_s=timeout_s, limits=limits)
        except SandboxError as exc:
            return _failed(outcome, str(exc))
        outcome.isolation = finished.isolation
        if finished.isolation.fallback:
            outcome.notes.append(f"isolation fell back to {finished.isolation.level}: {finished.isolation.fallback}")
        if finished.swept:
            outcome.notes.append(f"{finished.swept} process(es) the probe left running were killed")
        if finished.timed_out:
            return _failed(outcome, f"the probe process ran past its {timeout_s:g} s limit and was stopped")
        try:
            # The answer file is there from the start (the child may write only it): empty is no answer.
            written = os.lstat(answer_path).st_size > 0 if os.path.lexists(answer_path) else False
            answer = read_answer(answer_path, limits.answer_bytes) if written else None
        except AnswerError as exc:
            return _failed(outcome, str(exc))
        if answer is None:
            last = safe_text((finished.stderr_tail.strip().splitlines() or [""])[-1].strip())[:300]
            ending = finished.ending(limits)
            return _failed(outcome, f"the probe process ended without an answer ({last or ending})")
        if not answer.verdicts and not answer.error and answer.checks is None:
            return _failed(outcome, "the probe's answer holds no verdict and no error: no experiment ran")
        outcome.info, outcome.seconds, outcome.error = answer.subject_info(), answer.seconds, answer.error
        outcome.verdicts, outcome.checks, outcome.not_provided = answer.verdicts, answer.checks, answer.not_provided
    finally:
        left = box.remove()
        if left is not None:
            outcome.notes.append(left)
        outcome.wall_s = round(time.perf_counter() - started, 3)
    if outcome.error and not outcome.verdicts:
        outcome.verdicts = unknown_verdicts(outcome.error)
    return outcome


def _printable(announce: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """announce, fed only safe text: what it says names the run and its paths, and a run can hold escapes there."""
    if announce is None:
        return None
    hear = announce

    def say(line: str) -> None:
        hear(safe_text(line))

    return say


def _failed(outcome: ProbeOutcome, reason: str) -> ProbeOutcome:
    outcome.error = reason
    outcome.verdicts = unknown_verdicts(reason)
    return outcome


def _announcement(plan: ProbePlan, outcome: ProbeOutcome, interpreter: str, timeout_s: float) -> str:
    source = plan.copy.source / plan.copy.only if plan.copy and plan.copy.only else (plan.copy.source if plan.copy else None)
    what = (f"{outcome.code_files} file(s) copied from {source} (sha256:{(outcome.code_sha256 or '')[:16]})"
            if source else "no code copied")
    why = "your own trainer recorded this code" if outcome.trusted and not plan.asked else "at your request"
    entry = (plan.spec or {}).get("entry") or (plan.spec or {}).get("subject")
    return (f"probes: running {plan.subject} ({why}): {what}, entry {entry}, in {interpreter}; isolation "
            f"{planned_level()}; at most {timeout_s:g} s")


# --- the box ----------------------------------------------------------------------------------------------


class CopyError(Exception):
    """The code cannot be copied for probing (too large, not a directory); one line."""


def _fill_box(plan: ProbePlan, box: Box, outcome: ProbeOutcome) -> tuple[dict[str, Any], dict[str, str]]:
    """Copy the code, the run files and sleuth's worker into the box; the worker's spec, on the copies, and
    the copied code's files ({path: sha256})."""
    spec = json.loads(json.dumps(plan.spec))
    files: dict[str, str] = {}
    if plan.copy is not None:
        files = copy_code(plan.copy, box.code, outcome.notes)
        outcome.code_files, outcome.code_sha256 = len(files), tree_sha256(files)
        host_root = str(plan.copy.source)

        def moved(path: str) -> str:
            return _moved(path, host_root, box.code)

        # Every path the child is given names the copy: it never reads the user's tree (a root outside the
        # copy is dropped, not handed over).
        roots = [moved(root) for root in spec.get("sys_path") or []]
        spec["sys_path"] = [root for root in roots if _inside(root, box.code)]
        if "package_dir" in spec:
            spec["package_dir"] = moved(spec["package_dir"])
        spec["require_under"] = {name: moved(path) for name, path in (spec.get("require_under") or {}).items()}
        context = spec.get("context") or {}
        if context.get("code"):
            context["code"] = moved(context["code"])
        located = spec.get("plan")
        if isinstance(located, dict):  # the generic subject: the located pieces' modules, by file
            located["root"] = moved(located.get("root") or host_root)
            located["sys_path"] = [root for root in map(moved, located.get("sys_path") or []) if _inside(root, box.code)]
            for info in (located.get("modules") or {}).values():
                info["file"] = moved(info.get("file") or "")
            # `file:line:qualname` of the code that sets requires_grad: the child matches them against the
            # frames it runs, which are the copy's (was: host paths, so no freeze ever counted as run)
            located["grad_sites"] = [moved(site.split(":", 1)[0]) + ":" + site.split(":", 1)[1]
                                     for site in located.get("grad_sites") or [] if ":" in site]
    if plan.run_dir is not None:
        for name in RUN_FILES:
            _copy_run_file(plan.run_dir / name, box.run / name, outcome.notes)
        (spec.get("context") or {})["run_dir"] = str(box.run)
    # sleuth's worker: the package's __init__ and probes/, all the worker imports.
    (box.lib / "sleuth").mkdir()
    (box.lib / "sleuth" / "__init__.py").write_bytes((SLEUTH_PACKAGE / "__init__.py").read_bytes())
    copy_code(CodeCopy(SLEUTH_PACKAGE, only="probes"), box.lib / "sleuth", [], worker=True)
    return spec, files


# What a run's own files may ask of a probe: the probe builds a stand-in target as deep as run.json says and a
# drafter as the config says, so a run.json of 4000 layers would spend the whole time limit, not measure.
MAX_PROBE_TARGET_LAYERS = 512
MAX_PROBE_DRAFT_LAYERS = 64
MAX_PROBE_BLOCK_SIZE = 1024


def steering_problem(run_copy: Path) -> str | None:
    """Why the run's copied config.json / run.json ask more of a probe than sleuth runs; None when within bounds."""
    def load(name: str) -> Any:
        try:
            return json.loads((run_copy / name).read_bytes())
        except (OSError, ValueError, RecursionError):
            return None  # missing or damaged: the subject says so itself, and the static reading names it

    info, config = load("run.json"), load("config.json")
    target = info.get("target") if isinstance(info, dict) else None
    layers = target.get("num_layers") if isinstance(target, dict) else None
    bounds = [("run.json", "target.num_layers", layers, MAX_PROBE_TARGET_LAYERS)]
    if isinstance(config, dict):
        bounds += [("config.json", "draft_layers", config.get("draft_layers"), MAX_PROBE_DRAFT_LAYERS),
                   ("config.json", "block_size", config.get("block_size"), MAX_PROBE_BLOCK_SIZE)]
        ids = config.get("target_layer_ids")
        if isinstance(ids, list):
            bounds.append(("config.json", "target_layer_ids (count)", len(ids), MAX_PROBE_DRAFT_LAYERS))
            numbers = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
            if numbers:
                bounds.append(("config.json", "target_layer_ids (largest)", max(numbers), MAX_PROBE_TARGET_LAYERS))
    for file, key, value, bound in bounds:
        if isinstance(value, int) and not isinstance(value, bool) and value > bound:
            shown = str(value) if len(str(value)) <= 20 else f"{str(value)[:20]}..."
            return f"the run's {file} {key} is {shown}, past the {bound} sleuth probes with"
    return None


def _inside(path: str, root: Path) -> bool:
    return path == str(root) or path.startswith(str(root).rstrip("/") + "/")


def _moved(path: str, host_root: str, box_root: Path) -> str:
    if path == host_root:
        return str(box_root)
    if path.startswith(host_root.rstrip("/") + "/"):
        return str(box_root / os.path.relpath(path, host_root))
    return path


def copy_code(copy: CodeCopy, destination: Path, notes: list[str], *, worker: bool = False) -> dict[str, str]:
    """Copy the tree; {path relative to destination: sha256 of the bytes written}. Regular files only (links,
    FIFOs, devices skipped), never through a link, bounded in files and bytes; entries that would shadow the
    worker's own packages, hidden entries and byte code (`__pycache__`, *.pyc: the child writes none either)
    are left out (noted)."""
    files: dict[str, str] = {}
    total = [0]
    skipped: dict[str, int] = {}
    root = copy.source

    def skip(why: str) -> None:
        skipped[why] = skipped.get(why, 0) + 1

    def walk(source: Path, relative: Path) -> None:
        try:
            entries = sorted(os.scandir(source), key=lambda e: e.name)
        except OSError as exc:
            raise CopyError(f"cannot read {source} to copy it for probing: {exc.strerror or exc}") from None
        for entry in entries:
            name = entry.name
            if not relative.parts and copy.only is not None and name != copy.only:
                continue
            if not relative.parts and not worker and _shadows(name):
                notes.append(f"not copied: {source / name} (it would shadow the probe's own {name.split('.')[0]})")
                continue
            if name.startswith(".") or name in _SKIPPED_DIRS:
                skip("hidden entries and package folders")
                continue
            if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in name):
                skip("names with control characters")  # no module is named so; a path listing could be forged
                continue
            if name == "__pycache__" or name.endswith(_BYTECODE):
                # Byte code is what would run instead of the source sleuth read and the user reviewed (a
                # .pyc stamped with the .py's mtime and size is imported in its place): source only.
                skip("byte-code files and caches")
                continue
            if entry.is_symlink():
                skip("links")
                continue
            if entry.is_dir(follow_symlinks=False):
                walk(Path(entry.path), relative / name)
            elif entry.is_file(follow_symlinks=False):
                if copy.python_only and not name.endswith(".py"):
                    skip("files that are not Python source")
                    continue
                _copy_file(Path(entry.path), destination / relative / name, relative / name)
            else:
                skip("special files")

    def _copy_file(source: Path, target: Path, relative: Path) -> None:
        if len(files) >= MAX_COPY_FILES:
            raise CopyError(f"{root} has more than {MAX_COPY_FILES} files to copy for probing: point at the package")
        data, _info = _read_regular(source, MAX_FILE_BYTES)
        if data is None:
            skip("files too large or not regular")
            return
        total[0] += len(data)
        if total[0] > MAX_COPY_BYTES:
            raise CopyError(f"{root} holds more than {MAX_COPY_BYTES // 2**20} MiB to copy for probing: point at the "
                            "package")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        files[relative.as_posix()] = hashlib.sha256(data).hexdigest()

    if not root.is_dir() or root.is_symlink():
        raise CopyError(f"{root} is not a directory sleuth can copy for probing")
    if copy.only is not None and os.path.islink(root / copy.only):
        raise CopyError(f"{root / copy.only} is a link: sleuth copies code, not what a link points at")
    walk(root, Path())
    if skipped and not worker:
        notes.append("left out of the copy: " + ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())))
    return files


def _shadows(name: str) -> bool:
    stem = name[:-3] if name.endswith(".py") else name
    return stem in SHADOWING


def _read_regular(path: Path, limit: int) -> tuple[bytes | None, os.stat_result]:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None, info
        chunks, size = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                return None, info
        return b"".join(chunks), info
    finally:
        os.close(fd)


def _copy_run_file(source: Path, target: Path, notes: list[str]) -> None:
    try:
        data, _info = _read_regular(source, MAX_RUN_FILE_BYTES)
    except OSError:
        data = None
    if data is None:
        notes.append(f"not copied: {source} (missing, a link, a special file or over {MAX_RUN_FILE_BYTES // 2**20} MiB)")
        return
    target.write_bytes(data)


def unknown_verdicts(reason: str) -> list[Verdict]:
    return [Verdict(invariant=invariant, status="unknown", experiment=experiment, hypothesis="", perturbed="",
                    measurement="", threshold="", reason=reason)
            for experiment, invariants in DECIDES.items() for invariant in invariants]


__all__ = ["PROBED_INVARIANTS", "CodeCopy", "CopyError", "ProbeError", "ProbeOutcome", "ProbePlan", "check_entry",
           "check_options", "check_python", "copy_code", "plan_for_code", "plan_for_entry", "plan_for_run", "run_plan",
           "unknown_verdicts"]
