"""The table of BENCHMARKS.md's convergence section, from run directories (the run-directory contract):
training acc and tau at given steps, the final eval's tau and speedup, and training steps/s.

    PYTHONPATH=. .venv/bin/python bench/presets_table.py runs --runs v3 v5 v6 fixed --steps 100 200 300
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows_of(run: Path) -> dict[int, dict]:
    rows = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        rows[row["step"]] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs_dir", type=Path)
    parser.add_argument("--runs", nargs="+", default=["v3", "v5", "v6", "fixed"])
    parser.add_argument("--steps", nargs="+", type=int, default=[100, 200, 300])
    args = parser.parse_args()

    table = {name: rows_of(args.runs_dir / name) for name in args.runs}
    evals = {name: json.loads((args.runs_dir / name / "eval.json").read_text()) for name in args.runs}
    print("| | " + " | ".join(args.runs) + " |")
    print("|---" * (len(args.runs) + 1) + "|")
    at = " / ".join(str(s) for s in args.steps)

    def line(label: str, cell) -> None:
        print(f"| {label} | " + " | ".join(cell(name) for name in args.runs) + " |")

    line(f"training acc at step {at}", lambda n: " / ".join(f"{table[n][s]['acc']:.3f}" for s in args.steps))
    line(f"tau at step {at}", lambda n: " / ".join(f"{table[n][s].get('tau', float('nan')):.2f}" for s in args.steps))
    line("final eval: tau, speedup, lossless", lambda n: f"{evals[n]['tau']:.2f}, {evals[n]['speedup']:.2f}x, {evals[n]['lossless']}")
    last = max(args.steps)
    line(f"steps/s over {last} steps (evals included)", lambda n: f"{last / table[n][last]['elapsed_s']:.2f}")


if __name__ == "__main__":
    main()
