"""DFlash drafter with a dataclass config and a string-keyed loss registry, on a synthetic target.

The target is a fixed random causal network that exposes per-layer hidden states and logits like an HF
model (hidden_states[0] = embeddings, hidden_states[i+1] = output of layer i). Losses are looked up by
name from LOSSES; position weights come from the config.

    python train.py --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


# ----------------------------------------------------------------------------- configuration
@dataclass
class TargetConfig:
    num_layers: int = 8
    hidden: int = 32
    vocab: int = 80


@dataclass
class DraftConfig:
    num_layers: int = 1
    heads: int = 4
    kv_heads: int = 2
    num_taps: int = 3
    block_size: int = 8
    mask_token_id: int = 79

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2")


@dataclass
class LossConfig:
    name: str = "cross_entropy"
    gamma: float = 7.0


@dataclass
class TrainConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    max_anchors: int = 6
    seq_len: int = 48
    prompt_len: int = 8
    batch: int = 4
    lr: float = 2e-3
    steps: int = 2
    seed: int = 0


# ----------------------------------------------------------------------------- loss registry
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LOSSES: dict[str, LossFn] = {}
DEFAULT_LOSS = "logit_mse"


def register(*names: str) -> Callable[[LossFn], LossFn]:
    def wrap(fn: LossFn) -> LossFn:
        for n in names:
            LOSSES[n] = fn
        return fn
    return wrap


@register("ce", "xent", "hard_ce")
def hard_ce(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Per-slot CE against the teacher's argmax token."""
    return F.cross_entropy(draft_logits.flatten(0, -2), teacher_logits.argmax(-1).flatten(),
                           reduction="none").view(draft_logits.shape[:-1])


@register("kl", "kl_div")
def kl(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    return F.kl_div(draft_logits.log_softmax(-1), teacher_logits.log_softmax(-1), log_target=True,
                    reduction="none").sum(-1)


@register("logit_mse")
def logit_mse(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    return (draft_logits - teacher_logits).pow(2).mean(-1)


def get_loss(name: str) -> LossFn:
    return LOSSES.get(name.strip().lower().replace("-", "_"), LOSSES[DEFAULT_LOSS])


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.pow(torch.tensor(gamma), -(k - 1).clamp(min=0))
    w[0] = 0.0
    return w


# ----------------------------------------------------------------------------- synthetic target
class SyntheticTarget(nn.Module):
    """Embedding, residual causal-mixing layers, final RMSNorm, lm_head. Frozen, random."""

    def __init__(self, c: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.mix = nn.ModuleList(nn.Linear(2 * c.hidden, c.hidden) for _ in range(c.num_layers))
        self.norm = nn.RMSNorm(c.hidden, eps=1e-6)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        self.requires_grad_(False)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        h = self.embed_tokens(ids)
        states = [h]
        steps = torch.arange(1, ids.shape[1] + 1, dtype=torch.float32)[None, :, None]
        for layer in self.mix:
            running = h.cumsum(1) / steps                      # causal summary of the prefix
            h = h + torch.tanh(layer(torch.cat([h, running], -1)))
            states.append(h)
        return states, self.lm_head(self.norm(h))


def tap_ids(num_layers: int, k: int) -> list[int]:
    return [num_layers // 2] if k == 1 else [round(1 + i * (num_layers - 4) / (k - 1)) for i in range(k)]


# ----------------------------------------------------------------------------- drafter
class Attn(nn.Module):
    def __init__(self, h: int, d: DraftConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = d.heads, d.kv_heads, h // d.heads
        self.q, self.k = nn.Linear(h, h, bias=False), nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v, self.o = nn.Linear(h, self.nkv * self.hd, bias=False), nn.Linear(h, h, bias=False)
        self.qn, self.kn = nn.RMSNorm(self.hd, eps=1e-6), nn.RMSNorm(self.hd, eps=1e-6)

    @staticmethod
    def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x (b, h, P, D), pos (b, P)
        d = x.shape[-1]
        freq = pos[:, None, :, None].float() * 10000.0 ** (-torch.arange(0, d, 2).float() / d)
        cos, sin = freq.cos().repeat(1, 1, 1, 2), freq.sin().repeat(1, 1, 1, 2)
        return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin

    def forward(self, x, ctx, q_pos, kv_pos, allow):
        b, q_len, _ = x.shape
        q = self.qn(self.q(x).view(b, q_len, self.nh, self.hd)).transpose(1, 2)
        src = torch.cat([ctx, x], 1)
        k = self.kn(self.k(src).view(b, src.shape[1], self.nkv, self.hd)).transpose(1, 2)
        v = self.v(src).view(b, src.shape[1], self.nkv, self.hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(self.rope(q, q_pos), self.rope(k, kv_pos), v, attn_mask=allow,
                                             enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, q_len, -1))


class Block(nn.Module):
    def __init__(self, h: int, d: DraftConfig):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(h, eps=1e-6), nn.RMSNorm(h, eps=1e-6)
        self.attn = Attn(h, d)
        self.up, self.gate, self.down = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, 3 * h, bias=False), \
            nn.Linear(3 * h, h, bias=False)

    def forward(self, x, ctx, q_pos, kv_pos, allow):
        x = x + self.attn(self.n1(x), ctx, q_pos, kv_pos, allow)
        y = self.n2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Drafter(nn.Module):
    def __init__(self, h: int, d: DraftConfig):
        super().__init__()
        self.fc = nn.Linear(d.num_taps * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=1e-6)
        self.blocks = nn.ModuleList(Block(h, d) for _ in range(d.num_layers))
        self.norm = nn.RMSNorm(h, eps=1e-6)

    def forward(self, x, feats, q_pos, kv_pos, allow):
        ctx = self.hidden_norm(self.fc(feats))
        for blk in self.blocks:
            x = blk(x, ctx, q_pos, kv_pos, allow)
        return self.norm(x)


# ----------------------------------------------------------------------------- one step
def sample_anchors(loss_mask: torch.Tensor, b: int, n: int, gen) -> torch.Tensor:
    ok = loss_mask.bool().clone()
    ok[:, -b:] = False
    if int(ok.sum(1).min()) < n:
        raise ValueError(f"every row needs at least {n} anchor candidates")
    scores = torch.rand(ok.shape, generator=gen).masked_fill(~ok, 2.0)
    return scores.argsort(dim=1)[:, :n].sort(dim=1).values


def step_loss(cfg: TrainConfig, target, drafter, ids, loss_mask, gen) -> torch.Tensor:
    d, b = cfg.draft, cfg.draft.block_size
    states, logits = target(ids)
    taps = tap_ids(cfg.target.num_layers, d.num_taps)
    feats = torch.cat([states[i + 1] for i in taps], -1)
    bsz, t = ids.shape
    anchors = sample_anchors(loss_mask, b, cfg.max_anchors, gen)            # (bsz, n)
    n = anchors.shape[1]
    slot = torch.arange(b)
    block = torch.full((bsz, n, b), d.mask_token_id)
    block[..., 0] = ids.gather(1, anchors)
    q_pos = (anchors[..., None] + slot).flatten(1)                         # (bsz, n*B)
    kv_pos = torch.cat([torch.arange(t).expand(bsz, t), q_pos], 1)
    q_anchor = anchors.repeat_interleave(b, dim=1)
    q_blk = torch.arange(n * b) // b
    allow = torch.cat([torch.arange(t)[None, None] < q_anchor[..., None],
                       (q_blk[:, None] == q_blk[None]).expand(bsz, -1, -1)], -1)[:, None]
    hidden = drafter(target.embed_tokens(block.flatten(1)), feats, q_pos, kv_pos, allow)
    draft_logits = target.lm_head(hidden).view(bsz, n, b, -1)
    src = (anchors[..., None] + slot - 1).clamp(min=0)                      # target position predicting slot j
    teacher = logits.gather(1, src.flatten(1)[..., None].expand(-1, -1, logits.shape[-1])).view_as(draft_logits)
    label_pos = (anchors[..., None] + slot).clamp(max=t - 1)
    weight = loss_mask.gather(1, label_pos.flatten(1)).view(bsz, n, b) * decay_weights(b, cfg.loss.gamma)
    per_slot = get_loss(cfg.loss.name)(draft_logits, teacher)
    return (per_slot * weight).sum() / weight.sum()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default="run_out")
    args = ap.parse_args()
    cfg = TrainConfig()
    cfg.steps = args.steps if args.steps is not None else cfg.steps
    cfg.seed = args.seed if args.seed is not None else cfg.seed
    torch.manual_seed(1000)
    target = SyntheticTarget(cfg.target)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    drafter = Drafter(cfg.target.hidden, cfg.draft)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr)
    ids = torch.randint(0, cfg.draft.mask_token_id, (16, cfg.seq_len), generator=gen)
    loss_mask = torch.zeros(ids.shape)
    loss_mask[:, cfg.prompt_len:] = 1
    for step in range(cfg.steps):
        rows = torch.randperm(ids.shape[0], generator=gen)[: cfg.batch]
        loss = step_loss(cfg, target, drafter, ids[rows], loss_mask[rows], gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.8f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({**asdict(cfg), "target_layer_ids": tap_ids(cfg.target.num_layers, cfg.draft.num_taps)}, f,
                  indent=2)
    torch.save({"state_dict": drafter.state_dict(), "config": asdict(cfg)}, os.path.join(args.out, "drafter.pt"))


if __name__ == "__main__":
    main()
