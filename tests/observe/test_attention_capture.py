"""attention.py's capture on real torch calls, in this process (its hooks are called directly, torch is not patched
here), and its flex wiring in a child interpreter started the way sleuth starts the observed command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from sleuth.observe.attention import AttentionWatch

ROOT = Path(__file__).resolve().parents[2]
ANCHORS = torch.tensor([[5, 11, 17], [3, 9, 15]])


def allowed(b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The reference over keys [24 context positions, 12 block tokens], blocks of 4."""
    return ((k < 24) & (k < ANCHORS[b, q // 4])) | ((k >= 24) & ((k - 24) // 4 == q // 4))


def watch() -> AttentionWatch:
    found = AttentionWatch(torch)
    found.embedded = [{"ids": [[0] * 12] * 2, "order": 1}]  # two rows of 12 block tokens
    return found


def expected_row(row: int) -> list[list[int]]:
    return [[0, int(ANCHORS[row, q // 4]), int(ANCHORS[row, q // 4]), (q // 4) * 4, (q // 4) * 4 + 4, 4]
            for q in range(12)]


def test_sdpa_additive_mask_broadcast_over_heads_and_is_causal() -> None:
    b, q, k = torch.meshgrid(torch.arange(2), torch.arange(12), torch.arange(36), indexing="ij")
    additive = torch.zeros(2, 1, 12, 36).masked_fill(~allowed(b, q, k)[:, None], torch.finfo(torch.float32).min)
    query = torch.randn(2, 2, 12, 16, requires_grad=True)
    seen = watch()
    seen.on_sdpa(query, torch.randn(2, 2, 36, 16), additive, False)
    call = seen.calls[-1]
    assert call["how"] == "scaled_dot_product_attention: additive mask" and call["heads_agree"]
    assert seen.summaries[0]["rows"] == [expected_row(0), expected_row(1)]
    seen.on_sdpa(query, torch.randn(2, 2, 36, 16), None, True)
    assert seen.calls[-1]["how"] == "scaled_dot_product_attention: is_causal"
    assert seen.summaries[1]["rows"][0][3] == [0, 4, 4, -1, 0, 0]  # query 3 sees keys 0..3, no block key
    with torch.no_grad():  # the target's attention (no gradient) is not the drafter's
        seen.on_sdpa(query, torch.randn(2, 2, 36, 16), additive, False)
    assert len(seen.calls) == 2


def test_flex_block_mask_is_evaluated_element_by_element() -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(lambda b, h, q, k: allowed(b, q, k), 2, None, 12, 36, device="cpu")
    seen = watch()
    seen.on_flex(torch.randn(2, 2, 12, 16, requires_grad=True), torch.randn(2, 2, 36, 16), block_mask)
    assert seen.calls[-1]["how"] == "flex_attention: the block mask's mask_mod"
    assert seen.summaries[0]["rows"] == [expected_row(0), expected_row(1)]


def test_flex_attention_is_wrapped_when_the_command_imports_it(tmp_path: Path) -> None:
    script = ("import torch\nfrom torch.nn.attention.flex_attention import flex_attention\n"
              "print(getattr(flex_attention, '__sleuth__', False), flex_attention.__wrapped__.__name__)\n")
    env = {**os.environ, "SLEUTH_OBSERVE_ANSWER": str(tmp_path / "answer.json"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "sleuth" / "observe" / "site"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True", "flex_attention"], done.stderr
