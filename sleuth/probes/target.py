"""The probe's synthetic target and its batches: tiny, seeded, built so each experiment's answer is unambiguous.

Hidden states are random per layer (not a real forward): what matters is that every layer, every
position and every candidate teacher (final logits at p+j-1 and p+j, lm_head(norm(h)) of each layer)
differs from the others, so a measurement can only agree with one of them.

The batch is built to show the defects that only appear with company (issue 20: a mask tiled with
`repeat` for `repeat_interleave` is invisible when one block runs alone): several rows, several blocks per
row, two anchors one position apart (their blocks overlap), anchors on the last position of a document and
on the first position of the next (whose own context is empty), several documents packed in a row, a
padded anchor slot (the sampler's sentinel), and loss-mask holes under some block slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sleuth.probes.protocol import ProbeBatch, ProbeTarget

VOCAB = 64
HIDDEN = 32
# head_dim is not hidden / heads, as in the published Qwen3.6-27B drafter (5120 hidden, 32 heads of 128): code
# that takes one for the other (a softmax scale, a reshape) only shows on such a shape.
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
INTERMEDIATE = 64
# No library's default (Qwen3 / Llama RMSNorm 1e-6, Llama-3 configs 1e-5, nn.RMSNorm finfo.eps): a norm built with a
# class default instead of the config's eps shows as another eps (experiments/norms.py).
RMS_EPS = 3e-6
# Logits with a spread of about 2 nats per unit: soft targets keep visible mass on several tokens (so a KL
# loss is told apart from a one-hot CE) and argmaxes of different candidates rarely coincide.
LM_HEAD_STD = 0.35
# The synthetic tokenizer's special tokens, laid out as Qwen3's are: pad (<|endoftext|>, also the padding of padded
# rows) and eos (<|im_end|>) are two different tokens, and there is no mask token. A trainer that takes "a pad
# token that is not eos" for a free slot shows only on such a tokenizer (issue 20, round 7).
PAD_TOKEN = 0
EOS_TOKEN = 1


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
        # far from all ones: a teacher built without the final norm's gain (or with another) changes many argmaxes
        norm_weight=torch.exp(0.5 * torch.randn(HIDDEN, generator=g)),
    )


@dataclass(frozen=True)
class Row:
    """One row of the batch: its documents (as [start, end) spans), padding, anchors and loss-mask holes."""

    documents: tuple[tuple[int, int], ...]
    length: int  # positions before the padding (the row's valid part)
    anchors: tuple[int, ...]  # the valid anchors, sorted
    holes: tuple[int, ...]  # positions inside documents whose loss mask is 0 (a prompt, say)

    def document_of(self, position: int) -> tuple[int, int] | None:
        return next(((s, e) for s, e in self.documents if s <= position < e), None)


@dataclass(frozen=True)
class Layout:
    """Where things are in the probe batch: every row's documents and anchors, one padded anchor slot each."""

    block_size: int
    seq_len: int
    rows: tuple[Row, ...]
    packed: bool  # True when rows hold several documents (the subject's API takes document ids / positions)

    @property
    def num_anchors(self) -> int:  # anchor slots per row, the padded one included
        return max(len(r.anchors) for r in self.rows) + 1

    @property
    def documents(self) -> int:
        return max(len(r.documents) for r in self.rows)

    def blocks(self) -> list[tuple[int, int, int]]:
        """(row, slot index, anchor position) of every valid block."""
        return [(n, i, a) for n, row in enumerate(self.rows) for i, a in enumerate(row.anchors)]

    def adjacent_pairs(self) -> list[tuple[int, int, int]]:
        """(row, i, i+1) for anchors one position apart: their blocks overlap."""
        return [(n, i, i + 1) for n, row in enumerate(self.rows) for i in range(len(row.anchors) - 1)
                if row.anchors[i + 1] - row.anchors[i] == 1]

    def edge_anchors(self) -> dict[str, list[tuple[int, int]]]:
        """Anchors on a document's last position, and on a document's first position (after another)."""
        last, first = [], []
        for n, row in enumerate(self.rows):
            for i, a in enumerate(row.anchors):
                s, e = row.document_of(a) or (0, 0)
                if a == e - 1:
                    last.append((n, i))
                if a == s and s > 0:
                    first.append((n, i))
        return {"last position of a document": last, "first position of a document after another": first}


def make_layout(block_size: int, *, packed: bool = True, rows: int = 2) -> Layout:
    """Rows of 3B+17 positions. Packed: three documents in row 0, two in row 1. Not packed (a subject whose
    forward takes no document ids): one document per row, the second row padded at its end."""
    b = block_size
    d0, d1 = b + 8, b + 6
    seq = d0 + d1 + b + 3
    mid = b // 2 + 3
    holes0 = (mid + 2, mid + 3, d0 + b + 2)  # under slots 2-3 of the block at `mid` and the last of the one at d0+3
    # Row 0 has a block at position 0, where the padded anchor slots sit too: code that tells blocks apart by their
    # anchor position, not their index, joins it to the padding blocks (row 1 has one anchor fewer, two padded slots).
    row0 = Row(documents=((0, d0), (d0, d0 + d1), (d0 + d1, seq)) if packed else ((0, seq),), length=seq,
               anchors=(0, 1, 2, mid, d0 - 1, d0, d0 + 3), holes=holes0)
    split = b + 5
    anchors1 = (3, 4, split - 1, split, split + 2, 2 * b + 9)
    if packed:
        row1 = Row(documents=((0, split), (split, seq)), length=seq, anchors=anchors1, holes=(split + 4,))
    else:  # padded after 2B+14 positions: the last block runs into the padding
        length = seq - (b + 3)
        row1 = Row(documents=((0, length),), length=length, anchors=anchors1, holes=(split + 4,))
    chosen = (row0, row1)[: max(1, rows)]
    return Layout(block_size=b, seq_len=seq, rows=chosen, packed=packed)


def make_batch(target: ProbeTarget, layout: Layout, seed: int = 1) -> ProbeBatch:
    g = torch.Generator().manual_seed(seed)
    n, s, h, v = len(layout.rows), layout.seq_len, target.hidden_size, target.vocab_size
    # Data tokens avoid the mask token and the pad token, so neither can be mistaken for data.
    input_ids = torch.randint(1, v - 1, (n, s), generator=g)
    doc_ids = torch.full((n, s), -1, dtype=torch.long)
    position_ids = torch.zeros(n, s, dtype=torch.long)
    loss_mask = torch.zeros(n, s, dtype=torch.long)
    a = layout.num_anchors
    anchors = torch.zeros(n, a, dtype=torch.long)  # the padded slot stays at position 0, as samplers leave it
    anchor_valid = torch.zeros(n, a, dtype=torch.bool)
    for r, row in enumerate(layout.rows):
        for d, (start, end) in enumerate(row.documents):
            doc_ids[r, start:end] = d
            position_ids[r, start:end] = torch.arange(end - start)
            loss_mask[r, start:end] = 1
        input_ids[r, row.length :] = PAD_TOKEN
        last_start = row.documents[-1][0]  # padding continues the last document's positions (arange for one)
        position_ids[r, row.length :] = torch.arange(row.length - last_start, s - last_start)
        for hole in row.holes:
            loss_mask[r, hole] = 0
        anchors[r, : len(row.anchors)] = torch.tensor(row.anchors)
        anchor_valid[r, : len(row.anchors)] = True
    hidden = [target.embed_weight[input_ids]]  # [N, S, H] index 0: the embeddings
    hidden += [torch.randn(n, s, h, generator=g) for _ in range(target.num_layers - 1)]  # outputs of layers 0..L-2
    last_hidden = torch.randn(n, s, h, generator=g)  # output of layer L-1, before the final norm
    hidden.append(rms_norm(last_hidden, target.norm_weight, target.rms_norm_eps))  # HF: the last entry is normed
    logits = hidden[-1] @ target.lm_head_weight.T  # [N, S, V]
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


def perturb_positions(batch: ProbeBatch, positions: list[tuple[int, int]], seed: int, scale: float = 3.0) -> ProbeBatch:
    """Add noise to every layer's hidden state (and the pre-norm last one) at these (row, position) pairs."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.tensor([r for r, _ in positions], dtype=torch.long)
    cols = torch.tensor([p for _, p in positions], dtype=torch.long)
    hidden = []
    for layer in [*batch.hidden_states, batch.last_hidden]:
        changed = layer.clone()
        changed[rows, cols] = changed[rows, cols] + scale * torch.randn(changed[rows, cols].shape, generator=g)
        hidden.append(changed)
    return batch.replace(hidden_states=tuple(hidden[:-1]), last_hidden=hidden[-1])


def perturb_layer(batch: ProbeBatch, layer: int, seed: int, scale: float = 3.0) -> ProbeBatch:
    """Add noise to hidden_states[layer] at every position (nothing else changes)."""
    g = torch.Generator().manual_seed(seed)
    hidden = list(batch.hidden_states)
    hidden[layer] = hidden[layer] + scale * torch.randn(hidden[layer].shape, generator=g)
    return batch.replace(hidden_states=tuple(hidden))
