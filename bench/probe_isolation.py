"""What isolating a probe costs: the sandbox's own set-up, per isolation level, against a bare child.

Measured pieces (median of --repeats, wall seconds, from this process):
  * copy + hash: a fresh box with the code, the worker and the tree hash (examples/probe_protocol.py, and
    the speculators package when it is importable here or given with --speculators DIR);
  * interpreter facts: the probe interpreter's sys.path and torch location (one `python -c`);
  * spawn: `python -c pass` through sandbox.run_confined minus the same command started bare;
  * whole probe: run_plan on examples/probe_protocol.py (all experiments), per level.

    PYTHONPATH=. .venv/bin/python bench/probe_isolation.py [--repeats 5] [--speculators DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sleuth.probes import sandbox
from sleuth.probes.runner import CodeCopy, ProbeOutcome, copy_code, plan_for_entry, run_plan
from sleuth.probes.trust import tree_sha256

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "probe_protocol.py"


def median_of(repeats: int, measure) -> float:  # noqa: ANN001 - a zero-argument callable returning seconds
    return statistics.median(measure() for _ in range(repeats))


def copy_and_hash(copy: CodeCopy) -> float:
    started = time.perf_counter()
    box = sandbox.Box.create()
    files = copy_code(copy, box.code, [])
    tree_sha256(files)
    copy_code(CodeCopy(REPO / "sleuth", only="probes"), box.lib / "sleuth", [], worker=True)
    elapsed = time.perf_counter() - started
    box.remove()
    return elapsed


def facts() -> float:
    box = sandbox.Box.create()
    env = sandbox.child_environment(box, sys.executable, 1)
    started = time.perf_counter()
    sandbox.interpreter_facts(sys.executable, env, box.work)
    elapsed = time.perf_counter() - started
    box.remove()
    return elapsed


def spawn(level: str) -> float:
    os.environ[sandbox.ISOLATION_ENV] = level
    box = sandbox.Box.create()
    env = sandbox.child_environment(box, sys.executable, 1)
    paths = sandbox.read_paths_for(sandbox.interpreter_facts(sys.executable, env, box.work), sys.executable)
    try:
        started = time.perf_counter()
        sandbox.run_confined([sys.executable, "-c", "pass"], box=box, env=env, read_paths=paths, timeout_s=60,
                             limits=sandbox.Limits())
        confined = time.perf_counter() - started
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env, cwd=box.work, check=True)
        bare = time.perf_counter() - started
    finally:
        box.remove()
    return confined - bare


def whole_probe(level: str) -> tuple[float, ProbeOutcome]:
    os.environ[sandbox.ISOLATION_ENV] = level
    outcome = run_plan(plan_for_entry("probe_protocol:subject", EXAMPLE, None, {"block_size": 6}), timeout_s=600)
    assert outcome.error is None, outcome.error
    return outcome.wall_s, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--speculators", type=Path, help="a speculators package directory to time the copy of")
    args = parser.parse_args()
    levels = [level for level in ("namespaces", "process") if sandbox._unavailable(level) is None]
    speculators = args.speculators
    if speculators is None:
        try:
            import speculators as package

            speculators = Path(package.__file__).resolve().parent
        except ImportError:
            pass
    print(f"load average before: {os.getloadavg()[0]:.1f}; levels here: {', '.join(levels)}")
    print(f"copy + hash, examples/probe_protocol.py: {median_of(args.repeats, lambda: copy_and_hash(CodeCopy(EXAMPLE.parent, only=EXAMPLE.name))):.3f} s")
    if speculators is not None:
        copy = CodeCopy(speculators.parent, only=speculators.name)
        print(f"copy + hash, {speculators}: {median_of(args.repeats, lambda: copy_and_hash(copy)):.3f} s")
    print(f"interpreter facts: {median_of(args.repeats, facts):.3f} s")
    for level in levels:
        print(f"spawn overhead at {level}: {median_of(args.repeats, lambda: spawn(level)):.3f} s")
    for level in levels:
        walls = [whole_probe(level) for _ in range(max(1, args.repeats // 2))]
        wall = statistics.median(w for w, _ in walls)
        seconds = walls[-1][1].seconds
        print(f"whole probe at {level}: {wall:.2f} s (experiments {seconds.get('total', 0) - seconds.get('setup', 0):.2f} s, "
              f"worker set-up {seconds.get('setup', 0):.2f} s)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
