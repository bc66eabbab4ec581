"""A reduced draft vocabulary (`draft_vocab_size`): the drafter predicts only the most frequent tokens.

Built as speculators builds it (train/vocab_mapping.py, 0.9.0): count the supervised tokens of the
training data (loss_mask 1), keep the `draft_vocab_size` most frequent (ties by id), fill up with the
smallest unused ids when the data has fewer distinct tokens, sort. Its two maps are speculators':
  d2t[i] = target_id - i   (draft index i -> target id, stored as an offset)
  t2d[v] = True            (target id v is in the draft vocabulary)
The drafter's head is the target's lm_head restricted to these rows and the teacher is the target's
logits restricted to them, so the loss, accuracy and acceptance are those of a drafter that can only
propose these tokens, exactly what vLLM serves through d2t.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

VOCAB_FILE = "draft_vocab.safetensors"


def token_frequencies(input_ids: Tensor, loss_mask: Tensor) -> Counter[int]:
    ids, counts = torch.unique(input_ids[loss_mask.bool()], return_counts=True)
    return Counter(dict(zip(ids.tolist(), counts.tolist())))


def draft_token_ids(frequencies: Counter[int], draft_vocab_size: int, target_vocab_size: int) -> Tensor:
    """The target ids of the draft vocabulary, sorted: [draft_vocab_size] long."""
    if not 0 < draft_vocab_size <= target_vocab_size:
        from trainer.config import ConfigError  # the config's key, checked against the target it names

        raise ConfigError(f"invalid config: draft_vocab_size {draft_vocab_size} must be in 2..{target_vocab_size} "
                          "(the target's vocabulary)")
    chosen = sorted(frequencies, key=lambda tid: (-frequencies[tid], tid))[:draft_vocab_size]
    if len(chosen) < draft_vocab_size:
        present = set(chosen)
        chosen += [tid for tid in range(target_vocab_size) if tid not in present][: draft_vocab_size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def vocab_maps(token_ids: Tensor, target_vocab_size: int) -> tuple[Tensor, Tensor]:
    """(d2t, t2d) in speculators' format."""
    d2t = token_ids - torch.arange(token_ids.numel(), dtype=torch.long)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[token_ids] = True
    return d2t, t2d


def save_vocab(path: Path, token_ids: Tensor, target_vocab_size: int) -> None:
    d2t, t2d = vocab_maps(token_ids, target_vocab_size)
    from trainer.run.checkpoint import write_safetensors  # staged and renamed through trainer.safe_io

    write_safetensors({"token_ids": token_ids, "d2t": d2t, "t2d": t2d}, path)


def load_vocab(path: Path) -> Tensor:
    return load_file(str(path))["token_ids"]
