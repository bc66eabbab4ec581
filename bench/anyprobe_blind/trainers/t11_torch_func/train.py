"""DFlash drafter trained functionally: torch.func.functional_call + grad_and_value over a parameter dict,
and a hand-written AdamW over that dict. The drafter reads a single target layer (k = 1).

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
from torch.func import functional_call, grad_and_value
from transformers import Qwen3Config, Qwen3ForCausalLM

CFG = {"target_layers": 8, "num_taps": 1, "hidden": 32, "vocab": 96, "mask_token_id": 95, "draft_layers": 2,
       "block_size": 4, "gamma": 7.0, "max_anchors": 6, "seq_len": 36, "prompt_len": 6, "samples": 6,
       "batch": 2, "lr": 3e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def rope_tables(pos: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    ang = pos.float()[:, None] * (10000.0 ** (-torch.arange(0, d, 2).float() / d))[None]
    return torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)


def apply_rope(x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # x (h, P, d)
    d = x.shape[-1]
    return x * cs[0] + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * cs[1]


class Norm(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Layer(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.nh, self.nkv, self.hd = 4, 2, h // 4
        self.ln1, self.ln2, self.qn, self.kn = Norm(h), Norm(h), Norm(self.hd), Norm(self.hd)
        self.q = nn.Linear(h, h, bias=False)
        self.k = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.mlp_in = nn.Linear(h, 4 * h, bias=False)
        self.mlp_out = nn.Linear(2 * h, h, bias=False)

    def forward(self, x, ctx, cs_q, cs_kv, allow):
        hx = self.ln1(x)
        kv_in = torch.cat([ctx, hx])
        q = apply_rope(self.qn(self.q(hx).view(-1, self.nh, self.hd)).transpose(0, 1), cs_q)
        k = apply_rope(self.kn(self.k(kv_in).view(-1, self.nkv, self.hd)).transpose(0, 1), cs_kv)
        v = self.v(kv_in).view(-1, self.nkv, self.hd).transpose(0, 1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=allow, enable_gqa=True)
        x = x + self.o(a.transpose(0, 1).reshape(x.shape[0], -1))
        g, u = self.mlp_in(self.ln2(x)).chunk(2, -1)
        return x + self.mlp_out(F.silu(g) * u)


class Drafter(nn.Module):
    def __init__(self, h: int, taps: int, layers: int):
        super().__init__()
        self.fc = nn.Linear(taps * h, h, bias=False)
        self.hidden_norm = Norm(h)
        self.layers = nn.ModuleList(Layer(h) for _ in range(layers))
        self.norm = Norm(h)

    def forward(self, x, feats, q_pos, kv_pos, allow):
        ctx = self.hidden_norm(self.fc(feats))
        hd = self.layers[0].hd
        cs_q, cs_kv = rope_tables(q_pos, hd), rope_tables(kv_pos, hd)
        for layer in self.layers:
            x = layer(x, ctx, cs_q, cs_kv, allow)
        return self.norm(x)


def row_terms(params, drafter, embed, lm_head, ids, loss_mask, feats, anchors):
    b, t, n = CFG["block_size"], ids.numel(), anchors.numel()
    slot = torch.arange(b)
    blk = torch.full((n, b), CFG["mask_token_id"])
    blk[:, 0] = ids[anchors]
    pos = anchors[:, None] + slot                                      # (n, B)
    q_pos = pos.flatten()
    kv_pos = torch.cat([torch.arange(t), q_pos])
    q_anchor = anchors.repeat_interleave(b)
    ctx_ok = (torch.arange(t)[None] - q_anchor[:, None]) < 0           # kv - anchor < 0
    q_blk = torch.arange(n * b) // b
    blk_ok = (q_blk[:, None] - q_blk[None]) == 0
    allow = torch.cat([ctx_ok, blk_ok], 1)
    hidden = functional_call(drafter, params, (embed(blk.flatten()), feats, q_pos, kv_pos, allow))
    logits = lm_head(hidden).view(n, b, -1)
    labels = ids[pos.clamp(max=t - 1)]                                 # slot j learns data token p+j
    w = loss_mask[pos.clamp(max=t - 1)] * (pos < t) * torch.exp(-F.relu(slot - 1.0) / CFG["gamma"])
    w[:, 0] = 0.0
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(n, b)
    return (ce * w).sum(), w.sum()


def adamw_update(params, grads, state, step):
    b1, b2 = CFG["betas"]
    out = {}
    for name, p in params.items():
        g = grads[name]
        m, v = state.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        state[name] = (m, v)
        m_hat, v_hat = m / (1 - b1 ** step), v / (1 - b2 ** step)
        out[name] = p * (1 - CFG["lr"] * CFG["weight_decay"]) - CFG["lr"] * m_hat / (v_hat.sqrt() + CFG["eps"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="run_out")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "t11_torch_func"))
    args = ap.parse_args()
    c = CFG
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    tdir = os.path.join(args.workdir, "target")
    if not os.path.exists(os.path.join(tdir, "config.json")):
        torch.manual_seed(3141)
        Qwen3ForCausalLM(Qwen3Config(hidden_size=c["hidden"], intermediate_size=2 * c["hidden"],
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=c["hidden"] // 4,
                                     num_hidden_layers=c["target_layers"], vocab_size=c["vocab"],
                                     max_position_embeddings=256, tie_word_embeddings=False)).save_pretrained(tdir)
        torch.manual_seed(args.seed)
    target = Qwen3ForCausalLM.from_pretrained(tdir, torch_dtype=torch.float32).eval().requires_grad_(False)
    n_l, k = c["target_layers"], c["num_taps"]
    taps = [n_l // 2] if k == 1 else [int(round(1 + i * (n_l - 4) / (k - 1))) for i in range(k)]
    with torch.no_grad():
        p = torch.randint(0, c["mask_token_id"], (c["samples"], c["prompt_len"]), generator=gen)
        new = c["seq_len"] - c["prompt_len"]
        ids = target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0)[:, : c["seq_len"]]
        hs = target(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in taps], -1)
    loss_mask = torch.zeros(ids.shape)
    loss_mask[:, c["prompt_len"]:] = 1
    drafter = Drafter(c["hidden"], len(taps), c["draft_layers"])
    params = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    embed, lm_head = target.model.embed_tokens, target.lm_head
    state: dict = {}

    def batch_loss(prm, rows, anchor_sets):
        num = den = torch.zeros(())
        for r, a in zip(rows, anchor_sets):
            n_, d_ = row_terms(prm, drafter, embed, lm_head, ids[r], loss_mask[r], feats[r], a)
            num, den = num + n_, den + d_
        return num / den

    for step in range(1, args.steps + 1):
        rows = torch.randperm(ids.shape[0], generator=gen)[: c["batch"]].tolist()
        anchor_sets = []
        for r in rows:
            ok = loss_mask[r].bool().clone()
            ok[-c["block_size"]:] = False
            cand = ok.nonzero().squeeze(-1)
            anchor_sets.append(cand[torch.randperm(cand.numel(), generator=gen)[: c["max_anchors"]]].sort().values)
        grads, loss = grad_and_value(batch_loss)(params, rows, anchor_sets)
        params = adamw_update(params, grads, state, step)
        print(f"step {step - 1} loss {loss.item():.8f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({**c, "target_layer_ids": taps, "seed": args.seed}, f, indent=2)
    torch.save(params, os.path.join(args.out, "drafter.pt"))


if __name__ == "__main__":
    main()
