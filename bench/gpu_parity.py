"""Parity with speculators on a CUDA device, through both flex-attention paths, in float32.

Our step on CUDA builds a flex BlockMask (compiled create_block_mask) and runs compiled flex_attention;
speculators runs its "simple_flex_attention" (its compiled block mask and, on CUDA, its compiled forward).
Same cases, weights, inputs and anchors as tests/parity (see parity_harness.py); prints the differences
reached and exits 1 if any exceeds the tolerance below (looser than CPU: flex kernels tile the softmax).

    PYTHONPATH=. python bench/gpu_parity.py          # part of bench/gpu.sh
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "parity")]

import torch  # noqa: E402
from parity_harness import PARITY_CASES, run_parity  # noqa: E402

LOSS_REL, GRAD_REL = 1e-4, 1e-3  # relative to the loss / to the tensor's largest gradient


def main() -> int:
    # Every case has other shapes, so each one compiles both sides' kernels again (tens of seconds on a
    # GPU); the first N cases still cover CE/KL, gamma 4/7/None, 1-3 documents and the rolled-target branch.
    count = int(sys.argv[sys.argv.index("--cases") + 1]) if "--cases" in sys.argv else 4
    cases = PARITY_CASES[:count]
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here
    torch.backends.cudnn.allow_tf32 = False
    failed = 0
    print("| case | loss abs diff | loss rel diff | acc ours / theirs | max grad abs diff | max grad rel diff |")
    print("|---|---|---|---|---|---|")
    for case in cases:
        case = dataclasses.replace(case, attn="simple_flex_attention")
        r = run_parity(case, device="cuda")
        loss_abs = abs(r.our_loss - r.their_loss)
        loss_rel = loss_abs / abs(r.their_loss)
        grad_abs, grad_rel = r.max_grad_diffs()
        ok = loss_rel <= LOSS_REL and grad_rel <= GRAD_REL and abs(r.our_metrics["acc"] - r.their_acc()) < 1e-6
        failed += not ok
        print(f"| {case.name} | {loss_abs:.2e} | {loss_rel:.2e} | {r.our_metrics['acc']:.4f} / {r.their_acc():.4f} | "
              f"{grad_abs:.2e} | {grad_rel:.2e} |{'' if ok else ' **FAIL**'}", flush=True)
    print(f"\n{len(cases) - failed}/{len(cases)} cases within loss rel {LOSS_REL:g}, grad rel {GRAD_REL:g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
