"""DFlash drafter training in two phases: `prepare` runs the target once and caches what training needs
(tap features and the target's top-1 token per position); `train` reads only the cache.

    python train.py prepare && python train.py train --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM


@dataclass(frozen=True)
class DrafterConfig:
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    layers: int = 1
    num_taps: int = 5
    vocab: int = 96
    norm_context: bool = False
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class RunConfig:
    target_layers: int = 12
    block_size: int = 4
    gamma: float = 4.0
    max_anchors: int = 8
    mask_token_id: int = 95
    seq_len: int = 40
    prompt_len: int = 8
    samples: int = 8
    batch: int = 2
    lr: float = 3e-3


WORK = os.path.join(tempfile.gettempdir(), "t08_prepare_cache")


def tap_layers(num_layers: int, k: int) -> list[int]:
    return [num_layers // 2] if k == 1 else [int(round(1 + i * (num_layers - 4) / (k - 1))) for i in range(k)]


# --------------------------------------------------------------------------- phase 1: prepare
@torch.no_grad()
def prepare(run: RunConfig, dcfg: DrafterConfig, cache_path: str, seed: int) -> None:
    tdir = os.path.join(WORK, "target")
    if not os.path.exists(os.path.join(tdir, "config.json")):
        torch.manual_seed(8642)
        Qwen3ForCausalLM(Qwen3Config(hidden_size=dcfg.hidden, intermediate_size=2 * dcfg.hidden,
                                     num_attention_heads=dcfg.heads, num_key_value_heads=dcfg.kv_heads,
                                     head_dim=dcfg.hidden // dcfg.heads, num_hidden_layers=run.target_layers,
                                     vocab_size=dcfg.vocab, max_position_embeddings=256,
                                     tie_word_embeddings=False)).save_pretrained(tdir)
    target = Qwen3ForCausalLM.from_pretrained(tdir, torch_dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, run.mask_token_id, (run.samples, run.prompt_len), generator=gen)
    new = run.seq_len - run.prompt_len
    ids = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=0)[:, : run.seq_len]
    taps = tap_layers(run.target_layers, dcfg.num_taps)
    hs = target.model(ids, output_hidden_states=True).hidden_states
    last = hs[target.config.num_hidden_layers - 1]
    teacher = target.lm_head(target.model.norm(last)).argmax(-1)           # (N, T) top-1 per position
    loss_mask = torch.zeros(ids.shape)
    loss_mask[:, run.prompt_len:] = 1
    torch.save({
        "input_ids": ids, "loss_mask": loss_mask, "teacher_top1": teacher,
        "features": torch.cat([hs[i + 1] for i in taps], -1).half(),
        "embed": target.model.embed_tokens.weight.detach().clone(),
        "lm_head": target.lm_head.weight.detach().clone(),
        "meta": {"target_layer_ids": taps, "target_path": tdir, "run": asdict(run)},
    }, cache_path)
    print(f"cached {ids.shape[0]} samples, taps {taps} -> {cache_path}")


# --------------------------------------------------------------------------- the drafter
class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class DraftBlock(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c, self.hd = c, c.hidden // c.heads
        self.pre, self.post = RMSNorm(c.hidden), RMSNorm(c.hidden)
        self.wq = nn.Linear(c.hidden, c.heads * self.hd, bias=False)
        self.wkv = nn.Linear(c.hidden, 2 * c.kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(c.heads * self.hd, c.hidden, bias=False)
        self.qn, self.kn = RMSNorm(self.hd), RMSNorm(self.hd)
        self.ffn = nn.Sequential(nn.Linear(c.hidden, 3 * c.hidden, bias=False), nn.SiLU(),
                                 nn.Linear(3 * c.hidden, c.hidden, bias=False))

    def rope(self, x, pos):  # x (b, P, h, D)
        d = x.shape[-1]
        ang = pos[..., None].float() * self.c.rope_theta ** (-torch.arange(0, d, 2).float() / d)
        cos, sin = ang.cos().repeat(1, 1, 2)[:, :, None], ang.sin().repeat(1, 1, 2)[:, :, None]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin

    def forward(self, x, ctx, q_pos, kv_pos, allow):
        c, b, q_len = self.c, x.shape[0], x.shape[1]
        hx = self.pre(x)
        q = self.rope(self.qn(self.wq(hx).view(b, q_len, c.heads, self.hd)), q_pos)
        k, v = self.wkv(torch.cat([ctx, hx], 1)).view(b, -1, 2, c.kv_heads, self.hd).unbind(2)
        k = self.rope(self.kn(k), kv_pos)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=allow, enable_gqa=True)
        x = x + self.wo(out.transpose(1, 2).reshape(b, q_len, -1))
        return x + self.ffn(self.post(x))


class Drafter(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.fc = nn.Linear(c.num_taps * c.hidden, c.hidden, bias=False)
        self.hidden_norm = RMSNorm(c.hidden)
        self.blocks = nn.ModuleList(DraftBlock(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)

    def forward(self, x, feats, q_pos, kv_pos, allow):
        ctx = self.fc(feats)
        if self.c.norm_context:
            ctx = self.hidden_norm(ctx)
        for blk in self.blocks:
            x = blk(x, ctx, q_pos, kv_pos, allow)
        return self.norm(x)


# --------------------------------------------------------------------------- phase 2: train
def train(run: RunConfig, dcfg: DrafterConfig, cache_path: str, steps: int, seed: int, out: str) -> None:
    cache = torch.load(cache_path)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    embed = nn.Embedding.from_pretrained(cache["embed"], freeze=True)
    lm_head = nn.Linear(dcfg.hidden, dcfg.vocab, bias=False).requires_grad_(False)
    lm_head.weight.data.copy_(cache["lm_head"])
    drafter = Drafter(dcfg)
    opt = torch.optim.AdamW(drafter.parameters(), lr=run.lr)
    ids, mask, teacher = cache["input_ids"], cache["loss_mask"], cache["teacher_top1"]
    feats = cache["features"].float()
    n_rows, t = ids.shape
    b, slot = run.block_size, torch.arange(run.block_size)
    w_slot = torch.where(slot > 0, torch.exp(-(slot - 1).float() / run.gamma), torch.zeros(()))
    for step in range(steps):
        rows = torch.randperm(n_rows, generator=gen)[: run.batch]
        cand_ok = mask[rows].bool()
        cand_ok[:, -b:] = False
        anchors = torch.stack([
            c.nonzero().squeeze(-1)[torch.randperm(int(c.sum()), generator=gen)[: run.max_anchors]].sort().values
            for c in cand_ok])                                               # (bsz, n)
        bsz, n = anchors.shape
        blk = torch.full((bsz, n, b), run.mask_token_id)
        blk[..., 0] = ids[rows].gather(1, anchors)
        pos = anchors[..., None] + slot                                      # (bsz, n, B)
        q_pos = pos.flatten(1)
        kv_pos = torch.cat([torch.arange(t).expand(bsz, t), q_pos], 1)
        q_anchor = anchors.repeat_interleave(b, 1)
        q_block = torch.arange(n * b) // b
        allow = torch.cat([torch.arange(t)[None, None] < q_anchor[..., None],
                           (q_block[:, None] == q_block[None]).expand(bsz, -1, -1)], -1)[:, None]
        hidden = drafter(embed(blk.flatten(1)), feats[rows], q_pos, kv_pos, allow)
        logits = lm_head(hidden).view(bsz, n, b, -1)
        labels = teacher[rows].gather(1, (q_pos - 1).clamp(min=0)).view(bsz, n, b)
        valid = (pos < t) * mask[rows].gather(1, q_pos.clamp(max=t - 1)).view(bsz, n, b)
        w = valid * w_slot
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(bsz, n, b)
        loss = (ce * w).sum() / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.8f}", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"drafter": asdict(dcfg), "run": asdict(run), **cache["meta"]}, f, indent=2)
    torch.save(drafter.state_dict(), os.path.join(out, "drafter.pt"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["prepare", "train"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=os.path.join(WORK, "cache.pt"))
    ap.add_argument("--out", default="run_out")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.cache), exist_ok=True)
    run, dcfg = RunConfig(), DrafterConfig()
    if args.phase == "prepare":
        prepare(run, dcfg, args.cache, args.seed)
    else:
        train(run, dcfg, args.cache, args.steps, args.seed, args.out)


if __name__ == "__main__":
    main()
