"""Planted defects found, silent matches, unknowns and false alarms of `sleuth diagnose --code` on a corpus of
trainers, in two modes: static reading alone (the default for --code) and `--probe` with no adapter (the
trainer's pieces located and called, sleuth/probes/locate.py).

A corpus is a directory of cases, one directory each, holding the trainer's files and either `expected.yaml`
with `planted: [invariant ids]` (an empty list for a clean case), or one `MANIFEST.yaml` at the corpus root
(`trainers: {name: {planted: [{invariant: id, ...}], clean: true}}`, the blind corpus's form). Every run is the
real CLI in its own process:

    PYTHONPATH=. .venv/bin/python bench/anyprobe_corpus.py tests/fixtures/anyprobe [--mode static|probe|both]
                                                          [--json out.json] [--table]
    PYTHONPATH=. .venv/bin/python bench/anyprobe_corpus.py bench/anyprobe_blind/trainers --mode entry \
                                                          --entries bench/anyprobe_blind/completed --table

Counted per case and in total, over every invariant the report has (a planted defect the probes do not decide
is still found or missed by static reading):
    found        a planted defect reported `mismatch`
    silent       a planted defect reported `match` (for static reading: read as static agreement, which the
                 report does not claim but which would have hidden the defect)
    unknown      a planted defect reported `unknown`
    false alarm  a `mismatch` on an invariant nothing was planted in
    measured     (probe mode) invariants decided by a located piece's experiment
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

def planted_of(case: Path) -> list[str]:
    if (case / "expected.yaml").is_file():
        spec = yaml.safe_load((case / "expected.yaml").read_text()) or {}
        return list(spec.get("planted") or [])
    manifest = yaml.safe_load((case.parent / "MANIFEST.yaml").read_text()) or {}
    entry = (manifest.get("trainers") or {}).get(case.name) or {}
    return [p["invariant"] for p in entry.get("planted") or []]


def cases_of(corpus: Path) -> list[Path]:
    if (corpus / "MANIFEST.yaml").is_file():
        names = (yaml.safe_load((corpus / "MANIFEST.yaml").read_text()) or {}).get("trainers") or {}
        return sorted(corpus / name for name in names if (corpus / name).is_dir())
    return sorted(p for p in corpus.iterdir() if (p / "expected.yaml").is_file())


def diagnose(case: Path, probe: bool, out: Path, entry: Path | None = None) -> dict:
    """One `sleuth diagnose --code` in its own process. With `entry` (a directory holding a completed
    `probe_entry.py` and the trainer's resolved `config.json`): the case is copied with the entry beside its
    files and probed through it (`--probe-entry probe_entry:subject --config config.json`)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLEUTH_CACHE_DIR": str(out / "cache")}
    if entry is not None:
        copy = out / case.name
        shutil.copytree(case, copy)
        shutil.copy(entry / "probe_entry.py", copy / "probe_entry.py")
        case = copy
    args = [sys.executable, "-m", "sleuth.cli", "diagnose", "--code", str(case), "--offline", "--format", "json",
            "--out", str(out / "report")]
    if entry is not None:
        args += ["--probe", "--probe-entry", "probe_entry:subject", "--probe-python", sys.executable]
        if (entry / "config.json").is_file():
            args += ["--config", str(entry / "config.json")]
    elif probe:
        args.append("--probe")
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    # exit 2 with a report: probes were asked for and none ran (no piece located); the static findings stand
    if done.returncode in (0, 1, 2):
        try:
            return json.loads(done.stdout)
        except json.JSONDecodeError:
            pass
    return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}


def score(report: dict, planted: list[str], probe: bool) -> dict:
    if "error" in report:
        return {"error": report["error"], "planted": len(planted), "found": [], "silent": [], "unknown": list(planted),
                "false_alarms": {}, "measured": []}
    statuses, observed, measured = {}, {}, []
    for finding in report["findings"]:
        # static reading alone: agreement it does not claim still counts as vouching (it would hide a defect);
        # with probes, the report's status is the claim
        status = "match" if not probe and finding.get("static_agreement") and finding["status"] == "unknown" \
            else finding["status"]
        statuses[finding["id"]] = status
        observed[finding["id"]] = finding.get("observed") or ""
        probe_evidence = next((e for e in finding["evidence"] if e["kind"] == "probe"), None)
        if probe_evidence and probe_evidence["location"].startswith("probe:located-") and \
                not probe_evidence["value"].startswith("unknown"):
            measured.append(finding["id"])
    return {
        "planted": len(planted),
        "found": [i for i in planted if statuses.get(i) == "mismatch"],
        "silent": [i for i in planted if statuses.get(i) == "match"],
        "unknown": [i for i in planted if statuses.get(i) not in ("match", "mismatch")],
        "false_alarms": {i: observed[i] for i, s in statuses.items() if s == "mismatch" and i not in planted},
        "measured": sorted(measured),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--mode", choices=("static", "probe", "both", "entry"), default="both",
                        help="entry: probe each case through its completed probe-init entry (--entries)")
    parser.add_argument("--entries", type=Path, default=None,
                        help="for --mode entry: a directory with <case>/probe_entry.py and <case>/config.json")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--table", action="store_true", help="print a markdown table per case (for BENCHMARKS.md)")
    args = parser.parse_args(argv)
    cases = cases_of(args.corpus)
    if args.mode == "entry" and args.entries is None:
        parser.error("--mode entry needs --entries DIR")
    modes = ["static", "probe"] if args.mode == "both" else [args.mode]
    results: dict[str, dict[str, dict]] = {m: {} for m in modes}
    started = time.perf_counter()
    for case in cases:
        planted = planted_of(case)
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="sleuth-bench-") as tmp:
                t0 = time.perf_counter()
                entry = args.entries / case.name if mode == "entry" else None
                result = score(diagnose(case, mode == "probe", Path(tmp), entry), planted, mode != "static")
                result["seconds"] = round(time.perf_counter() - t0, 1)
            results[mode][case.name] = result
            print(f"{mode:6} {case.name:34} planted {result['planted']} found {len(result['found'])} silent "
                  f"{result['silent'] or '-'} unknown {result['unknown'] or '-'} false alarms "
                  f"{result['false_alarms'] or '-'}" + (f" measured {len(result['measured'])}" if mode != "static" else "")
                  + (f" ERROR {result['error']}" if "error" in result else "") + f" ({result['seconds']} s)", flush=True)
    print()
    for mode in modes:
        rows = results[mode].values()
        planted = sum(r["planted"] for r in rows)
        found = sum(len(r["found"]) for r in rows)
        print(f"{mode}: {len(cases)} cases, planted {planted}, found {found} ({found / planted:.0%})" if planted else
              f"{mode}: {len(cases)} cases, nothing planted", end="")
        print(f", silent {sum(len(r['silent']) for r in rows)}, unknown {sum(len(r['unknown']) for r in rows)}, "
              f"false alarms {sum(len(r['false_alarms']) for r in rows)}"
              + (f", invariants measured on located pieces {sum(len(r['measured']) for r in rows)}" if mode == "probe" else ""))
    if args.table:
        print("\n| case | planted | " + " | ".join(f"{m}: found / silent / unknown / false alarms" for m in modes) + " |")
        print("|---|---|" + "---|" * len(modes))
        for case in cases:
            cells = []
            for mode in modes:
                r = results[mode][case.name]
                cells.append(f"{len(r['found'])} / {len(r['silent'])} / {len(r['unknown'])} / {len(r['false_alarms'])}")
            print(f"| {case.name} | {', '.join(i.split('.', 1)[1] for i in planted_of(case)) or '-'} | " + " | ".join(cells) + " |")
    print(f"\n{time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
