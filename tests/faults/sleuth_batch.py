"""Many `sleuth diagnose` cases in one child process: what tests/faults/test_sleuth_artifacts.py runs.

A case that hangs (a FIFO read, a walk over the whole file system) must fail its test at a deadline, not
hang the suite, so the cases run in this child, which the test kills at its deadline; and they run one
after another in it, so Python, torch and matplotlib are imported once for all of them.

    python sleuth_batch.py CASES.json

CASES.json: {"cases": [{"name", "args", "report": PATH | null, "plant_pid_links": [DIR, VICTIM] | null}]}.
Each case is the real CLI app (typer's CliRunner, in this process); one JSON line per case on stdout, as soon
as it ends: {"name", "code", "stderr", "exception", "seconds", "report": the report.json it wrote | null}.
`plant_pid_links`: before the case, a link to VICTIM under every temporary name a writer that names its
staging files by this process's pid would use (`DIR/.<file>.<pid>.partial`): the attacker who guesses a pid.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

STAGED = ("report.md", "report.json", "report.sarif", "fix.yaml", "chart.png", "trace.jsonl")


def main(cases_file: str) -> None:
    from typer.testing import CliRunner

    from sleuth.cli import app

    cases = json.loads(Path(cases_file).read_text())["cases"]
    for case in cases:
        if case.get("plant_pid_links"):
            folder, victim = (Path(p) for p in case["plant_pid_links"])
            folder.mkdir(parents=True, exist_ok=True)
            for name in STAGED:
                (folder / f".{name}.{os.getpid()}.partial").symlink_to(victim)
        print(json.dumps({"name": case["name"], "started": True}), flush=True)
        start = time.perf_counter()
        result = CliRunner().invoke(app, case["args"])
        exception = result.exception
        shown = None
        if exception is not None and not isinstance(exception, SystemExit):
            shown = "".join(traceback.format_exception(exception))[-2000:]
        report = None
        if case.get("report"):
            try:
                report = json.loads(Path(case["report"]).read_text())
            except (OSError, ValueError):
                report = None
        print(json.dumps({
            "name": case["name"], "code": result.exit_code, "stderr": result.stderr, "exception": shown,
            "seconds": round(time.perf_counter() - start, 2), "report": report,
        }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
