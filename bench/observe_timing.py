"""Wall time of one diagnosis with an observed step: `sleuth diagnose --run RUN --probe --observe-recorded` on a
tiny run of our own trainer (the small embedded target, block 4, batch 4, seq 64), and the same run's command
given after `--` (`--code COPY --probe -- python -m trainer.cli run ...`). The issue's bar: under 60 s on 2 cores.

Each measurement is a fresh `python -m sleuth.cli` process timed from here (imports, the static diagnosis, the
sandbox, the command's start-up, one optimizer step and the judgement included: what a user waits for). The
load average before each is printed beside it, since the machine may be shared.

    PYTHONPATH=. .venv/bin/python bench/observe_timing.py [--preset v5] [--repeats 3] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = {"seq_len": 64, "batch_size": 4, "block_size": 4, "max_anchors": 6, "draft_layers": 5, "lr": 3e-3,
        "warmup_steps": 2, "log_every": 1, "eval_every": None, "eval_prompts": 1, "eval_max_new_tokens": 4,
        "checkpoint_every": 1, "steps": 1}


def env(threads: int) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}


def prepare(root: Path, preset: str, threads: int) -> tuple[Path, Path]:
    """The small embedded target (readable by the observed command's unprivileged user), a tiny config, a run."""
    sys.path.insert(0, str(REPO))
    from trainer.target.embedded import build_embedded_target

    target = build_embedded_target(root / "target", small=True, progress=False, steps=1)
    for path in [root, target, *target.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o005)
    config = root / "tiny.json"
    config.write_text(json.dumps({**TINY, "target": str(target)}))
    subprocess.run([sys.executable, "-m", "trainer.cli", "run", preset, "--preset", preset, "--config", str(config),
                    "--runs-dir", str(root / "runs"), "--device", "cpu", "--quiet"], cwd=root, env=env(threads),
                   check=True, capture_output=True)
    return config, root / "runs" / preset


def timed(argv: list[str], cwd: Path, threads: int, out: Path) -> dict:
    load = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", "--offline", "--out", str(out), *argv],
                          cwd=cwd, env=env(threads), capture_output=True, text=True)
    wall = time.perf_counter() - started
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    notes = (report.get("probes") or {}).get("notes") or []
    step = next((n for n in notes if n.startswith("observed ")), None)
    # The observed step's own verdicts (the evidence), not the findings' final status (static readings merged in).
    decided = sorted({f["id"].split(".", 1)[-1] + " " + e["value"].split(":", 1)[0]
                      for f in report.get("findings", []) for e in f["evidence"]
                      if e.get("location") == "probe:observed-step" and not e["value"].startswith("unknown")})
    return {"wall_s": round(wall, 2), "load_1min_before": round(load, 2), "exit": done.returncode,
            "observed": step, "decided_by_the_step": decided,
            "error": (done.stderr.strip().splitlines() or [""])[-1] if done.returncode == 2 else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="v5")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of sleuth and the observed command")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="observe-bench-"))
    try:
        config, run = prepare(root, args.preset, args.threads)
        code = root / "code"
        shutil.copytree(REPO / "trainer", code / "trainer", ignore=shutil.ignore_patterns("__pycache__"))
        cases = {
            "recorded (--run RUN --probe --observe-recorded)": (["--run", str(run), "--probe", "--observe-recorded"],
                                                                root),
            "command (--code COPY --probe -- python -m trainer.cli run ...)": (
                ["--code", ".", "--probe", "--", "python", "-m", "trainer.cli", "run", args.preset, "--preset",
                 args.preset, "--config", str(config), "--quiet"], code),
        }
        results: dict[str, list[dict]] = {}
        for name, (argv, cwd) in cases.items():
            results[name] = [timed(argv, cwd, args.threads, root / f"out-{i}-{len(results)}")
                             for i in range(args.repeats)]
        print(f"cpu cores: {os.cpu_count()}, OMP threads: {args.threads}, preset {args.preset}")
        for name, rows in results.items():
            walls = [r["wall_s"] for r in rows]
            print(f"{name}: median {statistics.median(walls):.1f} s (runs {walls}; 1-min load before "
                  f"{[r['load_1min_before'] for r in rows]}); exit {rows[-1]['exit']}")
            print(f"  {rows[-1]['observed'] or rows[-1]['error']}")
            print(f"  decided by the observed step: {', '.join(rows[-1]['decided_by_the_step'])}")
        if args.json:
            args.json.write_text(json.dumps({"preset": args.preset, "threads": args.threads, "results": results},
                                            indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
