"""DFlash drafter training with gradient accumulation: several micro-batches per optimizer update.

Blind-benchmark subject: written from the project's README, docs and /work/shared/DFLASH.md only.
Steps count optimizer updates; the schedule runs over them, not over micro-batches.
"""
import argparse
import math
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM


def prepare_target(seed):
    cfg = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(seed)
    root = tempfile.mkdtemp()
    Qwen3ForCausalLM(cfg).save_pretrained(os.path.join(root, "target"))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, "target"))
    for p in model.parameters():
        p.requires_grad = False
    return model.eval()


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Rope(nn.Module):
    def __init__(self, head_dim, theta):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim),
                             persistent=False)

    def forward(self, positions):
        f = positions.float().unsqueeze(-1) * self.inv_freq
        f = torch.cat([f, f], -1)
        return f.cos(), f.sin()


def apply_rope(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., h:], x[..., :h]], -1) * sin[:, None]


class Layer(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, ffn, eps):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, head_dim
        self.ln1, self.ln2 = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.wq = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, hidden, bias=False)
        self.qn, self.kn = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, ctx, rope_q, rope_kv, bias):
        n, t, _ = x.shape
        h = self.ln1(x)
        q = self.qn(self.wq(h).unflatten(-1, (self.heads, self.hd))).transpose(1, 2)
        kv_in = torch.cat([ctx, h], dim=1)
        k = self.kn(self.wk(kv_in).unflatten(-1, (self.kv_heads, self.hd))).transpose(1, 2)
        v = self.wv(kv_in).unflatten(-1, (self.kv_heads, self.hd)).transpose(1, 2)
        q = apply_rope(q, *rope_q)
        k = apply_rope(k, *rope_kv)
        rep = self.heads // self.kv_heads
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           attn_mask=bias)
        x = x + self.wo(o.transpose(1, 2).flatten(2))
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Drafter(nn.Module):
    def __init__(self, target, layer_ids, block, mask_id, depth=2):
        super().__init__()
        c = target.config
        self.layer_ids, self.block, self.mask_id = layer_ids, block, mask_id
        self.embed = nn.Embedding.from_pretrained(target.get_input_embeddings().weight.clone(), freeze=True)
        self.head = target.get_output_embeddings()
        self.fc = nn.Linear(len(layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.fc_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(
            Layer(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size,
                  c.rms_norm_eps) for _ in range(depth))
        self.out_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rope = Rope(c.head_dim, c.rope_parameters["rope_theta"])

    def forward(self, target_hidden, ids, anchors):
        n, s = ids.shape
        a, b = anchors.shape[1], self.block
        ctx = self.fc_norm(self.fc(torch.cat([target_hidden[i + 1] for i in self.layer_ids], -1)))
        slots = torch.arange(b)
        tok = torch.where(slots == 0, ids.gather(1, anchors).unsqueeze(-1), torch.full_like(slots, self.mask_id))
        x = self.embed(tok.reshape(n, a * b))
        pos_block = (anchors.unsqueeze(-1) + slots).reshape(n, a * b)
        pos_all = torch.cat([torch.arange(s).expand(n, s), pos_block], 1)
        qb = torch.arange(a * b).div(b, rounding_mode="floor")
        anchor_q = anchors.repeat_interleave(b, 1)
        see = torch.cat([torch.arange(s)[None, None] < anchor_q[..., None],
                         (qb[:, None] == qb[None]).expand(n, -1, -1)], -1)
        bias = torch.zeros(see.shape).masked_fill(~see, float("-inf"))[:, None]
        rq, rkv = self.rope(pos_block), self.rope(pos_all)
        for layer in self.layers:
            x = layer(x, ctx, rq, rkv, bias)
        return self.head(self.out_norm(x)).unflatten(1, (a, b))


def pick_anchors(loss_mask, k, block):
    out = []
    for row in loss_mask:
        ok = row.clone()
        ok[-block:] = 0
        pool = ok.nonzero().flatten()
        out.append(pool[torch.randperm(len(pool))[:k]].sort().values)
    return torch.stack(out)


def dflash_loss(logits, teacher, anchors, loss_mask, gamma):
    n, a, b, v = logits.shape
    k = torch.arange(b)
    at = (anchors.unsqueeze(-1) + k - 1).clamp_min(0).reshape(n, -1)
    label = teacher.gather(1, at).reshape(n, a, b)
    valid = loss_mask.gather(1, (anchors.unsqueeze(-1) + k).reshape(n, -1)).reshape(n, a, b)
    weight = torch.exp(-(k - 1).float() / gamma)
    weight[0] = 0.0
    weight = weight * valid
    per_slot = F.cross_entropy(logits.flatten(0, 2), label.flatten(), reduction="none").view(n, a, b)
    return (per_slot * weight).sum() / weight.sum()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2, help="optimizer updates")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per update")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=48)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--gamma", type=float, default=4.0)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min-lr", type=float, default=5e-5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-anchors", type=int, default=3)
    a = p.parse_args()

    target = prepare_target(1234)
    depth = target.config.num_hidden_layers
    layer_ids = [round(1 + i * (depth - 4) / 4) for i in range(5)]
    drafter = Drafter(target, layer_ids, a.block, mask_id=target.config.vocab_size - 1)

    decay, no_decay = [], []
    for name, prm in drafter.named_parameters():
        if prm.requires_grad:
            (no_decay if prm.ndim < 2 else decay).append(prm)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95))
    horizon = a.steps
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=a.warmup)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, horizon - a.warmup), eta_min=a.min_lr)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[a.warmup])

    torch.manual_seed(5)
    for update in range(a.steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(a.accum):
            ids = torch.randint(4, target.config.vocab_size - 8, (a.micro_batch, a.seq))
            loss_mask = torch.ones_like(ids)
            loss_mask[:, :5] = 0
            with torch.no_grad():
                tout = target(ids, output_hidden_states=True)
            anchors = pick_anchors(loss_mask, a.max_anchors, a.block)
            logits = drafter(tout.hidden_states, ids, anchors)
            loss = dflash_loss(logits, tout.logits.argmax(-1), anchors, loss_mask, a.gamma) / a.accum
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        print(f"update {update + 1}: loss {total:.4f} lr {opt.param_groups[0]['lr']:.2e}", flush=True)


if __name__ == "__main__":
    main()
