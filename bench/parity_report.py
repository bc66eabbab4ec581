"""Print the parity tolerances actually reached against speculators, case by case (for BENCHMARKS.md).

Runs the same cases as tests/parity/test_speculators_parity.py, in the speculators environment:
    PYTHONPATH=. .venv-speculators/bin/python bench/parity_report.py
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "parity")]

import torch  # noqa: E402
from parity_harness import PARITY_CASES, run_parity  # noqa: E402


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print("| case | rows | anchors valid | loss (ours) | loss abs diff | loss rel diff | acc | "
          "max grad abs diff | max grad rel diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = [0.0, 0.0, 0.0, 0.0]
    for case in PARITY_CASES:
        r = run_parity(case)
        loss_abs = abs(r.our_loss - r.their_loss)
        loss_rel = loss_abs / abs(r.their_loss)
        grad_abs, grad_rel = r.max_grad_diffs()
        worst = [max(w, v) for w, v in zip(worst, (loss_abs, loss_rel, grad_abs, grad_rel))]
        print(f"| {case.name} | {len(case.docs_per_row)} | {int(r.anchor_valid.sum())} | {r.our_loss:.6f} | "
              f"{loss_abs:.2e} | {loss_rel:.2e} | {r.our_metrics['acc']:.3f} | {grad_abs:.2e} | {grad_rel:.2e} |")
    print(f"\nworst: loss abs {worst[0]:.2e}, loss rel {worst[1]:.2e}, grad abs {worst[2]:.2e}, "
          f"grad rel (to the tensor's max |grad|) {worst[3]:.2e}")


if __name__ == "__main__":
    main()
