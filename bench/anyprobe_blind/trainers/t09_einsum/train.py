"""DFlash drafter with attention written out in einsum (no SDPA), GQA by grouping query heads.

    python train.py --steps 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

C = dict(target_layers=10, taps=3, d_model=32, n_q=4, n_kv=2, vocab=96, mask_id=95, n_layers=2, block=6,
         gamma=7.0, max_anchors=6, seq_len=48, prompt=10, samples=6, batch=2, lr=2e-3, theta=10000.0)


def tap_layers(n: int, k: int) -> list[int]:
    return [n // 2] if k == 1 else [int(round(1 + i * (n - 4) / (k - 1))) for i in range(k)]


def rmsnorm(x, g):
    return g * x * torch.rsqrt(torch.einsum("...d,...d->...", x, x)[..., None] / x.shape[-1] + 1e-6)


def rotary(x, pos):
    """x (b, h, P, d); pos (b, P)."""
    d = x.shape[-1]
    inv = C["theta"] ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.einsum("bp,f->bpf", pos.float(), inv)[:, None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


class EinsumLayer(nn.Module):
    def __init__(self):
        super().__init__()
        d, hq, hk = C["d_model"], C["n_q"], C["n_kv"]
        hd = d // hq
        self.hd = hd
        self.Wq = nn.Parameter(torch.randn(hq, hd, d) / math.sqrt(d))
        self.Wk = nn.Parameter(torch.randn(hk, hd, d) / math.sqrt(d))
        self.Wv = nn.Parameter(torch.randn(hk, hd, d) / math.sqrt(d))
        self.Wo = nn.Parameter(torch.randn(d, hq, hd) / math.sqrt(d))
        self.W1 = nn.Parameter(torch.randn(2, 2 * d, d) / math.sqrt(d))
        self.W2 = nn.Parameter(torch.randn(d, 2 * d) / math.sqrt(2 * d))
        self.g_attn, self.g_mlp = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.g_q, self.g_k = nn.Parameter(torch.ones(hd)), nn.Parameter(torch.ones(hd))

    def forward(self, x, ctx, q_pos, kv_pos, bias):
        """x (b, Q, d) block stream; ctx (b, T, d) fused context; bias (b, Q, T+Q) additive."""
        h = rmsnorm(x, self.g_attn)
        src = torch.cat([ctx, h], 1)
        q = rotary(rmsnorm(torch.einsum("bqd,hed->bhqe", h, self.Wq), self.g_q), q_pos)
        k = rotary(rmsnorm(torch.einsum("bkd,hed->bhke", src, self.Wk), self.g_k), kv_pos)
        v = torch.einsum("bkd,hed->bhke", src, self.Wv)
        b, hq, qn, e = q.shape
        hk = k.shape[1]
        qg = q.view(b, hk, hq // hk, qn, e)                          # query heads grouped by kv head
        s = torch.einsum("bgrqe,bgke->bgrqk", qg, k) / math.sqrt(e) + bias[:, None, None]
        o = torch.einsum("bgrqk,bgke->bgrqe", s.softmax(-1), v).reshape(b, hq, qn, e)
        x = x + torch.einsum("bhqe,dhe->bqd", o, self.Wo)
        h = rmsnorm(x, self.g_mlp)
        gate, up = torch.einsum("bqd,cfd->cbqf", h, self.W1)
        return x + torch.einsum("bqf,df->bqd", F.silu(gate) * up, self.W2)


class EinsumDrafter(nn.Module):
    def __init__(self, num_taps: int):
        super().__init__()
        d = C["d_model"]
        self.fc = nn.Parameter(torch.randn(d, num_taps * d) / math.sqrt(num_taps * d))
        self.g_ctx, self.g_out = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.layers = nn.ModuleList(EinsumLayer() for _ in range(C["n_layers"]))

    def forward(self, x, feats, q_pos, kv_pos, bias):
        ctx = rmsnorm(torch.einsum("btf,df->btd", feats, self.fc), self.g_ctx)
        for layer in self.layers:
            x = layer(x, ctx, q_pos, kv_pos, bias)
        return rmsnorm(x, self.g_out)


def block_bias(anchors: torch.Tensor, t: int, b: int) -> torch.Tensor:
    """(bsz, n*B, T+n*B) additive bias: context strictly before the anchor, plus the query's own block."""
    bsz, n = anchors.shape
    qa = anchors.repeat_interleave(b, 1)
    ctx_ok = torch.arange(t)[None, None] < qa[..., None]
    blk_ok = torch.block_diag(*[torch.ones(b, b).tril()] * n).bool().expand(bsz, -1, -1)
    ok = torch.cat([ctx_ok, blk_ok], -1)
    return torch.zeros(ok.shape).masked_fill(~ok, float("-inf"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="run_out")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "t09_einsum"))
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    d = C["d_model"]
    tdir = os.path.join(args.workdir, "target")
    if not os.path.exists(os.path.join(tdir, "config.json")):
        torch.manual_seed(5555)
        Qwen3ForCausalLM(Qwen3Config(hidden_size=d, intermediate_size=2 * d, num_attention_heads=C["n_q"],
                                     num_key_value_heads=C["n_kv"], head_dim=d // C["n_q"],
                                     num_hidden_layers=C["target_layers"], vocab_size=C["vocab"],
                                     max_position_embeddings=256, tie_word_embeddings=False)).save_pretrained(tdir)
        torch.manual_seed(args.seed)
    target = Qwen3ForCausalLM.from_pretrained(tdir, torch_dtype=torch.float32).eval().requires_grad_(False)
    taps = tap_layers(C["target_layers"], C["taps"])
    with torch.no_grad():
        prompts = torch.randint(0, C["mask_id"], (C["samples"], C["prompt"]), generator=gen)
        new = C["seq_len"] - C["prompt"]
        ids = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0)[:, : C["seq_len"]]
        out = target(ids, output_hidden_states=True)
        feats = torch.stack([out.hidden_states[i + 1] for i in taps], dim=-1).flatten(-2)   # (N, T, k*d)
        teacher = out.logits.argmax(-1)
    n_rows, t = ids.shape
    loss_mask = torch.zeros(n_rows, t)
    loss_mask[:, C["prompt"]:] = 1
    b = C["block"]
    slot = torch.arange(b)
    w_slot = torch.exp(-(slot - 1).clamp(min=0) / C["gamma"]) * (slot >= 1)
    drafter = EinsumDrafter(len(taps))
    opt = torch.optim.AdamW(drafter.parameters(), lr=C["lr"])
    E, W_out = target.model.embed_tokens.weight, target.lm_head.weight
    for step in range(args.steps):
        rows = torch.randperm(n_rows, generator=gen)[: C["batch"]]
        ok = loss_mask[rows].bool()
        ok[:, -b:] = False
        anchors = torch.stack([r.nonzero().squeeze(-1)[torch.randperm(int(r.sum()), generator=gen)[: C["max_anchors"]]]
                               .sort().values for r in ok])
        bsz, n = anchors.shape
        tok = torch.full((bsz, n, b), C["mask_id"])
        tok[..., 0] = ids[rows].gather(1, anchors)
        pos = anchors[..., None] + slot
        q_pos = pos.flatten(1)
        kv_pos = torch.cat([torch.arange(t).expand(bsz, t), q_pos], 1)
        hidden = drafter(E[tok.flatten(1)], feats[rows], q_pos, kv_pos, block_bias(anchors, t, b))
        logits = torch.einsum("bqd,vd->bqv", hidden, W_out).view(bsz, n, b, -1)
        labels = teacher[rows].gather(1, (q_pos - 1).clamp(min=0)).view(bsz, n, b)
        w = w_slot * loss_mask[rows].gather(1, q_pos.clamp(max=t - 1)).view(bsz, n, b) * (pos < t)
        logp = logits.log_softmax(-1)
        nll = -torch.einsum("bnsv,bnsv->bns", logp, F.one_hot(labels, logits.shape[-1]).float())
        loss = torch.einsum("bns,bns->", nll, w) / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.8f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({**C, "target_layer_ids": taps, "seed": args.seed}, f, indent=2)
    torch.save(drafter.state_dict(), os.path.join(args.out, "drafter.pt"))


if __name__ == "__main__":
    main()
