#!/usr/bin/env python
"""DFlash drafter trainer for packed rows, written with gather-style indexing.

Each training row packs several prompt+answer documents back to back; ``cu`` holds the
cumulative document lengths (flash-attn ``cu_seqlens`` convention).  Every per-position
quantity (document id, position inside the document, anchor of a draft query, label) is
obtained with torch.gather / bucketize against those offsets.  The target runs once per
document, so positions restart at 0 in every document.
"""
import argparse
import collections
import json
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(1)

Packed = collections.namedtuple("Packed", "ids sup cu")    # ids/sup: [T]; cu: [n_docs + 1]


def select_layers(L, k):
    if k == 1:
        return [L // 2]
    return torch.linspace(1, L - 3, k).round().long().tolist()


def doc_index(cu, T):
    """Document id of every packed position."""
    return torch.bucketize(torch.arange(T), cu[1:], right=True)


def pos_in_doc(cu, T):
    return torch.arange(T) - cu.gather(0, doc_index(cu, T))


def anchor_candidates(row: Packed, B):
    T = row.ids.numel()
    doc = doc_index(row.cu, T)
    doc_end = row.cu[1:].gather(0, doc)                      # exclusive end of the own document
    return torch.nonzero(row.sup.bool() & (torch.arange(T) < doc_end - B)).flatten()


class Attn(nn.Module):
    def __init__(self, H, nq, nkv, hd, theta):
        super().__init__()
        self.nq, self.nkv, self.hd, self.theta = nq, nkv, hd, theta
        self.wq = nn.Linear(H, nq * hd, bias=False)
        self.wk = nn.Linear(H, nkv * hd, bias=False)
        self.wv = nn.Linear(H, nkv * hd, bias=False)
        self.wo = nn.Linear(nq * hd, H, bias=False)
        self.qn = nn.RMSNorm(hd, eps=1e-6)
        self.kn = nn.RMSNorm(hd, eps=1e-6)

    def rope(self, x, pos):                                   # x [S, n, hd], pos [S]
        half = self.hd // 2
        inv = 1.0 / self.theta ** (torch.arange(half).float() / half)
        ang = pos.float()[:, None, None] * inv
        cos, sin = ang.cos().repeat(1, 1, 2), ang.sin().repeat(1, 1, 2)
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def forward(self, h, ctx, q_pos, k_pos, allow):            # one packed row at a time
        S, T = h.shape[0], ctx.shape[0]
        q = self.rope(self.qn(self.wq(h).view(S, self.nq, self.hd)), q_pos)
        k = torch.cat([self.wk(ctx), self.wk(h)]).view(T + S, self.nkv, self.hd)
        v = torch.cat([self.wv(ctx), self.wv(h)]).view(T + S, self.nkv, self.hd)
        k = self.rope(self.kn(k), k_pos)
        g = self.nq // self.nkv
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)   # [n, S|T+S, hd]
        s = torch.bmm(q, k.transpose(1, 2)) / self.hd ** 0.5
        s = s.masked_fill(~allow, torch.finfo(s.dtype).min)
        o = torch.bmm(s.softmax(-1), v).transpose(0, 1).reshape(S, -1)
        return self.wo(o)


class Layer(nn.Module):
    def __init__(self, H, I, **kw):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(H, eps=1e-6), nn.RMSNorm(H, eps=1e-6)
        self.attn = Attn(H, **kw)
        self.gate, self.up = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.down = nn.Linear(I, H, bias=False)

    def forward(self, x, ctx, q_pos, k_pos, allow):
        x = x + self.attn(self.n1(x), ctx, q_pos, k_pos, allow)
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Drafter(nn.Module):
    def __init__(self, target, n_taps, n_layers, I):
        super().__init__()
        tc = target.config
        H = tc.hidden_size
        self.fc = nn.Linear(n_taps * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=1e-6)
        self.layers = nn.ModuleList(
            Layer(H, I, nq=tc.num_attention_heads, nkv=tc.num_key_value_heads, hd=tc.head_dim,
                  theta=float(tc.rope_parameters["rope_theta"])) for _ in range(n_layers))
        self.norm = nn.RMSNorm(H, eps=1e-6)
        # frozen copies of the target's embedding and head
        self.embed = nn.Embedding.from_pretrained(target.model.embed_tokens.weight.detach().clone(), freeze=True)
        self.head = nn.Linear(H, tc.vocab_size, bias=False)
        self.head.weight = nn.Parameter(target.lm_head.weight.detach().clone(), requires_grad=False)

    def forward(self, taps, tok, q_pos, k_pos, allow):
        ctx = self.hidden_norm(self.fc(taps))
        x = self.embed(tok)
        for l in self.layers:
            x = l(x, ctx, q_pos, k_pos, allow)
        return self.head(self.norm(x))


def row_inputs(row: Packed, anchors, B, mask_id):
    """Everything the drafter needs for one packed row, by gathering against cu."""
    T = row.ids.numel()
    doc = doc_index(row.cu, T)
    pid = pos_in_doc(row.cu, T)
    j = torch.arange(B)
    g_ix = (anchors[:, None] + j).flatten()                  # global packed index of each slot
    a_glob = anchors.repeat_interleave(B)                     # global anchor of each query
    q_doc = doc.gather(0, a_glob)
    q_pos = pid.gather(0, a_glob) + j.repeat(anchors.numel())  # anchor + j, document relative
    tok = torch.where(j.repeat(anchors.numel()) == 0, row.ids.gather(0, g_ix), mask_id)
    k_glob = torch.arange(T)
    ctx_ok = (doc[None, :] == q_doc[:, None]) & ~(k_glob[None, :] >= a_glob[:, None])
    blk_of = torch.arange(anchors.numel()).repeat_interleave(B)
    blk_ok = blk_of[:, None] == blk_of[None, :]
    allow = torch.cat([ctx_ok, blk_ok], 1)
    k_pos = torch.cat([pid, q_pos])
    return tok, q_pos, k_pos, allow, g_ix


def weighted_block_ce(logits, labels, valid, B, gamma):
    """Per-slot decayed CE. Weights are built for every slot, then the anchor slot is removed."""
    k = torch.arange(B).float().repeat(labels.numel() // B)
    w = torch.exp(-(k - 1) / gamma) * valid
    ce = F.cross_entropy(logits, labels, reduction="none")
    anchor = k == 0
    num = (w * ce).sum() - (w * ce)[anchor].sum()
    den = w.sum() - w[anchor].sum()
    return num / den.clamp_min(1e-6)


def make_rows(gen, vocab, mask_id):
    rows = []
    for lens in ([20, 28], [16, 14, 18]):
        ids, sup = [], []
        for n in lens:
            p = int(torch.randint(3, 6, (1,), generator=gen))
            ids.append(torch.randint(0, mask_id, (n,), generator=gen))
            sup.append((torch.arange(n) >= p).long())
        cu = torch.tensor([0] + lens).cumsum(0)
        rows.append(Packed(torch.cat(ids), torch.cat(sup), cu))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--n-taps", type=int, default=3)
    ap.add_argument("--max-anchors", type=int, default=6)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default="run_out")
    a = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)

    tdir = os.path.join(tempfile.mkdtemp(prefix="dflash_packed_", dir=os.environ.get("TMPDIR")), "target")
    Qwen3ForCausalLM(Qwen3Config(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 max_position_embeddings=128, tie_word_embeddings=False)).save_pretrained(tdir)
    target = Qwen3ForCausalLM.from_pretrained(tdir).eval().requires_grad_(False)
    L, V = target.config.num_hidden_layers, target.config.vocab_size
    mask_id = V - 1
    layer_ids = select_layers(L, a.n_taps)
    cfg = dict(vars(a), target_path=tdir, target_layers=L, target_layer_ids=layer_ids, mask_token_id=mask_id,
               loss="ce_target_argmax", packing="cu_seqlens")
    os.makedirs(a.out, exist_ok=True)
    json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=2)

    rows = make_rows(gen, V, mask_id)
    feats, preds = [], []
    with torch.no_grad():
        for r in rows:                                        # target sees one document at a time
            f_doc, p_doc = [], []
            for s, e in zip(r.cu[:-1].tolist(), r.cu[1:].tolist()):
                o = target(input_ids=r.ids[None, s:e], output_hidden_states=True)
                f_doc.append(torch.cat([o.hidden_states[i + 1][0] for i in layer_ids], -1))
                p_doc.append(o.logits[0].argmax(-1))          # p_doc[t] predicts token t+1
            feats.append(torch.cat(f_doc))
            preds.append(torch.cat(p_doc))

    drafter = Drafter(target, len(layer_ids), n_layers=2, I=64)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=a.lr)
    for step in range(a.steps):
        losses = []
        for r, f, pr in zip(rows, feats, preds):
            cand = anchor_candidates(r, a.block_size)
            anchors = cand[torch.randperm(cand.numel(), generator=gen)[: a.max_anchors]].sort().values
            tok, q_pos, k_pos, allow, g_ix = row_inputs(r, anchors, a.block_size, mask_id)
            logits = drafter(f, tok, q_pos, k_pos, allow)
            labels = pr.gather(0, (g_ix - 1).clamp_min(0))   # slot j <- prediction at anchor + j - 1
            valid = r.sup.gather(0, g_ix).float()
            losses.append(weighted_block_ce(logits, labels, valid, a.block_size, a.gamma))
        loss = torch.stack(losses).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
