"""`python -m bench.upstream_defects`: how sleuth does on defects planted in real upstream DFlash code.

    PYTHONPATH=. python -m bench.upstream_defects [--catalog defects.yaml] [--sources speculators,specforge,zlab]
        [--sleuth "CMD"] [--out results.json] [--jobs 2] [--only ID,...]
        [--speculators PATH] [--specforge PATH] [--zlab PATH]
        [--probe [--probe-python PYTHON] [--speculators-config RUN.yaml] [--specforge-config RECIPE.yaml]]

--catalog: the defect catalog, a path or a file name next to defects.yaml (default defects.yaml, the 65
defects sleuth is developed against; defects_heldout.yaml is the held-out set that measures whether that
work generalises).

Sources: speculators from --speculators, $UPSTREAM_SPECULATORS_PATH, this interpreter's installed package or
the repo's .venv-speculators; SpecForge and z-lab/dflash only from a checkout given by flag or
$UPSTREAM_SPECFORGE_PATH / $UPSTREAM_ZLAB_PATH (a missing one is skipped with the reason). sleuth: --sleuth
"CMD" (e.g. "env PYTHONPATH=/path/to/checkout /path/to/.venv/bin/python -m sleuth.cli"), else
$UPSTREAM_BENCH_SLEUTH, else the repo's .venv running this checkout's sleuth.
--probe: every copy is also probed (`sleuth diagnose --probe`, in --probe-python: an interpreter with torch
and the sources' imports, the parity venv); --SOURCE-config gives that source's run config (--config) to every
diagnosis of it. Rewrites (`expect.status: clean`) are `kept` or a `false_alarm`.
Prints one row per defect and the totals on stdout (progress on stderr). Exit 0 when every sleuth run gave a
report, 1 when some did not (the results are incomplete: see the errors), 2 when the benchmark could not run
(no source, a defect that no longer plants, no sleuth environment, a bad flag).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .catalog import SOURCE_NAMES, CatalogError, load_catalog, resolve_catalog_path
from .harness import DEFAULT_TIMEOUT_S, ProbeOptions, run_benchmark, sleuth_command

CATALOG_DIR = Path(__file__).resolve().parent

SHORT = {"detected": "detected", "silent_false_match": "SILENT MATCH", "unknown": "unknown",
         "detected_elsewhere": "elsewhere", "same_as_unmodified": "as unmodified", "kept": "kept (rewrite)",
         "false_alarm": "FALSE ALARM", "error": "ERROR"}


def _table(result: dict[str, Any]) -> str:
    rows = [("defect", "invariant", "sleuth says", "class", "observed")]
    for r in result["defects"]:
        extra = f" (+{','.join(i.removeprefix('dflash.') for i in r['new_mismatches'])})" if r["new_mismatches"] else ""
        rows.append((r["id"], r["invariant"].removeprefix("dflash."), str(r["status"] or r["error"] or "-")[:40],
                     SHORT[r["classification"]] + extra, str(r["observed"])[:40]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    return "\n".join(lines)


def _summary(result: dict[str, Any]) -> str:
    t = result["totals"]
    lines = []
    for name, info in result["sources"].items():
        u = result["unmodified"][name]
        s = result["by_source"][name]
        alarms = ", ".join(u["false_alarms"]) or "none"
        lines.append(f"{name} ({info['version']}): {s['defects']} defects, detected {s['detected']}, silent false "
                     f"match {s['silent_false_match']}, unknown {s['unknown']}, elsewhere {s['detected_elsewhere']}, "
                     f"as unmodified {s['same_as_unmodified']}, error {s['error']}; {s['rewrites']} rewrites, false "
                     f"alarms {s['false_alarm']}; unmodified: false alarms {alarms}"
                     + (f", ERROR {u['error']}" if u["error"] else ""))
    for name, why in result["skipped_sources"].items():
        lines.append(f"{name}: skipped ({why})")
    recall = "n/a" if t["recall"] is None else f"{t['recall']:.0%}"
    lines.append(f"total: {t['defects']} defects, recall {recall} ({t['detected']} detected), silent false matches "
                 f"{t['silent_false_match']}, unknown {t['unknown']}, detected elsewhere {t['detected_elsewhere']}, "
                 f"same as unmodified {t['same_as_unmodified']}, errors {t['error']}, false alarms {t['false_alarms']}; "
                 f"flagged anywhere (some new mismatch) {t['flagged_anywhere']} of {t['defects']}; wall {result['wall_s']} s "
                 f"with {result['jobs']} workers, sleuth CPU {result['sleuth_cpu_s']} s")
    if result.get("probes"):
        lines.append(f"probes: --probe-python {result['probes']['python'] or '(sleuth own)'}; configs "
                     f"{result['probes']['configs'] or 'none'}")
    lines.append(f"catalog: {result['catalog']}")
    lines.append(f"sleuth: {result['sleuth']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream_defects", description=__doc__.split("\n\n")[0])
    parser.add_argument("--catalog", default="defects.yaml",
                        help="defect catalog: a path, or a file name next to defects.yaml (default %(default)s)")
    parser.add_argument("--sources", default=",".join(SOURCE_NAMES), help="comma-separated subset of %(default)s")
    parser.add_argument("--sleuth", help='the sleuth command, e.g. "env PYTHONPATH=DIR .venv/bin/python -m sleuth.cli"')
    parser.add_argument("--out", type=Path, help="write the full results as JSON here")
    parser.add_argument("--jobs", type=int, default=2, help="sleuth processes at once (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per sleuth run")
    parser.add_argument("--only", help="comma-separated defect ids")
    for name in SOURCE_NAMES:
        parser.add_argument(f"--{name}", metavar="PATH", help=f"{name} checkout or package directory")
    parser.add_argument("--probe", action="store_true", help="probe every copy (sleuth diagnose --probe)")
    parser.add_argument("--probe-python", help="the interpreter the probes run in (with torch and the sources' imports)")
    for name in SOURCE_NAMES:
        parser.add_argument(f"--{name}-config", metavar="PATH", help=f"{name}'s run config, given as --config")
    args = parser.parse_args(argv)
    try:
        if args.jobs < 1:
            raise CatalogError("--jobs must be at least 1")
        configs = {n: str(Path(p).resolve()) for n in SOURCE_NAMES if (p := getattr(args, f"{n}_config"))}
        if (args.probe_python or configs) and not args.probe:
            raise CatalogError("--probe-python and --SOURCE-config need --probe")
        for path in configs.values():
            if not Path(path).is_file():
                raise CatalogError(f"no config file {path}")
        probes = ProbeOptions(python=args.probe_python, configs=configs) if args.probe else None
        catalog_path = resolve_catalog_path(args.catalog)
        catalog = load_catalog(catalog_path)
        sources = [s.strip() for s in args.sources.split(",") if s.strip()]
        result = run_benchmark(
            catalog, sources, {name: getattr(args, name) for name in SOURCE_NAMES}, sleuth_command(args.sleuth),
            jobs=args.jobs, timeout_s=args.timeout,
            only={i.strip() for i in args.only.split(",") if i.strip()} if args.only else None,
            probes=probes,
        )
    except (CatalogError, OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        one_line = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"error: {one_line[:600]}", file=sys.stderr)
        return 2
    result["catalog"] = catalog_path.name if catalog_path.parent == CATALOG_DIR else str(catalog_path)
    print(_table(result))
    print()
    print(_summary(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    incomplete = result["totals"]["error"] + result["totals"]["unmodified_errors"]
    return 1 if incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
