"""A DFlash drafter trainer written as plain functions over a dict of tensors (no nn.Module of its own).

Blind-benchmark subject: written from the project's README, docs and /work/shared/DFLASH.md only.
The target is a tiny Qwen3 built, saved and reloaded here; nothing is downloaded.
"""
import argparse
import math
import tempfile

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

BLOCK = 8
GAMMA = 4.0  # speculators' default decay; it does not scale with the block size
NUM_TAPS = 3
DRAFT_LAYERS = 2
MASK_TOKEN = 255  # an embedding row no data token uses; pad 0, bos 1, eos 2 are the specials
EOS_TOKEN = 2


def make_target(seed):
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=EOS_TOKEN, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    where = tempfile.mkdtemp(prefix="tiny-qwen3-")
    Qwen3ForCausalLM(cfg).save_pretrained(where)
    target = Qwen3ForCausalLM.from_pretrained(where)
    target.eval()
    target.requires_grad_(False)
    return target


def tap_ids(num_layers, k):
    return [round(1 + i * (num_layers - 4) / (k - 1)) for i in range(k)]


def init_drafter(hidden, heads, kv_heads, head_dim, inter, k):
    def lin(o, i):
        w = torch.empty(o, i)
        torch.nn.init.normal_(w, std=0.02)
        return w.requires_grad_()

    p = {"fc": lin(hidden, k * hidden), "hidden_norm": torch.ones(hidden, requires_grad=True),
         "final_norm": torch.ones(hidden, requires_grad=True)}
    for li in range(DRAFT_LAYERS):
        p[f"{li}.in_norm"] = torch.ones(hidden, requires_grad=True)
        p[f"{li}.post_norm"] = torch.ones(hidden, requires_grad=True)
        p[f"{li}.q"] = lin(heads * head_dim, hidden)
        p[f"{li}.k"] = lin(kv_heads * head_dim, hidden)
        p[f"{li}.v"] = lin(kv_heads * head_dim, hidden)
        p[f"{li}.o"] = lin(hidden, heads * head_dim)
        p[f"{li}.q_norm"] = torch.ones(head_dim, requires_grad=True)
        p[f"{li}.k_norm"] = torch.ones(head_dim, requires_grad=True)
        p[f"{li}.gate"] = lin(inter, hidden)
        p[f"{li}.up"] = lin(inter, hidden)
        p[f"{li}.down"] = lin(hidden, inter)
    return p


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_tables(positions, head_dim, theta):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = positions.float()[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos()[:, None], ang.sin()[:, None]  # [N, 1, T, D]


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


def draw_anchors(loss_mask, count):
    rows = []
    for row in loss_mask:
        eligible = torch.nonzero(row[: row.numel() - BLOCK]).flatten()
        picked = eligible[torch.randperm(eligible.numel())[:count]]
        rows.append(picked.sort().values)
    return torch.stack(rows)


def visibility(anchors, seq_len):
    # queries of block b: context strictly before its anchor, and every token of block b
    n, a = anchors.shape
    q_block = torch.arange(a * BLOCK) // BLOCK
    q_anchor = anchors[:, q_block]  # [N, A*B]
    ctx = torch.arange(seq_len)
    sees_ctx = ctx[None, None, :] < q_anchor[:, :, None]
    sees_blk = (q_block[:, None] == q_block[None, :]).expand(n, -1, -1)
    return torch.cat([sees_ctx, sees_blk], dim=-1)[:, None]  # [N, 1, A*B, S + A*B]


def draft_forward(p, cfg, embed, head_w, final_norm_eps, feats, tokens, anchors):
    n, s = tokens.shape
    a = anchors.shape[1]
    heads, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = rms(F.linear(feats, p["fc"]), p["hidden_norm"], final_norm_eps)
    block_ids = torch.full((n, a, BLOCK), MASK_TOKEN, dtype=torch.long)
    block_ids[:, :, 0] = torch.gather(tokens, 1, anchors)
    x = F.embedding(block_ids.view(n, a * BLOCK), embed)
    block_pos = (anchors[:, :, None] + torch.arange(BLOCK)).view(n, a * BLOCK)
    ctx_pos = torch.arange(s).expand(n, s)
    cos_q, sin_q = rope_tables(block_pos, hd, cfg.rope_parameters["rope_theta"])
    cos_k, sin_k = rope_tables(torch.cat([ctx_pos, block_pos], 1), hd, cfg.rope_parameters["rope_theta"])
    allowed = visibility(anchors, s)
    for li in range(DRAFT_LAYERS):
        h = rms(x, p[f"{li}.in_norm"], cfg.rms_norm_eps)
        q = F.linear(h, p[f"{li}.q"]).view(n, -1, heads, hd)
        kk = torch.cat([F.linear(ctx, p[f"{li}.k"]), F.linear(h, p[f"{li}.k"])], 1).view(n, s + a * BLOCK, kvh, hd)
        vv = torch.cat([F.linear(ctx, p[f"{li}.v"]), F.linear(h, p[f"{li}.v"])], 1).view(n, s + a * BLOCK, kvh, hd)
        q = rms(q, p[f"{li}.q_norm"], cfg.rms_norm_eps).transpose(1, 2)
        kk = rms(kk, p[f"{li}.k_norm"], cfg.rms_norm_eps).transpose(1, 2)
        vv = vv.transpose(1, 2)
        q, kk = rotate(q, cos_q, sin_q), rotate(kk, cos_k, sin_k)
        kk = kk.repeat_interleave(heads // kvh, dim=1)
        vv = vv.repeat_interleave(heads // kvh, dim=1)
        att = F.scaled_dot_product_attention(q, kk, vv, attn_mask=allowed)
        x = x + F.linear(att.transpose(1, 2).reshape(n, a * BLOCK, heads * hd), p[f"{li}.o"])
        h = rms(x, p[f"{li}.post_norm"], cfg.rms_norm_eps)
        x = x + F.linear(F.silu(F.linear(h, p[f"{li}.gate"])) * F.linear(h, p[f"{li}.up"]), p[f"{li}.down"])
    x = rms(x, p["final_norm"], cfg.rms_norm_eps)
    return F.linear(x, head_w).view(n, a, BLOCK, -1)


def block_loss(logits, target_logits, anchors, loss_mask):
    n, a, b, v = logits.shape
    slot = torch.arange(b)
    label_at = (anchors[:, :, None] + slot - 1).clamp(min=0)  # slot j learns the target's output at p+j-1
    flat = label_at.view(n, a * b)
    labels = torch.gather(target_logits.argmax(-1), 1, flat).view(n, a, b)
    supervised = torch.gather(loss_mask, 1, (anchors[:, :, None] + slot).view(n, a * b)).view(n, a, b)
    decay = torch.exp(-(slot - 1).clamp(min=0).float() / GAMMA)
    decay = torch.where(slot == 0, torch.zeros_like(decay), decay)
    w = decay * supervised.float()
    ce = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1), reduction="none").view(n, a, b)
    return (ce * w).sum() / w.sum().clamp(min=1e-6)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--anchors", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    target = make_target(args.seed)
    cfg = target.config
    ids = tap_ids(cfg.num_hidden_layers, NUM_TAPS)
    embed = target.model.embed_tokens.weight
    head_w = target.lm_head.weight
    params = init_drafter(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                          cfg.intermediate_size, NUM_TAPS)
    opt = torch.optim.AdamW(list(params.values()), lr=args.lr, weight_decay=0.01)
    warmup = 1
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

    gen = torch.Generator().manual_seed(args.seed + 1)
    for step in range(args.steps):
        tokens = torch.randint(3, 250, (args.batch, args.seq_len), generator=gen)
        loss_mask = torch.ones_like(tokens)
        loss_mask[:, :8] = 0  # the prompt is not supervised
        with torch.no_grad():
            out = target(input_ids=tokens, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in ids], dim=-1)
        anchors = draw_anchors(loss_mask, args.anchors)
        logits = draft_forward(params, cfg, embed, head_w, cfg.rms_norm_eps, feats, tokens, anchors)
        loss = block_loss(logits, out.logits, anchors, loss_mask)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        sched.step()
        print(f"step {step + 1} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)


if __name__ == "__main__":
    main()
