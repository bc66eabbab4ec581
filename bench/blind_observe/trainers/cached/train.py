"""Two-phase DFlash training: dump the target's features and labels to a cache, then train from the cache.

Blind-benchmark subject: written from the project's README, docs and /work/shared/DFLASH.md only.
Phase 1 runs the frozen target once per sample and stores the selected layers (z-lab ids: id i is
hidden_states[i + 1]) and the target's own next-token choice; phase 2 never runs the target again.
"""
import argparse
import math
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 288
MASK_ID = 287
EOS_ID = 2


def write_target(path, seed):
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def select_layers(num_layers, k):
    if k == 1:
        return [num_layers // 2]
    return [int(round(1 + i * (num_layers - 4) / (k - 1))) for i in range(k)]


@torch.no_grad()
def build_cache(target, layer_ids, samples, seq_len, cache_file, seed):
    g = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(samples):
        ids = torch.randint(3, VOCAB - 16, (1, seq_len), generator=g)
        out = target(input_ids=ids, output_hidden_states=True)
        taps = [out.hidden_states[lid + 1] for lid in layer_ids]
        mask = torch.ones(seq_len, dtype=torch.long)
        mask[:4] = 0
        records.append({"input_ids": ids[0], "loss_mask": mask, "features": torch.cat(taps, dim=-1)[0],
                        "next_token": out.logits[0].argmax(-1)})
    torch.save(records, cache_file)


class FeatureCache(Dataset):
    def __init__(self, cache_file):
        self.records = torch.load(cache_file)

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]


def rms_norm(x, weight, eps=1e-6):
    return weight * x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()


class DraftBlock(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim):
        super().__init__()
        self.h, self.kvh, self.d = heads, kv_heads, head_dim
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.mlp_norm = nn.Parameter(torch.ones(hidden))
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = nn.Parameter(torch.ones(head_dim))
        self.k_norm = nn.Parameter(torch.ones(head_dim))
        self.gate_up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x, ctx, cos_sin_q, cos_sin_k, allowed):
        n, t, _ = x.shape
        h = rms_norm(x, self.attn_norm)
        q = rms_norm(self.q_proj(h).view(n, t, self.h, self.d), self.q_norm).transpose(1, 2)
        k_ctx, k_blk = self.k_proj(ctx), self.k_proj(h)
        v_ctx, v_blk = self.v_proj(ctx), self.v_proj(h)
        k = torch.cat([k_ctx, k_blk], 1)
        k = rms_norm(k.view(n, k.shape[1], self.kvh, self.d), self.k_norm).transpose(1, 2)
        v = torch.cat([v_ctx, v_blk], 1).view(n, -1, self.kvh, self.d).transpose(1, 2)
        q = q * cos_sin_q[0] + swap_halves(q) * cos_sin_q[1]
        k = k * cos_sin_k[0] + swap_halves(k) * cos_sin_k[1]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        x = x + self.o_proj(out.transpose(1, 2).reshape(n, t, -1))
        gate, up = self.gate_up(rms_norm(x, self.mlp_norm)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


def swap_halves(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


class CachedDrafter(nn.Module):
    def __init__(self, cfg, embed_weight, head_weight, num_taps, block_size, layers=2):
        super().__init__()
        self.block_size = block_size
        self.theta = cfg.rope_parameters["rope_theta"]
        self.head_dim = cfg.head_dim
        self.register_buffer("embed_weight", embed_weight.detach().clone())  # frozen: a buffer, never optimised
        self.register_buffer("head_weight", head_weight.detach().clone())
        self.fc = nn.Linear(num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.fc_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.blocks = nn.ModuleList(DraftBlock(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                               cfg.head_dim) for _ in range(layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.hidden_size))

    def rotation(self, positions):
        inv = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        ang = positions[..., None].float() * inv
        ang = torch.cat([ang, ang], -1).unsqueeze(1)
        return ang.cos(), ang.sin()

    def forward(self, features, input_ids, anchors):
        n, s = input_ids.shape
        a, b = anchors.shape[1], self.block_size
        ctx = rms_norm(self.fc(features), self.fc_norm)
        tokens = torch.full((n, a, b), MASK_ID)
        tokens[..., 0] = input_ids.gather(1, anchors)
        x = F.embedding(tokens.view(n, -1), self.embed_weight)
        blk_pos = (anchors[..., None] + torch.arange(b)).view(n, -1)
        key_pos = torch.cat([torch.arange(s).expand(n, -1), blk_pos], 1)
        kv = torch.arange(s)
        q_anchor = anchors[..., None].expand(n, a, b).reshape(n, -1)
        ctx_visible = kv.view(1, 1, s) < q_anchor.unsqueeze(-1)
        blk = torch.arange(a * b) // b
        blk_visible = (blk.view(1, -1, 1) == blk.view(1, 1, -1)).expand(n, -1, -1)
        allowed = torch.cat([ctx_visible, blk_visible], -1).unsqueeze(1)
        cq, ck = self.rotation(blk_pos), self.rotation(key_pos)
        for block in self.blocks:
            x = block(x, ctx, cq, ck, allowed)
        logits = F.linear(rms_norm(x, self.final_norm), self.head_weight)
        return logits.view(n, a, b, -1)


def sample_anchors(loss_mask, max_anchors, block_size):
    chosen = []
    for row in loss_mask:
        eligible = row.bool().clone()
        eligible[-block_size:] = False
        idx = eligible.nonzero().squeeze(1)
        chosen.append(torch.sort(idx[torch.randperm(idx.numel())[:max_anchors]]).values)
    return torch.stack(chosen)


def decayed_ce(logits, next_token, anchors, loss_mask, gamma):
    n, a, b, _ = logits.shape
    offs = torch.arange(b)
    # slot j (j >= 1) predicts token p+j: the target chose it at position p+j-1
    labels = next_token.gather(1, (anchors[..., None] + offs - 1).clamp(min=0).view(n, -1)).view(n, a, b)
    live = loss_mask.gather(1, (anchors[..., None] + offs).view(n, -1)).view(n, a, b).float()
    w = torch.zeros(b)
    w[1:] = torch.exp(-torch.arange(b - 1).float() / gamma)
    w = w * live
    ce = F.cross_entropy(logits.permute(0, 3, 1, 2), labels, reduction="none")
    return (ce * w).sum() / w.sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=56)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--num-taps", type=int, default=4)
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--max-anchors", type=int, default=4)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="dflash-cache-")
    write_target(os.path.join(work, "target"), seed=3)
    target = Qwen3ForCausalLM.from_pretrained(os.path.join(work, "target")).eval()
    target.requires_grad_(False)
    layer_ids = select_layers(target.config.num_hidden_layers, args.num_taps)
    cache_file = os.path.join(work, "features.pt")
    build_cache(target, layer_ids, args.samples, args.seq_len, cache_file, seed=11)
    print(f"cached {args.samples} samples of layers {layer_ids} in {cache_file}", flush=True)

    drafter = CachedDrafter(target.config, target.model.embed_tokens.weight, target.lm_head.weight,
                            len(layer_ids), args.block_size)
    cfg = target.config
    del target  # phase 2 trains from the cache alone
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    loader = DataLoader(FeatureCache(cache_file), batch_size=args.batch_size, shuffle=True)
    step = 0
    while step < args.steps:
        for batch in loader:
            anchors = sample_anchors(batch["loss_mask"], args.max_anchors, args.block_size)
            logits = drafter(batch["features"], batch["input_ids"], anchors)
            loss = decayed_ce(logits, batch["next_token"], anchors, batch["loss_mask"], args.gamma)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step >= args.steps:
                break
    assert cfg.vocab_size == VOCAB


if __name__ == "__main__":
    main()
