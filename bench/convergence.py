"""Convergence: how many steps `fixed` needs to reach v5's FINAL training accuracy and FINAL tau.

Trains the presets `v5` (the regressed run) and `fixed` (the reference configuration) on the embedded
target with the trainer CLI, for the same number of steps and the same logging/eval cadence, then reads
their metrics.jsonl and eval.json (the run-directory contract):
  * v5's final acc: its last logged training accuracy (and, less noisy, the mean of its last 3 logged rows);
  * v5's final tau: the acceptance length of its final speculative-decoding eval (eval.json);
  * fixed's steps: the first logged step whose acc (resp. the 3-row moving mean) is >= that value; the
    first eval step whose tau is >= v5's final tau, and the first from which it stays there.
The ratio v5 steps / fixed steps says how much sooner the fixed trainer gets there.

    PYTHONPATH=. .venv/bin/python bench/convergence.py --steps 200 --runs-dir /tmp/conv-runs
Existing completed runs in --runs-dir are reused (pass --fresh to retrain).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(preset: str, runs_dir: Path, steps: int, log_every: int, eval_every: int, fresh: bool) -> Path:
    run = runs_dir / preset
    info = run / "run.json"
    if run.exists() and not fresh and info.exists() and json.loads(info.read_text()).get("status") == "completed":
        print(f"reusing {run}", file=sys.stderr)
        return run
    if run.exists() and fresh:
        shutil.rmtree(run)
    if run.exists():  # killed earlier: resume it rather than throw away its steps
        command = [sys.executable, "-m", "trainer.cli", "run", preset, "--resume", "--runs-dir", str(runs_dir), "-q"]
    else:
        command = [sys.executable, "-m", "trainer.cli", "run", "--preset", preset, "--runs-dir", str(runs_dir),
                   "--steps", str(steps), "--set", f"log_every={log_every}", "--set", f"eval_every={eval_every}", "-q"]
    print("$ " + " ".join(command), file=sys.stderr)
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    return run


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def moving_mean(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))]


def first_step_reaching(steps: list[int], values: list[float], threshold: float) -> int | None:
    return next((s for s, v in zip(steps, values) if v >= threshold), None)


def first_step_staying(steps: list[int], values: list[float], threshold: float) -> int | None:
    """The first step from which every later value stays >= threshold (evals are noisy: 8 prompts)."""
    for i, step in enumerate(steps):
        if all(v >= threshold for v in values[i:]):
            return step
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs-dir", type=Path, default=Path("runs-bench"))
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    runs = {p: train(p, args.runs_dir, args.steps, args.log_every, args.eval_every, args.fresh) for p in ("v5", "fixed")}
    rows = {p: read_metrics(run) for p, run in runs.items()}
    v5, fixed = rows["v5"], rows["fixed"]
    v5_final_step = v5[-1]["step"]
    v5_final_acc = v5[-1]["acc"]
    v5_final_acc_smooth = moving_mean([r["acc"] for r in v5], 3)[-1]
    v5_eval = json.loads((runs["v5"] / "eval.json").read_text())
    fixed_eval = json.loads((runs["fixed"] / "eval.json").read_text())
    v5_final_tau = v5_eval["tau"]

    fixed_steps = [r["step"] for r in fixed]
    fixed_acc = [r["acc"] for r in fixed]
    tau_rows = [(r["step"], r["tau"]) for r in fixed if "tau" in r]
    tau_rows.append((fixed_eval.get("step", fixed_steps[-1]), fixed_eval["tau"]))  # the final eval counts too
    result = {
        "steps": args.steps,
        "v5_final_step": v5_final_step,
        "v5_final_acc": v5_final_acc,
        "v5_final_acc_mean_last3": v5_final_acc_smooth,
        "v5_final_tau": v5_final_tau,
        "fixed_final_acc": fixed_acc[-1],
        "fixed_final_tau": fixed_eval["tau"],
        "fixed_steps_to_v5_acc": first_step_reaching(fixed_steps, fixed_acc, v5_final_acc),
        "fixed_steps_to_v5_acc_mean_last3": first_step_reaching(fixed_steps, moving_mean(fixed_acc, 3),
                                                                v5_final_acc_smooth),
        "fixed_steps_to_v5_tau": first_step_reaching([s for s, _ in tau_rows], [t for _, t in tau_rows],
                                                     v5_final_tau),
        "fixed_steps_to_v5_tau_for_good": first_step_staying([s for s, _ in tau_rows], [t for _, t in tau_rows],
                                                             v5_final_tau),
        "v5_tau_curve": [(r["step"], r["tau"]) for r in v5 if "tau" in r] + [(v5_final_step, v5_final_tau)],
        "fixed_tau_curve": tau_rows,
    }
    for key in ("acc", "acc_mean_last3", "tau", "tau_for_good"):
        needed = result[f"fixed_steps_to_v5_{key}"]
        result[f"ratio_{key}"] = v5_final_step / needed if needed else None
    for key, value in result.items():
        print(f"{key:>34}: {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
