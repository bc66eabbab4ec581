"""DFlash training on packed rows (two documents per row) with attention written by hand: matmul, an
additive mask, softmax, matmul. No SDPA.

Blind-benchmark subject: written from the project's README, docs and /work/shared/DFLASH.md only.
Each row packs two documents; positions restart per document; the target runs on each document alone,
so its features and logits are its own forward's.
"""
import argparse
import json
import math
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM


def load_settings(path):
    with open(path) as fh:
        return json.load(fh)


def materialise_target(seed):
    spec = Qwen3Config(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=256,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    out_dir = tempfile.mkdtemp(prefix="manual-target-")
    Qwen3ForCausalLM(spec).save_pretrained(out_dir)
    target = Qwen3ForCausalLM.from_pretrained(out_dir)
    target.requires_grad_(False)
    return target.eval()


class Norm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.scale


class HandAttention(nn.Module):
    def __init__(self, dim, heads, head_dim, eps):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q = nn.Linear(dim, heads * head_dim, bias=False)
        self.k = nn.Linear(dim, heads * head_dim, bias=False)
        self.v = nn.Linear(dim, heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, dim, bias=False)
        self.q_norm = Norm(head_dim, eps)
        self.k_norm = Norm(head_dim, eps)

    def split(self, x):
        n, t, _ = x.shape
        return x.view(n, t, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, block, context, rot_q, rot_k, additive_mask):
        q = rot_q(self.q_norm(self.split(self.q(block))))
        k = rot_k(self.k_norm(self.split(torch.cat([self.k(context), self.k(block)], dim=1))))
        v = self.split(torch.cat([self.v(context), self.v(block)], dim=1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        probs = torch.softmax(scores + additive_mask, dim=-1)
        out = (probs @ v).transpose(1, 2).flatten(2)
        return self.o(out)


class DecoderLayer(nn.Module):
    def __init__(self, dim, heads, head_dim, ffn, eps):
        super().__init__()
        self.norm1, self.norm2 = Norm(dim, eps), Norm(dim, eps)
        self.attn = HandAttention(dim, heads, head_dim, eps)
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x, ctx, rot_q, rot_k, mask):
        x = x + self.attn(self.norm1(x), ctx, rot_q, rot_k, mask)
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


def rotary(positions, head_dim, theta):
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions[:, None, :, None].float() * freqs
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)

    def apply(x):
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    return apply


class PackedDrafter(nn.Module):
    def __init__(self, target, tap_ids, settings):
        super().__init__()
        c = target.config
        self.tap_ids = tap_ids
        self.block = settings["block_size"]
        self.mask_token = settings["mask_token_id"]
        self.theta = c.rope_parameters["rope_theta"]
        self.head_dim = c.head_dim
        self.embed = target.model.embed_tokens  # shared with the frozen target
        self.lm_head = target.lm_head
        self.fc = nn.Linear(len(tap_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.fc_norm = Norm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c.hidden_size, c.num_attention_heads, c.head_dim,
                                                 c.intermediate_size, c.rms_norm_eps)
                                    for _ in range(settings["draft_layers"]))
        self.final = Norm(c.hidden_size, c.rms_norm_eps)

    def visibility(self, anchors, doc_ids):
        n, a = anchors.shape
        s, b = doc_ids.shape[1], self.block
        q_blk = torch.arange(a * b) // b
        anchor = anchors.repeat_interleave(b, dim=1)  # [n, a*b]
        anchor_doc = doc_ids.gather(1, anchor)
        kv = torch.arange(s)
        same_doc = doc_ids[:, None, :] == anchor_doc[:, :, None]
        ctx_ok = same_doc & (kv[None, None, :] < anchor[:, :, None])
        blk_ok = (q_blk[:, None] == q_blk[None, :]).expand(n, -1, -1)
        ok = torch.cat([ctx_ok, blk_ok], dim=-1)
        return torch.zeros(ok.shape).masked_fill(~ok, float("-inf")).unsqueeze(1)

    def forward(self, hidden_states, input_ids, position_ids, doc_ids, anchors):
        n, s = input_ids.shape
        a, b = anchors.shape[1], self.block
        ctx = self.fc_norm(self.fc(torch.cat([hidden_states[t + 1] for t in self.tap_ids], dim=-1)))
        blk = torch.full((n, a * b), self.mask_token, dtype=torch.long)
        blk[:, ::b] = input_ids.gather(1, anchors)
        x = self.embed(blk)
        blk_pos = position_ids.gather(1, anchors).repeat_interleave(b, dim=1) + torch.arange(b).repeat(a)
        rot_q = rotary(blk_pos, self.head_dim, self.theta)
        rot_k = rotary(torch.cat([position_ids, blk_pos], dim=1), self.head_dim, self.theta)
        mask = self.visibility(anchors, doc_ids)
        for layer in self.layers:
            x = layer(x, ctx, rot_q, rot_k, mask)
        return self.lm_head(self.final(x)).view(n, a, b, -1)


def pack(target, rows, doc_lens, rng):
    """Rows of len(doc_lens) documents; the target runs on each document alone."""
    ids, pos, docs, mask, hs, logits = [], [], [], [], [], []
    for _ in range(rows):
        r_ids, r_pos, r_doc, r_mask, r_hs, r_logits = [], [], [], [], [], []
        for d, length in enumerate(doc_lens):
            doc = torch.randint(3, 260, (1, length), generator=rng)
            with torch.no_grad():
                out = target(input_ids=doc, output_hidden_states=True)
            m = torch.ones(length, dtype=torch.long)
            m[:3] = 0  # each document's prompt
            r_ids.append(doc[0]); r_pos.append(torch.arange(length)); r_doc.append(torch.full((length,), d))
            r_mask.append(m); r_hs.append([h[0] for h in out.hidden_states]); r_logits.append(out.logits[0])
        ids.append(torch.cat(r_ids)); pos.append(torch.cat(r_pos)); docs.append(torch.cat(r_doc))
        mask.append(torch.cat(r_mask)); logits.append(torch.cat(r_logits))
        hs.append([torch.cat([doc_hs[i] for doc_hs in r_hs]) for i in range(len(r_hs[0]))])
    hidden = tuple(torch.stack([row[i] for row in hs]) for i in range(len(hs[0])))
    return torch.stack(ids), torch.stack(pos), torch.stack(docs), torch.stack(mask), hidden, torch.stack(logits)


def anchors_for(loss_mask, count, block, rng):
    picks = []
    for row in loss_mask:
        allowed = torch.nonzero(row[:-block], as_tuple=False).view(-1)
        perm = torch.randperm(allowed.numel(), generator=rng)[:count]
        picks.append(allowed[perm].sort().values)
    return torch.stack(picks)


def loss_fn(draft_logits, target_logits, anchors, loss_mask, doc_ids, gamma):
    n, a, b, v = draft_logits.shape
    j = torch.arange(b)
    where = anchors[:, :, None] + j  # the token slot j drafts
    teacher_at = (where - 1).view(n, -1)  # the target predicted it one position earlier
    labels = target_logits.argmax(-1).gather(1, teacher_at).view(n, a, b)
    same_doc = doc_ids.gather(1, where.view(n, -1)) == doc_ids.gather(1, anchors).repeat_interleave(b, 1)
    live = (loss_mask.gather(1, where.view(n, -1)).bool() & same_doc).view(n, a, b)
    decay = torch.exp(-(j - 1).clamp(min=0).float() / gamma) * (j >= 1)
    weight = decay * live
    ce = F.cross_entropy(draft_logits.reshape(-1, v), labels.reshape(-1), reduction="none").view(n, a, b)
    return (weight * ce).sum() / weight.sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="settings.json")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    st = load_settings(args.settings)
    steps = args.steps or st["steps"]
    target = materialise_target(st["seed"])
    L, k = target.config.num_hidden_layers, st["num_taps"]
    taps = [round(1 + i * (L - 4) / (k - 1)) for i in range(k)]
    model = PackedDrafter(target, taps, st)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=st["lr"], weight_decay=st["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / st["warmup"]))
    rng = torch.Generator().manual_seed(st["seed"])
    for it in range(steps):
        ids, pos, docs, mask, hidden, logits = pack(target, st["rows"], st["doc_lens"], rng)
        anchors = anchors_for(mask, st["anchors"], model.block, rng)
        draft = model(hidden, ids, pos, docs, anchors)
        loss = loss_fn(draft, logits, anchors, mask, docs, st["gamma"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        print(f"it={it} loss={loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
