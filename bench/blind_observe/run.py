"""Blind benchmark: `sleuth diagnose --code . --probe -- CMD` on trainers written from the docs alone.

For every case of cases.yaml: copy the trainer to a scratch directory, apply the case's edits (its one
planted defect, or none), run sleuth there exactly as docs/guides/your-trainer.md tells a user, read
report.json and score it:

- found: a planted defect whose expected invariant (or one in `also_found`) is reported `mismatch`;
- silent: a planted defect whose expected invariant is reported `match`;
- false alarm: any `mismatch` on a clean trainer, or a `mismatch` on a defective one outside the
  defect's expected / also_found / related invariants.

Prints a table and the totals and writes results.json beside this file (or --results).

    PYTHONPATH=$PWD python bench/blind_observe/run.py                      # sleuth from this checkout
    PYTHONPATH=/work/main python bench/blind_observe/run.py --label main   # sleuth from another checkout

Not part of the test suite: it runs every trainer in sleuth's sandbox (about 10 s each).
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

HERE = Path(__file__).resolve().parent


def apply_edits(folder: Path, edits: list[dict], file_name: str = "train.py") -> None:
    path = folder / file_name
    text = path.read_text()
    for edit in edits:
        count = text.count(edit["old"])
        if count != 1:
            raise SystemExit(f"edit for {folder.name}: {edit['old']!r} occurs {count} times, expected once")
        text = text.replace(edit["old"], edit["new"])
    path.write_text(text)


def sleuth_command(args: argparse.Namespace) -> list[str]:
    if args.sleuth:
        return [args.sleuth]
    return [sys.executable, "-c", "import sys; from sleuth.cli import main; sys.argv[0] = 'sleuth'; main()"]


def run_case(case: dict, trainers: dict, args: argparse.Namespace, scratch: Path) -> dict:
    trainer = case["trainer"]
    work = scratch / case["name"] / trainer
    out = scratch / case["name"] / "diagnosis"
    if args.rescore:
        return read_report(case, out, None, 0.0, ["no report kept"])
    shutil.copytree(HERE / "trainers" / trainer, work, ignore=shutil.ignore_patterns("__pycache__"))
    apply_edits(work, case.get("edits", []))
    command = trainers[trainer]["command"]
    argv = sleuth_command(args) + ["diagnose", "--code", ".", "--probe", "--offline", "--out", str(out)]
    if args.mode == "observe":
        argv += ["--", *command]
    started = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=args.timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        rc, tail = None, [f"timed out after {args.timeout} s"]
    seconds = round(time.monotonic() - started, 1)
    return read_report(case, out, rc, seconds, tail)


def read_report(case: dict, out: Path, rc: int | None, seconds: float, tail: list[str]) -> dict:
    trainer = case["trainer"]
    report_path = out / "report.json"
    if not report_path.is_file():
        return {"name": case["name"], "trainer": trainer, "expected": case["expected"], "exit": rc,
                "seconds": seconds, "error": " | ".join(tail), "verdict": "error", "findings": {}}
    report = json.loads(report_path.read_text())
    findings = {f["id"]: {"status": f["status"], "static_agreement": f.get("static_agreement", False),
                          "observed": f.get("observed"), "reason": f.get("reason")}
                for f in report["findings"]}
    return score(case, findings) | {"exit": rc, "seconds": seconds,
                                    "probe_ran": bool((report.get("probes") or {}).get("ran")),
                                    "probe_notes": (report.get("probes") or {}).get("notes", []),
                                    "findings": findings}


def score(case: dict, findings: dict) -> dict:
    expected = case["expected"]
    mismatches = sorted(i for i, f in findings.items() if f["status"] == "mismatch")
    result = {"name": case["name"], "trainer": case["trainer"], "expected": expected,
              "class": case.get("class", "clean"), "catalog": case.get("catalog", "in"), "mismatches": mismatches}
    if expected == "none":
        result["verdict"] = "false alarm" if mismatches else "clean"
        result["false_alarms"] = mismatches
        return result
    naming = [expected, *case.get("also_found", [])]
    tolerated = set(naming) | set(case.get("related", []))
    result["false_alarms"] = [i for i in mismatches if i not in tolerated]
    status = findings.get(expected, {}).get("status", "absent")
    result["expected_status"] = status
    # not a claim, so not silent; but the report says the broken code reads as the rule requires
    result["static_vouched"] = bool(findings.get(expected, {}).get("static_agreement")) and status == "unknown"
    found_by = [i for i in naming if findings.get(i, {}).get("status") == "mismatch"]
    if found_by:
        result["verdict"] = "found"
        result["found_by"] = found_by
    elif status == "match":
        result["verdict"] = "silent"
    else:
        result["verdict"] = "missed"
    return result


def summarise(results: list[dict]) -> dict:
    defects = [r for r in results if r["expected"] != "none"]
    clean = [r for r in results if r["expected"] == "none"]
    found = sum(r["verdict"] == "found" for r in defects)
    return {
        "defects": len(defects),
        "found": found,
        "recall": round(found / len(defects), 3) if defects else None,
        "silent": sum(r["verdict"] == "silent" for r in defects),
        "missed_unknown": sum(r["verdict"] == "missed" for r in defects),
        "missed_with_static_agreement": sum(r["verdict"] == "missed" and r.get("static_vouched") for r in defects),
        "errors": sum(r["verdict"] == "error" for r in results),
        "clean_cases": len(clean),
        "false_alarm_cases": sum(bool(r.get("false_alarms")) for r in results),
        "false_alarms": sum(len(r.get("false_alarms", [])) for r in results),
        "in_catalog": {"defects": sum(r["catalog"] == "in" for r in defects),
                       "found": sum(r["catalog"] == "in" and r["verdict"] == "found" for r in defects)},
    }


def reason_of(r: dict, invariant: str) -> str:
    f = r["findings"].get(invariant)
    if not f:
        return "absent from the report"
    star = " (static agreement)" if f.get("static_agreement") else ""
    reason = (f.get("reason") or "").replace("\n", " ")[:220]
    observed = (f.get("observed") or "").replace("\n", " ")[:160]
    return f"{f['status']}{star}: {reason} [observed: {observed}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=str(HERE / "cases.yaml"))
    ap.add_argument("--only", nargs="*", help="case names (default: all)")
    ap.add_argument("--sleuth", help="a sleuth executable (default: `sleuth.cli` importable from PYTHONPATH)")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--mode", choices=["observe", "probes"], default="observe",
                    help="observe: the docs' command, `-- CMD` (the acceptance measure); probes: the same without a "
                         "command, the probes' experiments on located pieces (for comparison)")
    ap.add_argument("--label", default="branch", help="what sleuth was measured (written into results.json)")
    ap.add_argument("--results", default=str(HERE / "results.json"))
    ap.add_argument("--keep", help="keep the copies and reports in this directory")
    ap.add_argument("--rescore", action="store_true",
                    help="score the reports kept in --keep again (after editing cases.yaml), running nothing")
    args = ap.parse_args()
    if args.rescore and not args.keep:
        ap.error("--rescore needs --keep DIR (where an earlier run kept its reports)")

    spec = yaml.safe_load(Path(args.cases).read_text())
    cases = [c for c in spec["cases"] if not args.only or c["name"] in args.only]
    scratch = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="blind-observe-"))
    scratch.mkdir(parents=True, exist_ok=True)
    results = []
    print(f"{'case':44} {'expected':34} {'verdict':12} {'s':>5}  other mismatches", flush=True)
    for case in cases:
        r = run_case(case, spec["trainers"], args, scratch)
        results.append(r)
        exp = r["expected"].removeprefix("dflash.")
        if r["expected"] == "none" or r["verdict"] == "error":
            shown = r["verdict"]
        elif r.get("found_by") and r["expected"] not in r["found_by"]:
            shown = f"found (via {r['found_by'][0].removeprefix('dflash.')})"
        else:
            shown = f"{r['verdict']} ({r.get('expected_status', '-')})"
        others = ", ".join(i.removeprefix("dflash.") for i in r.get("false_alarms", [])) or ""
        if r["verdict"] == "error":
            others = r["error"][:120]
        print(f"{r['name']:44} {exp:34} {shown:12} {r['seconds']:5.1f}  {others}", flush=True)
    totals = summarise(results)
    print(f"\nrecall {totals['found']}/{totals['defects']} = {totals['recall']:.0%}; silent matches "
          f"{totals['silent']}; missed (unknown) {totals['missed_unknown']}, of them read as static agreement "
          f"{totals['missed_with_static_agreement']}; false alarms {totals['false_alarms']} "
          f"in {totals['false_alarm_cases']} case(s); errors {totals['errors']}; in-catalog classes "
          f"{totals['in_catalog']['found']}/{totals['in_catalog']['defects']}")
    for r in results:
        if r["verdict"] in ("missed", "silent", "error"):
            case = next(c for c in cases if c["name"] == r["name"])
            for invariant in [r["expected"], *case.get("also_found", [])]:
                if invariant in r["findings"] or invariant == r["expected"]:
                    print(f"  {r['name']}: {invariant} {reason_of(r, invariant)}")
        for fa in r.get("false_alarms", []):
            print(f"  {r['name']}: false alarm {fa} {reason_of(r, fa)}")
    git_head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.environ.get("PYTHONPATH", ".").split(os.pathsep)[0] or ".").stdout.strip()
    Path(args.results).write_text(json.dumps({
        "label": args.label, "sleuth_pythonpath": os.environ.get("PYTHONPATH"), "sleuth_commit": git_head,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mode": args.mode,
        "command": "sleuth diagnose --code . --probe --offline --out DIR"
                   + (" -- <trainer command>" if args.mode == "observe" else ""),
        "totals": totals, "cases": results}, indent=1) + "\n")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
