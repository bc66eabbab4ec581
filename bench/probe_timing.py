"""Probe time per subject: `sleuth.probes.runner.run_plan` as `sleuth diagnose --probe` runs it, one child each.

    PYTHONPATH=. .venv-speculators/bin/python bench/probe_timing.py [--repeats 1]

Subjects: speculators 0.9.0 (defaults, and the test run.yaml), SpecForge 0.2.0 (defaults, and the gamma-7 test
recipe with its draft config), examples/probe_protocol.py. Prints, per subject, the child's wall time, its CPU
time (user + system: less sensitive to other load on the machine than wall time), the set-up (imports, the
synthetic target written, the drafter built) and the experiments, and the machine's load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sleuth.probes.runner import plan_for_code, plan_for_entry, run_plan  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures"


def _package(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def subjects() -> list[tuple[str, object]]:
    found = []
    speculators, specforge = _package("speculators"), _package("specforge")
    if speculators is not None:
        run_yaml = FIXTURES / "speculators" / "specout" / "run.yaml"
        found += [("speculators 0.9.0, defaults", plan_for_code(speculators, None)),
                  ("speculators 0.9.0, specout/run.yaml", plan_for_code(speculators, yaml.safe_load(run_yaml.read_text()),
                                                                         run_yaml))]
    if specforge is not None:
        recipe = FIXTURES / "specforge" / "recipe-sf-tiny-gamma7.yaml"
        found += [("SpecForge 0.2.0, defaults", plan_for_code(specforge, None)),
                  ("SpecForge 0.2.0, recipe-sf-tiny-gamma7.yaml", plan_for_code(specforge, yaml.safe_load(recipe.read_text()),
                                                                                recipe))]
    found.append(("examples/probe_protocol.py", plan_for_entry("probe_protocol:subject", REPO / "examples" / "probe_protocol.py",
                                                               None, None)))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"{'subject':46} {'wall s':>7} {'cpu s':>6} {'setup s':>8} {'experiments s':>14} {'load':>5}  verdicts")
    for name, plan in subjects():
        for _ in range(args.repeats):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            outcome = run_plan(plan, python=sys.executable, timeout_s=600)
            wall = time.perf_counter() - started
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            setup = outcome.seconds.get("setup", 0.0)
            experiments = outcome.seconds.get("total", 0.0) - setup
            counts = {s: sum(v.status == s for v in outcome.verdicts) for s in ("match", "mismatch", "unknown")}
            print(f"{name:46} {wall:7.1f} {cpu:6.1f} {setup:8.1f} {experiments:14.1f} {os.getloadavg()[0]:5.1f}  "
                  + (outcome.error or ", ".join(f"{k} {v}" for k, v in counts.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
