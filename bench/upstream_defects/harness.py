"""Run sleuth (as a black box, through its CLI) on each planted defect and classify what it said.

Per defect, on a fresh copy of the source's package directory with that one defect planted:
  sleuth diagnose --code COPY --offline --format json --out OUT
and then, from OUT/report.json, the finding of the invariant the defect breaks:
  detected            that invariant is `mismatch`
  silent_false_match  that invariant is `match`: an all-clear on broken code, the failure that matters most
  detected_elsewhere  that invariant is `unknown`, but another invariant turned `mismatch` (one that is not
                      already `mismatch` on the unmodified source)
  unknown             that invariant is `unknown` (or absent) and nothing else turned `mismatch`
  same_as_unmodified  that invariant is `mismatch` with the same observed value on the unmodified source: a
                      false alarm, not a detection (sleuth does not tell the defect apart)
  error               sleuth exited 2, timed out or wrote no readable report
The unmodified source is diagnosed the same way: every `mismatch` there is a false alarm.

A rewrite (`expect.status: clean`, behaviour-preserving) is `kept` when its invariant is not `mismatch`
(beyond what the unmodified source has), and `false_alarm` when it is.

By default no `--config` and no probes: the code is the only evidence. With `probe` (the CLI's `--probe`)
every copy is also probed (`--probe --probe-python PYTHON`), and a source's run config may be given
(`configs`: speculators' run.yaml, SpecForge's recipe), passed as `--config` to every diagnosis of it.
Every sleuth process gets an empty cache and config directory, so the reference is the same on every
machine (the playbook's pinned facts, offline) and no user setting leaks into the numbers.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .catalog import (
    REPO,
    SOURCE_NAMES,
    Catalog,
    CatalogError,
    Defect,
    check_defects_apply,
    copy_with_defect,
    describe_version,
    resolve_source,
)

CLASSES = ("detected", "silent_false_match", "unknown", "detected_elsewhere", "same_as_unmodified", "kept",
           "false_alarm", "error")
SLEUTH_ENV_OVERRIDE = "UPSTREAM_BENCH_SLEUTH"
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class SleuthCommand:
    argv: list[str]
    env: dict[str, str]  # added to the child's environment

    @property
    def display(self) -> str:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


def sleuth_command(given: str | None = None) -> SleuthCommand:
    """`--sleuth CMD`, else $UPSTREAM_BENCH_SLEUTH, else the repo's main venv running this checkout's sleuth."""
    text = given or os.environ.get(SLEUTH_ENV_OVERRIDE)
    if text:
        return SleuthCommand(shlex.split(text), {})
    python = REPO / ".venv" / "bin" / "python"
    if not python.is_file():
        raise CatalogError(f"no main environment at {REPO / '.venv'} (make setup), and no --sleuth CMD "
                           f"or {SLEUTH_ENV_OVERRIDE} given")
    return SleuthCommand([str(python), "-m", "sleuth.cli"], {"PYTHONPATH": str(REPO)})


@dataclass
class Diagnosis:
    exit_code: int | None
    seconds: float
    findings: dict[str, dict[str, Any]] = field(default_factory=dict)  # invariant id -> status, observed, ...
    error: str | None = None

    def ids_with(self, status: str) -> set[str]:
        return {i for i, f in self.findings.items() if f["status"] == status}


def _child_env(command: SleuthCommand, scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("SLEUTH_") or k in {"GITHUB_TOKEN", "XDG_CONFIG_HOME"})}
    env.update({
        "SLEUTH_CACHE_DIR": str(scratch / "sleuth-cache"),
        "XDG_CONFIG_HOME": str(scratch / "config"),  # no user config.yaml naming reference checkouts
        "OMP_NUM_THREADS": "1",
        "NO_COLOR": "1",
    })
    env.update(command.env)
    return env


@dataclass(frozen=True)
class ProbeOptions:
    """`--probe` for every diagnosis, in this interpreter; a run config per source (a path)."""

    python: str | None = None
    configs: dict[str, str] = field(default_factory=dict)


def diagnose(command: SleuthCommand, code: Path, scratch: Path, timeout_s: float,
             probes: ProbeOptions | None = None, config: str | None = None) -> Diagnosis:
    out = scratch / "diagnosis"
    argv = [*command.argv, "diagnose", "--code", str(code), "--offline", "--format", "json", "--out", str(out)]
    if probes is not None:
        argv += ["--probe"] + (["--probe-python", probes.python] if probes.python else [])
    if config:
        argv += ["--config", config]
    started = time.monotonic()
    try:
        proc = subprocess.run(argv, env=_child_env(command, scratch), cwd=scratch, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Diagnosis(None, time.monotonic() - started, error=f"timed out after {timeout_s:.0f} s")
    except OSError as exc:
        return Diagnosis(None, time.monotonic() - started, error=f"could not start sleuth: {exc}")
    seconds = time.monotonic() - started
    report_path = out / "report.json"
    if proc.returncode not in (0, 1) or not report_path.is_file():
        last = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return Diagnosis(proc.returncode, seconds, error=f"exit {proc.returncode}: {last[:300]}")
    try:
        report = json.loads(report_path.read_text())
        findings = {f["id"]: _summarise_finding(f) for f in report["findings"]}
    except (ValueError, KeyError, TypeError) as exc:
        return Diagnosis(proc.returncode, seconds, error=f"unreadable report.json: {exc!r}")
    return Diagnosis(proc.returncode, seconds, findings)


def _summarise_finding(finding: dict[str, Any]) -> dict[str, Any]:
    evidence = [e for e in finding.get("evidence") or [] if isinstance(e, dict)]
    code = [e for e in evidence if e.get("kind") == "code"]
    probe = [e for e in evidence if e.get("kind") == "probe"]
    return {
        "status": finding["status"],
        "observed": finding.get("observed"),
        "expected": finding.get("expected"),
        "where": code[0].get("location") if code else None,
        "reason": str(finding.get("reason") or "")[:300],
        "probe": str(probe[0].get("value") or "")[:300] if probe else None,
    }


@dataclass
class DefectResult:
    id: str
    source: str
    invariant: str
    what: str
    classification: str
    status: str | None  # sleuth's verdict on the invariant the defect breaks
    observed: Any
    expected_observed: str | None
    observed_as_expected: bool | None
    where: str | None
    reason: str | None
    new_mismatches: list[str]  # other invariants that turned mismatch (not mismatch on the unmodified source)
    probe: str | None  # the probe's verdict on the invariant, when probed
    exit_code: int | None
    seconds: float
    error: str | None


def classify(defect: Defect, diagnosis: Diagnosis, unmodified: Diagnosis) -> DefectResult:
    finding = diagnosis.findings.get(defect.invariant)
    before = unmodified.findings.get(defect.invariant)
    status = finding["status"] if finding else None
    new_mismatches = sorted(diagnosis.ids_with("mismatch") - unmodified.ids_with("mismatch") - {defect.invariant})
    rewrite = defect.expect.status in ("clean", "match")
    if diagnosis.error is not None:
        classification = "error"
    elif rewrite:
        newly = diagnosis.ids_with("mismatch") - unmodified.ids_with("mismatch")
        classification = "false_alarm" if newly else "kept"
    elif status == "mismatch" and before is not None and before["status"] == "mismatch" \
            and before["observed"] == finding["observed"]:  # type: ignore[index]
        classification = "same_as_unmodified"
    elif status == "mismatch":
        classification = "detected"
    elif status == "match":
        classification = "silent_false_match"
    elif new_mismatches:
        classification = "detected_elsewhere"
    else:
        classification = "unknown"
    observed = finding["observed"] if finding else None
    expected = defect.expect.observed
    return DefectResult(
        id=defect.id, source=defect.source, invariant=defect.invariant, what=defect.what,
        classification=classification, status=status, observed=observed, expected_observed=expected,
        observed_as_expected=None if expected is None or status is None else str(observed) == expected,
        where=finding["where"] if finding else None, reason=finding["reason"] if finding else None,
        new_mismatches=new_mismatches, probe=finding.get("probe") if finding else None,
        exit_code=diagnosis.exit_code, seconds=round(diagnosis.seconds, 2),
        error=diagnosis.error,
    )


def _diagnose_copy(root: Path, package: str, defect: Defect | None, command: SleuthCommand,
                   timeout_s: float, probes: ProbeOptions | None = None, config: str | None = None) -> Diagnosis:
    with tempfile.TemporaryDirectory(prefix="upstream-defect-") as tmp:
        scratch = Path(tmp)
        code = copy_with_defect(root, scratch / "code" / package, defect)
        return diagnose(command, code, scratch, timeout_s, probes, config)


def totals(results: list[DefectResult], false_alarms: dict[str, list[str]]) -> dict[str, Any]:
    counts = Counter(r.classification for r in results)
    n = sum(r.classification not in ("kept", "false_alarm") for r in results)  # planted defects, not rewrites
    return {
        "defects": n,
        "rewrites": len(results) - n,
        **{c: counts.get(c, 0) for c in CLASSES},
        "recall": round(counts.get("detected", 0) / n, 4) if n else None,
        # a user's measure beside the catalog's: the diagnosis turned some invariant mismatch that the unmodified
        # source does not have (the labelled one or another), so the report does not read as clean
        "flagged_anywhere": sum(1 for r in results if r.classification not in ("kept", "false_alarm", "error")
                                and (r.classification == "detected" or r.new_mismatches)),
        "false_alarms": sum(len(v) for v in false_alarms.values()) + counts.get("false_alarm", 0),
    }


def run_benchmark(
    catalog: Catalog,
    sources: list[str],
    source_paths: dict[str, str | None],
    command: SleuthCommand,
    *,
    jobs: int = 2,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    only: set[str] | None = None,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    probes: ProbeOptions | None = None,
) -> dict[str, Any]:
    """Diagnose every source unmodified and with each of its defects; the results as one JSON-able dict."""
    started = time.monotonic()
    cpu_before = _children_cpu_s()
    roots: dict[str, Path] = {}
    available: dict[str, dict[str, str]] = {}
    skipped: dict[str, str] = {}
    for name in sources:
        if name not in SOURCE_NAMES:
            raise CatalogError(f"unknown source {name!r} (known: {', '.join(SOURCE_NAMES)})")
        root, how = resolve_source(name, catalog.sources[name], source_paths.get(name))
        if root is None:
            skipped[name] = how
            progress(f"skipping {name}: {how}")
            continue
        roots[name] = root
        available[name] = {"path": str(root), "found_by": how, "version": describe_version(name, root),
                           "written_against": catalog.sources[name].written_against}

    if not roots:
        raise CatalogError("no source to run: " + "; ".join(f"{name}: {why}" for name, why in skipped.items()))
    defects = [d for d in catalog.for_sources(list(roots)) if only is None or d.id in only]
    if only is not None and (missing := only - {d.id for d in defects}):
        raise CatalogError(f"no such defect among the available sources: {', '.join(sorted(missing))}")
    for name, root in roots.items():  # every defect must plant before anything is measured
        check_defects_apply(root, [d for d in defects if d.source == name])

    tasks: list[tuple[str, Defect | None]] = [(name, None) for name in roots] + [(d.source, d) for d in defects]
    finished = itertools.count(1)

    def work(task: tuple[str, Defect | None]) -> Diagnosis:
        name, defect = task
        config = probes.configs.get(name) if probes is not None else None
        diagnosis = _diagnose_copy(roots[name], catalog.sources[name].package, defect, command, timeout_s, probes, config)
        done = next(finished)  # atomic under the GIL, unlike `+= 1`
        label = defect.id if defect else f"{name} (unmodified)"
        state = diagnosis.error or ", ".join(f"{s} {len(diagnosis.ids_with(s))}"
                                             for s in ("mismatch", "match", "unknown"))
        progress(f"[{done}/{len(tasks)}] {label}: {state} ({diagnosis.seconds:.1f} s)")
        return diagnosis

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        diagnoses = list(pool.map(work, tasks))
    unmodified = dict(zip(roots, diagnoses[: len(roots)]))
    false_alarms = {name: sorted(d.ids_with("mismatch")) for name, d in unmodified.items()}
    results = [classify(defect, diag, unmodified[defect.source])
               for defect, diag in zip(defects, diagnoses[len(roots):])]

    by_invariant: dict[str, dict[str, int]] = {}
    for r in results:
        row = by_invariant.setdefault(r.invariant, {"defects": 0, **{c: 0 for c in CLASSES}})
        row["defects"] += 1
        row[r.classification] += 1
    return {
        "benchmark": "upstream_defects",
        "sleuth": command.display,
        "probes": None if probes is None else {"python": probes.python, "configs": probes.configs},
        "jobs": jobs,
        "sources": available,
        "skipped_sources": skipped,
        "unmodified": {name: {"false_alarms": false_alarms[name], "error": d.error, "exit_code": d.exit_code,
                              "seconds": round(d.seconds, 2),
                              "findings": {i: {"status": f["status"], "observed": f["observed"]}
                                           for i, f in sorted(d.findings.items())}}
                       for name, d in unmodified.items()},
        "defects": [asdict(r) for r in results],
        "by_invariant": dict(sorted(by_invariant.items())),
        "by_source": {name: totals([r for r in results if r.source == name], {name: false_alarms[name]})
                      for name in roots},
        "totals": {**totals(results, false_alarms),
                   "unmodified_errors": sum(d.error is not None for d in unmodified.values())},
        "wall_s": round(time.monotonic() - started, 1),
        # CPU of every sleuth process together: unlike wall time, it does not depend on what else the machine runs
        "sleuth_cpu_s": round(_children_cpu_s() - cpu_before, 1),
    }


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
