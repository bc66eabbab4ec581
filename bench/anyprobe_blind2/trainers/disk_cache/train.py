#!/usr/bin/env python
"""DFlash drafter trainer in two phases with an on-disk feature cache.

Phase "cache": run the frozen target over every batch once and save what training needs
(tapped hidden states, the target's next-token choices, ids, loss mask) as one .pt file
per batch under <out>/cache/.  Phase "train": the target is gone; the drafter trains from
the .pt files.  The drafter layers treat the projected context like a KV cache: the
context keys/values are computed once per layer and the block's keys/values are
concatenated after them.
"""
import argparse
import glob
import json
import math
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(1)

DEFAULTS = dict(target_layers=8, hidden=32, vocab=128, n_taps=5, block_size=4, gamma=5.0,
                draft_layers=1, max_anchors=5, n_batches=2, batch=2, seq_len=34, lr=3e-3, steps=2,
                out="run_out")


# ------------------------------------------------------------------ phase 1: cache
def taps_for(L, k):
    return [L // 2] if k == 1 else [round(1 + i * (L - 4) / (k - 1)) for i in range(k)]


def build_target(cfg, root):
    c = Qwen3Config(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=2 * cfg["hidden"],
                    num_hidden_layers=cfg["target_layers"], num_attention_heads=4, num_key_value_heads=1,
                    head_dim=cfg["hidden"] // 4, max_position_embeddings=128, tie_word_embeddings=False)
    path = os.path.join(root, "target_ckpt")
    Qwen3ForCausalLM(c).save_pretrained(path)
    return path


@torch.no_grad()
def write_cache(cfg, target_path, cache_dir):
    target = Qwen3ForCausalLM.from_pretrained(target_path).eval()
    L = target.config.num_hidden_layers
    ids_ = cfg["target_layer_ids"]
    g = torch.Generator().manual_seed(123)
    os.makedirs(cache_dir, exist_ok=True)
    for n in range(cfg["n_batches"]):
        ids = torch.randint(0, cfg["mask_token_id"], (cfg["batch"], cfg["seq_len"]), generator=g)
        plen = torch.randint(4, 9, (cfg["batch"], 1), generator=g)
        sup = torch.arange(cfg["seq_len"])[None] >= plen
        out = target(input_ids=ids, output_hidden_states=True)
        hs = out.hidden_states                                   # L + 1 entries
        taps = torch.cat([hs[i - L] for i in ids_], -1)          # layer i's output
        nxt = torch.roll(out.logits.argmax(-1), shifts=1, dims=1)   # nxt[t] = choice made at t-1
        torch.save(dict(taps=taps, nxt=nxt, ids=ids, sup=sup), os.path.join(cache_dir, f"batch_{n:04d}.pt"))
    return (target.model.embed_tokens.weight.clone(), target.lm_head.weight.clone(),
            float(target.config.rope_parameters["rope_theta"]), target.config)


# ------------------------------------------------------------------ drafter
class RoPE:
    def __init__(self, dim, theta):
        self.inv = theta ** (-torch.arange(0, dim, 2).float() / dim)

    def __call__(self, x, pos):                                   # x [b, h, s, d], pos [b, s]
        f = pos[:, None, :, None].float() * self.inv
        c, s = f.cos(), f.sin()
        a, b = x.chunk(2, -1)                                     # neox halves, as Qwen3 / vLLM
        return torch.cat([a * c - b * s, a * s + b * c], -1)


class CachedContextLayer(nn.Module):
    """Decoder layer whose attention keys = [context cache ; block]."""

    def __init__(self, H, nq, nkv, hd, I, rope):
        super().__init__()
        self.nq, self.nkv, self.hd, self.rope = nq, nkv, hd, rope
        self.ln_in, self.ln_mlp = nn.RMSNorm(H, eps=1e-6), nn.RMSNorm(H, eps=1e-6)
        self.q, self.k, self.v = (nn.Linear(H, n * hd, bias=False) for n in (nq, nkv, nkv))
        self.o = nn.Linear(nq * hd, H, bias=False)
        self.q_norm, self.k_norm = nn.RMSNorm(hd, eps=1e-6), nn.RMSNorm(hd, eps=1e-6)
        self.mlp_in = nn.Linear(H, 2 * I, bias=False)
        self.mlp_out = nn.Linear(I, H, bias=False)

    def split(self, t, n):
        return t.unflatten(-1, (n, self.hd)).transpose(1, 2)

    def kv_cache(self, ctx, ctx_pos):
        k = self.rope(self.k_norm(self.split(self.k(ctx), self.nkv)), ctx_pos)
        return k, self.split(self.v(ctx), self.nkv)

    def forward(self, x, ctx, ctx_pos, blk_pos, allow):
        k_cache, v_cache = self.kv_cache(ctx, ctx_pos)
        h = self.ln_in(x)
        q = self.rope(self.q_norm(self.split(self.q(h), self.nq)), blk_pos)
        k_new = self.rope(self.k_norm(self.split(self.k(h), self.nkv)), blk_pos)
        v_new = self.split(self.v(h), self.nkv)
        k = torch.cat([k_cache, k_new], dim=2)
        v = torch.cat([v_cache, v_new], dim=2)
        k = k.repeat_interleave(self.nq // self.nkv, 1)
        v = v.repeat_interleave(self.nq // self.nkv, 1)
        bias = torch.zeros(allow.shape).masked_fill(~allow, float("-inf"))[:, None]
        p = ((q @ k.transpose(-2, -1)) / math.sqrt(self.hd) + bias).softmax(-1)
        x = x + self.o((p @ v).transpose(1, 2).flatten(2))
        gate, up = self.mlp_in(self.ln_mlp(x)).chunk(2, -1)
        return x + self.mlp_out(F.silu(gate) * up)


class Drafter(nn.Module):
    def __init__(self, tcfg, n_taps, n_layers, embed_w, head_w, theta):
        super().__init__()
        H, hd = tcfg.hidden_size, tcfg.head_dim
        rope = RoPE(hd, theta)
        self.fc = nn.Linear(n_taps * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=1e-6)
        self.layers = nn.ModuleList(CachedContextLayer(H, tcfg.num_attention_heads, tcfg.num_key_value_heads,
                                                       hd, 2 * H, rope) for _ in range(n_layers))
        self.norm = nn.RMSNorm(H, eps=1e-6)
        self.register_buffer("embed_w", embed_w)                 # buffers: frozen, not optimized
        self.register_buffer("head_w", head_w)

    def forward(self, taps, tok, ctx_pos, blk_pos, allow):
        ctx = self.hidden_norm(self.fc(taps))
        x = F.embedding(tok, self.embed_w)
        for layer in self.layers:
            x = layer(x, ctx, ctx_pos, blk_pos, allow)
        return F.linear(self.norm(x), self.head_w)


# ------------------------------------------------------------------ loss
class DecayedBlockCE:
    """CE per block slot with weight r**(k-1), r = e^{-1/gamma}; the anchor slot weighs 0."""

    def __init__(self, block_size, gamma):
        k = torch.arange(block_size)
        r = torch.tensor(math.exp(-1.0 / gamma))
        self.w = torch.where(k >= 1, torch.pow(r, k - 1), torch.zeros(()))

    def __call__(self, logits, labels, valid):                   # [b, N, B, V], [b, N, B], [b, N, B]
        ce = F.cross_entropy(logits.transpose(1, -1), labels.transpose(1, -1), reduction="none").transpose(1, -1)
        w = self.w * valid
        return (ce * w).sum() / w.sum().clamp_min(1e-6)


def block_batch(batch, B, n_anchor, mask_id, gen):
    ids, sup, nxt = batch["ids"], batch["sup"], batch["nxt"]
    b, T = ids.shape
    elig = sup.clone()
    elig[:, -B:] = False
    anc = torch.stack([torch.nonzero(e).flatten()[torch.randperm(int(e.sum()), generator=gen)[:n_anchor]].sort().values
                       for e in elig])                                        # [b, N]
    N = anc.shape[1]
    slots = anc[..., None] + torch.arange(B)                                   # [b, N, B] = anchor + j
    tok = torch.full_like(slots, mask_id)
    tok[..., 0] = ids.gather(1, anc)
    k_pos = torch.arange(T)
    a = anc.repeat_interleave(B, 1)[..., None]                                 # [b, N*B, 1]
    see_ctx = (a - k_pos) > 0
    blk = torch.arange(N).repeat_interleave(B)
    see_blk = (blk[:, None] == blk[None]).expand(b, -1, -1)
    allow = torch.cat([see_ctx, see_blk], -1)
    labels = nxt.gather(1, slots.flatten(1)).view_as(slots)                   # = target choice at anchor+j-1
    valid = sup.gather(1, slots.flatten(1)).view_as(slots).float()
    return tok.flatten(1), slots.flatten(1), allow, labels, valid, (b, N)


def main():
    ap = argparse.ArgumentParser()
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    ap.add_argument("--phase", choices=["all", "cache", "train"], default="all")
    cfg = vars(ap.parse_args())
    cfg["mask_token_id"] = cfg["vocab"] - 1
    cfg["target_layer_ids"] = taps_for(cfg["target_layers"], cfg["n_taps"])
    cfg["loss"] = "ce_target_argmax"
    torch.manual_seed(0)
    os.makedirs(cfg["out"], exist_ok=True)
    cache_dir = os.path.join(cfg["out"], "cache")
    root = tempfile.mkdtemp(prefix="dflash_cache_", dir=os.environ.get("TMPDIR"))
    cfg["target_path"] = build_target(cfg, root)
    cfg["cache_dir"] = cache_dir
    with open(os.path.join(cfg["out"], "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)

    embed_w, head_w, theta, tcfg = write_cache(cfg, cfg["target_path"], cache_dir)
    if cfg["phase"] == "cache":
        return
    drafter = Drafter(tcfg, len(cfg["target_layer_ids"]), cfg["draft_layers"], embed_w, head_w, theta)
    crit = DecayedBlockCE(cfg["block_size"], cfg["gamma"])
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg["lr"])
    files = sorted(glob.glob(os.path.join(cache_dir, "batch_*.pt")))
    gen = torch.Generator().manual_seed(7)
    for step in range(cfg["steps"]):
        batch = torch.load(files[step % len(files)])
        tok, blk_pos, allow, labels, valid, (b, N) = block_batch(batch, cfg["block_size"], cfg["max_anchors"],
                                                                 cfg["mask_token_id"], gen)
        T = batch["ids"].shape[1]
        logits = drafter(batch["taps"], tok, torch.arange(T).expand(b, T), blk_pos, allow)
        loss = crit(logits.view(b, N, cfg["block_size"], -1), labels, valid)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} {os.path.basename(files[step % len(files)])} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
