"""DFlash drafter over a packed variable-length token stream (cu_seqlens offsets, no padding, no batch dim).

Documents are concatenated into one stream per step. Attention runs per segment, flash-attn varlen style:
each anchored block is a query segment, its key segment is its document's context before the anchor
followed by the block's own tokens, so no dense mask is ever built.

    python train.py --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

HP = dict(target_layers=8, num_taps=2, hidden=32, n_heads=4, n_kv=2, vocab=96, mask_id=95, draft_layers=2,
          block=5, gamma=4.0, max_anchors=10, doc_lens=[(18, 26, 22), (30, 24, 14)], prompt=5, lr=3e-3)


def tiny_qwen3(num_layers: int) -> Qwen3Config:
    h = HP["hidden"]
    return Qwen3Config(hidden_size=h, intermediate_size=2 * h, num_attention_heads=HP["n_heads"],
                       num_key_value_heads=HP["n_kv"], head_dim=h // HP["n_heads"], num_hidden_layers=num_layers,
                       vocab_size=HP["vocab"], max_position_embeddings=512, tie_word_embeddings=False)


def layer_rule(n: int, k: int) -> list[int]:
    return [n // 2] if k == 1 else [int(round(1 + i * (n - 4) / (k - 1))) for i in range(k)]


@torch.no_grad()
def build_stream(target, lens, taps, gen) -> dict:
    """One packed stream: token ids, loss mask, fused features, and cu_seqlens over its documents."""
    ids, mask, feats = [], [], []
    for n in lens:
        prompt = torch.randint(0, HP["mask_id"], (1, HP["prompt"]), generator=gen)
        doc = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n - HP["prompt"],
                              min_new_tokens=n - HP["prompt"], do_sample=False, pad_token_id=0)[0, :n]
        hs = target(doc[None], output_hidden_states=True).hidden_states
        ids.append(doc)
        m = torch.zeros(n)
        m[HP["prompt"]:] = 1
        mask.append(m)
        feats.append(torch.cat([hs[i + 1][0] for i in taps], -1))
    cu = torch.tensor([0] + list(lens)).cumsum(0)
    return {"ids": torch.cat(ids), "loss_mask": torch.cat(mask), "feats": torch.cat(feats), "cu": cu}


def rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, pos, theta=10000.0):  # x (P, heads, D), pos (P,)
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2).float() / d)
    f = pos.float()[:, None] * inv
    cos, sin = torch.cat([f.cos(), f.cos()], -1)[:, None], torch.cat([f.sin(), f.sin()], -1)[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


class Layer(nn.Module):
    def __init__(self, h, nh, nkv):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, h // nh
        self.ln1, self.ln2 = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.qn, self.kn = nn.Parameter(torch.ones(self.hd)), nn.Parameter(torch.ones(self.hd))
        self.wq = nn.Linear(h, nh * self.hd, bias=False)
        self.wk = nn.Linear(h, nkv * self.hd, bias=False)
        self.wv = nn.Linear(h, nkv * self.hd, bias=False)
        self.wo = nn.Linear(nh * self.hd, h, bias=False)
        self.w1, self.w3 = nn.Linear(h, 2 * h, bias=False), nn.Linear(h, 2 * h, bias=False)
        self.w2 = nn.Linear(2 * h, h, bias=False)

    def forward(self, x, ctx, segs):
        """x (nB, H) block stream; ctx (Ttot, H) fused context stream; segs: per block (ctx slice, blk slice,
        q positions, kv positions)."""
        hx = rms(x, self.ln1)
        q = rms(self.wq(hx).view(-1, self.nh, self.hd), self.qn)
        k_ctx = rms(self.wk(ctx).view(-1, self.nkv, self.hd), self.kn)
        k_blk = rms(self.wk(hx).view(-1, self.nkv, self.hd), self.kn)
        v_ctx, v_blk = self.wv(ctx).view(-1, self.nkv, self.hd), self.wv(hx).view(-1, self.nkv, self.hd)
        outs = []
        for ctx_sl, blk_sl, q_sl, q_pos, kv_pos in segs:
            qi = rope(q[q_sl], q_pos).transpose(0, 1)                             # (nh, B, D)
            ki = rope(torch.cat([k_ctx[ctx_sl], k_blk[blk_sl]]), kv_pos).transpose(0, 1)
            vi = torch.cat([v_ctx[ctx_sl], v_blk[blk_sl]]).transpose(0, 1)
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True).transpose(0, 1))
        x = x + self.wo(torch.cat(outs).reshape(x.shape[0], -1))
        hx = rms(x, self.ln2)
        return x + self.w2(F.silu(self.w1(hx)) * self.w3(hx))


class Drafter(nn.Module):
    def __init__(self, num_taps: int):
        super().__init__()
        h = HP["hidden"]
        self.fc = nn.Linear(num_taps * h, h, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.layers = nn.ModuleList(Layer(h, HP["n_heads"], HP["n_kv"]) for _ in range(HP["draft_layers"]))
        self.norm = nn.Parameter(torch.ones(h))

    def forward(self, x, feats, segs):
        ctx = rms(self.fc(feats), self.hidden_norm)
        for layer in self.layers:
            x = layer(x, ctx, segs)
        return rms(x, self.norm)


def anchors_for(stream: dict, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to max_anchors per packed stream; supervised, not in the stream's last B positions; sorted."""
    ok = stream["loss_mask"].bool().clone()
    ok[-HP["block"]:] = False
    cand = ok.nonzero().squeeze(-1)
    a = cand[torch.randperm(cand.numel(), generator=gen)[: HP["max_anchors"]]].sort().values
    doc = torch.searchsorted(stream["cu"], a, right=True) - 1
    return a, doc


def segments(stream: dict, anchors: torch.Tensor, doc: torch.Tensor) -> list[tuple]:
    """Per block: (context slice of the stream, key slice of the block stream, query slice, q positions,
    kv positions). Context positions restart at every document."""
    b, cu = HP["block"], stream["cu"]
    cu_blk = torch.arange(anchors.numel() + 1) * b
    blk_pos = (anchors[:, None] + torch.arange(b)).reshape(-1)      # position of every block slot
    out = []
    for i in range(anchors.numel()):
        a, start = int(anchors[i]), int(cu[int(doc[i])])
        lo, hi = int(cu_blk[i]), int(cu_blk[i + 1])
        blk_sl = slice(lo, hi + 1)
        ctx_pos = torch.arange(a - start)
        out.append((slice(start, a), blk_sl, slice(lo, hi), blk_pos[lo:hi], torch.cat([ctx_pos, blk_pos[blk_sl]])))
    return out


def stream_loss(drafter, embed, lm_head, stream: dict, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, total = HP["block"], stream["ids"].numel()
    anchors, doc = anchors_for(stream, gen)
    n = anchors.numel()
    blk_ids = torch.full((n, b), HP["mask_id"], dtype=torch.long)
    blk_ids[:, 0] = stream["ids"][anchors]
    hidden = drafter(embed(blk_ids.view(-1)), stream["feats"], segments(stream, anchors, doc))
    logits = lm_head(hidden).view(n, b, -1)
    at = anchors[:, None] + torch.arange(b)                         # stream index of each slot's label
    inside = at < stream["cu"][doc + 1][:, None]                    # the label belongs to the same document
    at = at.clamp(max=total - 1)
    labels = stream["ids"][at]
    w = inside.float() * stream["loss_mask"][at]
    w[:, 0] = 0.0
    w = w * torch.exp(-(torch.arange(b) - 1).clamp(min=0) / HP["gamma"])
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(n, b)
    hits = ((logits.argmax(-1) == labels).float() * (w > 0)).sum() / (w > 0).sum().clamp(min=1)
    return (ce * w).sum(), w.sum(), hits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="run_out")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "t04_varlen_stream"))
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    tdir = os.path.join(args.workdir, "target")
    if not os.path.exists(os.path.join(tdir, "config.json")):
        torch.manual_seed(99)
        Qwen3ForCausalLM(tiny_qwen3(HP["target_layers"])).save_pretrained(tdir)
        torch.manual_seed(args.seed)
    target = Qwen3ForCausalLM.from_pretrained(tdir, torch_dtype=torch.float32).eval().requires_grad_(False)
    taps = layer_rule(HP["target_layers"], HP["num_taps"])
    streams = [build_stream(target, lens, taps, gen) for lens in HP["doc_lens"]]
    drafter = Drafter(len(taps))
    opt = torch.optim.AdamW(drafter.parameters(), lr=HP["lr"], betas=(0.9, 0.95))
    for step in range(args.steps):
        num, den, acc = torch.zeros(()), torch.zeros(()), 0.0
        for stream in streams:
            a, b_, h = stream_loss(drafter, target.model.embed_tokens, target.lm_head, stream, gen)
            num, den, acc = num + a, den + b_, acc + float(h) / len(streams)
        loss = num / den
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.8f} acc {acc:.4f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({**HP, "target_layer_ids": taps, "seed": args.seed, "steps": args.steps}, f, indent=2)
    torch.save(drafter.state_dict(), os.path.join(args.out, "drafter.pt"))


if __name__ == "__main__":
    main()
