"""The probe's synthetic target and its batches: tiny, seeded, built so each experiment's answer is unambiguous.

Hidden states are random per layer (not a real forward): what matters is that every layer, every
position and every candidate teacher (final logits at p+j-1 and p+j, lm_head(norm(h)) of each layer)
differs from the others, so a measurement can only agree with one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sleuth.probes.protocol import ProbeBatch, ProbeTarget

VOCAB = 64
HIDDEN = 32
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
INTERMEDIATE = 64
RMS_EPS = 1e-6
# Logits with a spread of about 2 nats per unit: soft targets keep visible mass on several tokens (so a KL
# loss is told apart from a one-hot CE) and argmaxes of different candidates rarely coincide.
LM_HEAD_STD = 0.35


def rms_norm(x: Tensor, weight: Tensor, eps: float = RMS_EPS) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * w, in float32 (the Qwen3 final norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def make_target(num_layers: int, seed: int = 0) -> ProbeTarget:
    g = torch.Generator().manual_seed(seed)
    return ProbeTarget(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTERMEDIATE,
        rms_norm_eps=RMS_EPS,
        rope_theta=10000.0,
        mask_token_id=VOCAB - 1,
        embed_weight=torch.randn(VOCAB, HIDDEN, generator=g),
        lm_head_weight=torch.randn(VOCAB, HIDDEN, generator=g) * LM_HEAD_STD,
        norm_weight=1.0 + 0.1 * torch.randn(HIDDEN, generator=g),  # not all ones: a missing norm shows
    )


@dataclass(frozen=True)
class Layout:
    """Where things are in the probe batch: one row, two documents, three anchors.

    Block 0 at a0 and block 1 at a1 = a0 + 2 share document 0 and overlap in positions (the case where a
    cross-block leak shows); block 2 sits in document 1, whose positions restart at 0.
    """

    block_size: int
    seq_len: int
    doc0_end: int  # document 0 is [0, doc0_end), document 1 is [doc0_end, seq_len)
    anchors: tuple[int, int, int]

    @property
    def num_anchors(self) -> int:
        return len(self.anchors)

    @property
    def documents(self) -> int:
        return 1 if self.doc0_end == self.seq_len else 2


def make_layout(block_size: int, documents: int = 2) -> Layout:
    """Two documents per row; `documents=1` for subjects that never pack (their rows hold one document)."""
    b = block_size
    a0 = 4
    boundary = a0 + 2 + b + 4  # block 1 (a0 + 2) ends before it, with context after it
    a2 = boundary + 4
    seq_len = a2 + b + 4  # block 2 ends inside the row; anchors stay out of the last B positions
    doc0_end = seq_len if documents == 1 else boundary
    return Layout(block_size=b, seq_len=seq_len, doc0_end=doc0_end, anchors=(a0, a0 + 2, a2))


def make_batch(target: ProbeTarget, layout: Layout, seed: int = 1) -> ProbeBatch:
    g = torch.Generator().manual_seed(seed)
    s, h, v, n_layers = layout.seq_len, target.hidden_size, target.vocab_size, target.num_layers
    input_ids = torch.randint(0, v - 1, (1, s), generator=g)  # never the mask token
    doc_ids = torch.zeros(1, s, dtype=torch.long)
    doc_ids[0, layout.doc0_end :] = 1
    position_ids = torch.cat([torch.arange(layout.doc0_end), torch.arange(s - layout.doc0_end)]).unsqueeze(0)
    loss_mask = torch.ones(1, s, dtype=torch.long)
    anchors = torch.tensor([layout.anchors], dtype=torch.long)
    anchor_valid = torch.ones(1, layout.num_anchors, dtype=torch.bool)
    hidden = [target.embed_weight[input_ids]]  # [1, S, H] index 0: the embeddings
    hidden += [torch.randn(1, s, h, generator=g) for _ in range(n_layers - 1)]  # outputs of layers 0..L-2
    last_hidden = torch.randn(1, s, h, generator=g)  # output of layer L-1, before the final norm
    hidden.append(rms_norm(last_hidden, target.norm_weight, target.rms_norm_eps))  # HF: the last entry is normed
    logits = hidden[-1] @ target.lm_head_weight.T  # [1, S, V]
    return ProbeBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        doc_ids=doc_ids,
        loss_mask=loss_mask,
        anchors=anchors,
        anchor_valid=anchor_valid,
        hidden_states=tuple(hidden),
        last_hidden=last_hidden,
        logits=logits,
    )


def perturb_positions(batch: ProbeBatch, positions: list[int], seed: int, scale: float = 3.0) -> ProbeBatch:
    """Replace every layer's hidden state (and the pre-norm last one) at `positions` by other random values."""
    g = torch.Generator().manual_seed(seed)
    index = torch.tensor(positions, dtype=torch.long)
    hidden = []
    for layer in batch.hidden_states:
        changed = layer.clone()
        changed[:, index] = changed[:, index] + scale * torch.randn(changed[:, index].shape, generator=g)
        hidden.append(changed)
    last = batch.last_hidden.clone()
    last[:, index] = last[:, index] + scale * torch.randn(last[:, index].shape, generator=g)
    return batch.replace(hidden_states=tuple(hidden), last_hidden=last)


def perturb_layer(batch: ProbeBatch, layer: int, seed: int, scale: float = 3.0) -> ProbeBatch:
    """Add noise to hidden_states[layer] at every position (nothing else changes)."""
    g = torch.Generator().manual_seed(seed)
    hidden = list(batch.hidden_states)
    hidden[layer] = hidden[layer] + scale * torch.randn(hidden[layer].shape, generator=g)
    return batch.replace(hidden_states=tuple(hidden))
