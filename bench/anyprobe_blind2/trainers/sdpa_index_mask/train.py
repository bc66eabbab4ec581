#!/usr/bin/env python
"""DFlash drafter trainer built around F.scaled_dot_product_attention.

The attention mask is a boolean tensor made by broadcasting comparisons of small index
tables (q_ix, k_ix, blk, slot).  Rows have different lengths (right padding); the loss is
KL(target || drafter) against the target's soft next-token distribution.
"""
import argparse
import dataclasses
import json
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(1)


@dataclasses.dataclass
class Cfg:
    target_layers: int = 6
    hidden: int = 40
    vocab: int = 100
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 10
    n_taps: int = 3
    draft_layers: int = 2
    block_size: int = 4
    gamma: float = 7.0
    n_blocks: int = 4
    mask_token_id: int = 99
    lr: float = 3e-3
    steps: int = 2
    seed: int = 0
    out: str = "run_out"


def tap_ids(L, k):
    return [L // 2] if k == 1 else [round(1 + i * (L - 4) / (k - 1)) for i in range(k)]


class Norm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.w, 1e-6)


def rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2).float() / d)
    f = pos.float().unsqueeze(-1) * inv                       # [b, s, d/2]
    f = torch.cat([f, f], -1).unsqueeze(1)                    # [b, 1, s, d]
    x1, x2 = x.chunk(2, -1)
    return x * f.cos() + torch.cat([-x2, x1], -1) * f.sin()


class DraftAttention(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.q_norm, self.k_norm = Norm(c.head_dim), Norm(c.head_dim)

    def forward(self, h, ctx, q_pos, kv_pos, allow):
        c = self.c
        b, Q, _ = h.shape
        heads = lambda t, n: t.view(b, -1, n, c.head_dim).transpose(1, 2)
        q = rope(self.q_norm(heads(self.q_proj(h), c.heads)), q_pos)
        k = heads(torch.cat([self.k_proj(ctx), self.k_proj(h)], 1), c.kv_heads)
        v = heads(torch.cat([self.v_proj(ctx), self.v_proj(h)], 1), c.kv_heads)
        k = rope(self.k_norm(k), kv_pos)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allow, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, Q, -1))


class DraftLayer(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = Norm(c.hidden), Norm(c.hidden)
        self.self_attn = DraftAttention(c)
        self.mlp = nn.Sequential(nn.Linear(c.hidden, 2 * c.hidden, bias=False), nn.SiLU(),
                                 nn.Linear(2 * c.hidden, c.hidden, bias=False))

    def forward(self, x, ctx, q_pos, kv_pos, allow):
        x = x + self.self_attn(self.input_layernorm(x), ctx, q_pos, kv_pos, allow)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, c: Cfg, embed: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        self.fc = nn.Linear(c.n_taps * c.hidden, c.hidden, bias=False)
        self.hidden_norm = Norm(c.hidden)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.draft_layers))
        self.norm = Norm(c.hidden)
        self.embed, self.lm_head = embed, lm_head          # the target's own modules
        self.embed.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    def forward(self, taps, tok, q_pos, kv_pos, allow):
        ctx = self.hidden_norm(self.fc(taps))
        x = self.embed(tok)
        for layer in self.layers:
            x = layer(x, ctx, q_pos, kv_pos, allow)
        return self.lm_head(self.norm(x))


# ---------------------------------------------------------------- index tables and mask
def slot_tables(n_blk, B):
    """Per draft query: which slot of its block it is, and which block."""
    slot = torch.arange(B).repeat(n_blk)          # 0 1 .. B-1 0 1 .. B-1 ...
    blk = torch.arange(n_blk).repeat(B)
    return blk, slot


def build_allow(anc, T, B):
    """anc: [b, n_blk] anchor positions -> bool [b, 1, n_blk*B, T + n_blk*B]."""
    b, n_blk = anc.shape
    blk, slot = slot_tables(n_blk, B)
    q_anc = anc.repeat_interleave(B, dim=1)                    # anchor of each query
    k_ix = torch.arange(T)
    see_ctx = k_ix[None, None, :] < q_anc[:, :, None]          # strictly before the anchor
    see_blk = blk[:, None] == blk[None, :]                     # own block, both directions
    allow = torch.cat([see_ctx, see_blk.expand(b, -1, -1)], dim=-1)
    q_ix = q_anc + slot                                        # position id of each query
    kv_ix = torch.cat([k_ix.expand(b, T), q_ix], dim=1)
    return allow[:, None], q_ix, kv_ix, slot


def sample_anchors(lengths, prompt_lens, B, n, gen):
    out = []
    for L, p in zip(lengths.tolist(), prompt_lens.tolist()):
        cand = torch.arange(p, L - B)                         # supervised, block fits in the row
        out.append(cand[torch.randperm(cand.numel(), generator=gen)[:n]].sort().values)
    return torch.stack(out)


def decay(B, gamma):
    j = torch.arange(B, dtype=torch.float32)
    return torch.where(j > 0, torch.exp(-(j - 1) / gamma), torch.zeros(()))


def main():
    ap = argparse.ArgumentParser()
    for f in dataclasses.fields(Cfg):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    c = Cfg(**vars(ap.parse_args()))
    torch.manual_seed(c.seed)
    gen = torch.Generator().manual_seed(c.seed)
    layer_ids = tap_ids(c.target_layers, c.n_taps)

    tmp = tempfile.mkdtemp(prefix="dflash_sdpa_", dir=os.environ.get("TMPDIR"))
    hf_cfg = Qwen3Config(vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=2 * c.hidden,
                         num_hidden_layers=c.target_layers, num_attention_heads=c.heads,
                         num_key_value_heads=c.kv_heads, head_dim=c.head_dim,
                         max_position_embeddings=128, tie_word_embeddings=False)
    Qwen3ForCausalLM(hf_cfg).save_pretrained(tmp)
    target = Qwen3ForCausalLM.from_pretrained(tmp).eval().requires_grad_(False)

    os.makedirs(c.out, exist_ok=True)
    with open(os.path.join(c.out, "config.json"), "w") as f:
        json.dump({**dataclasses.asdict(c), "target_layer_ids": layer_ids, "target_path": tmp,
                   "loss": "kl_soft_target"}, f, indent=2)

    # data: prompt + answer, right padded
    b, T = 3, 30
    lengths = torch.tensor([30, 26, 28])
    prompt_lens = torch.randint(3, 8, (b,), generator=gen)
    ids = torch.randint(0, c.mask_token_id, (b, T), generator=gen)
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = ids * attn
    sup = (torch.arange(T)[None] >= prompt_lens[:, None]).long() * attn

    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=attn, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)
    soft = out.logits.log_softmax(-1)                          # soft[t] = log p(token t+1)

    drafter = Drafter(c, target.model.embed_tokens, target.lm_head)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=c.lr)
    w_slot = decay(c.block_size, c.gamma)
    for step in range(c.steps):
        anc = sample_anchors(lengths, prompt_lens, c.block_size, c.n_blocks, gen)
        allow, q_ix, kv_ix, slot = build_allow(anc, T, c.block_size)
        tok = torch.where(slot == 0, ids.gather(1, q_ix), torch.full_like(q_ix, c.mask_token_id))
        logq = drafter(taps, tok, q_ix, kv_ix, allow).log_softmax(-1)
        tgt_ix = (q_ix - 1).clamp_min(0)                       # slot j <- target at anchor + j - 1
        logp = soft.gather(1, tgt_ix[..., None].expand(-1, -1, soft.shape[-1]))
        kl = (logp.exp() * (logp - logq)).sum(-1)             # [b, Q]
        w = w_slot[slot][None] * sup.gather(1, q_ix).float()
        loss = (kl * w).sum() / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} kl {loss.item():.4f}")


if __name__ == "__main__":
    main()
