"""DFlash drafter training written with flat indices: every (row, position) pair is one index into a
flattened tensor, masks are scattered into flat buffers, targets gathered with index_select.

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

SETTINGS = {
    "target_layers": 8, "taps": 3, "hidden": 32, "vocab": 96, "mask_token_id": 95, "draft_layers": 2,
    "block_size": 8, "gamma": 7.0, "max_anchors": 4, "seq_len": 48, "prompt_len": 8, "samples": 6,
    "batch": 3, "lr": 2e-3,
}


def qwen3(s: dict, layers: int) -> Qwen3Config:
    return Qwen3Config(hidden_size=s["hidden"], intermediate_size=2 * s["hidden"], num_attention_heads=4,
                       num_key_value_heads=2, head_dim=s["hidden"] // 4, num_hidden_layers=layers,
                       vocab_size=s["vocab"], max_position_embeddings=256, tie_word_embeddings=False)


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x (..., heads, D) with pos (...,) broadcast on the leading dims."""
    d = x.shape[-1]
    ang = pos[..., None].float() * (10000.0 ** (-torch.arange(0, d, 2).float() / d))
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[..., None, :], torch.cat([ang.sin(), ang.sin()], -1)[..., None, :]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


class Layer(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.nh, self.nkv, self.hd = 4, 2, h // 4
        self.qkv_norms = nn.ParameterDict({"q": nn.Parameter(torch.ones(self.hd)),
                                           "k": nn.Parameter(torch.ones(self.hd))})
        self.norms = nn.ParameterDict({"attn": nn.Parameter(torch.ones(h)), "mlp": nn.Parameter(torch.ones(h))})
        self.q = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o = nn.Linear(self.nh * self.hd, h, bias=False)
        self.gate_up = nn.Linear(h, 4 * h, bias=False)
        self.down = nn.Linear(2 * h, h, bias=False)

    def forward(self, x, ctx, q_pos, kv_pos, allow):
        """x (Q, H), ctx (T, H), allow (Q, T+Q); one row at a time."""
        hx = rms(x, self.norms["attn"])
        src = torch.cat([ctx, hx])
        q = rope(rms(self.q(hx).unflatten(-1, (self.nh, self.hd)), self.qkv_norms["q"]), q_pos)
        k = rope(rms(self.k(src).unflatten(-1, (self.nkv, self.hd)), self.qkv_norms["k"]), kv_pos)
        v = self.v(src).unflatten(-1, (self.nkv, self.hd))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=allow, enable_gqa=True)
        x = x + self.o(out.transpose(0, 1).flatten(1))
        g, u = self.gate_up(rms(x, self.norms["mlp"])).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class Drafter(nn.Module):
    def __init__(self, h: int, taps: int, layers: int):
        super().__init__()
        self.fc = nn.Linear(taps * h, h, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.layers = nn.ModuleList(Layer(h) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(h))

    def forward(self, x, feats, q_pos, kv_pos, allow):
        ctx = rms(self.fc(feats), self.hidden_norm)
        for layer in self.layers:
            x = layer(x, ctx, q_pos, kv_pos, allow)
        return rms(x, self.norm)


def flat_allow(anchors: torch.Tensor, t: int, b: int) -> torch.Tensor:
    """Boolean (Q, T+Q), built by scattering allowed (query, key) pairs into a flat buffer."""
    n = anchors.numel()
    q_len, kv_len = n * b, t + n * b
    q = torch.arange(q_len)
    q_anchor = anchors[q // b]
    # context keys: every kv < T that is not at or after the query's anchor
    kv = torch.arange(t)
    ctx_pairs = (q[:, None] * kv_len + kv[None, :])[~(kv[None, :] >= q_anchor[:, None])]
    # block keys: the B slots of the query's own block
    own = (q // b * b)[:, None] + torch.arange(b)[None, :]
    blk_pairs = (q[:, None] * kv_len + t + own).flatten()
    flat = torch.zeros(q_len * kv_len, dtype=torch.bool)
    flat[torch.cat([ctx_pairs, blk_pairs])] = True
    return flat.view(q_len, kv_len)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="run_out")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "t07_flat_index"))
    args = ap.parse_args()
    s = SETTINGS
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    tdir = os.path.join(args.workdir, "target")
    if not os.path.exists(os.path.join(tdir, "config.json")):
        torch.manual_seed(1357)
        Qwen3ForCausalLM(qwen3(s, s["target_layers"])).save_pretrained(tdir)
        torch.manual_seed(args.seed)
    target = Qwen3ForCausalLM.from_pretrained(tdir, torch_dtype=torch.float32).eval().requires_grad_(False)
    n_l, k = s["target_layers"], s["taps"]
    layer_ids = [n_l // 2] if k == 1 else [round(1 + i * (n_l - 4) / (k - 1)) for i in range(k)]

    with torch.no_grad():
        prompts = torch.randint(0, s["mask_token_id"], (s["samples"], s["prompt_len"]), generator=gen)
        new = s["seq_len"] - s["prompt_len"]
        ids = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0)[:, : s["seq_len"]]
        out = target(ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)      # (N, T, k*H)
        # the target's prediction for the token at each position sits one position earlier: roll by one
        teacher_at = torch.roll(out.logits.argmax(-1), shifts=1, dims=1)         # (N, T)
    n_rows, t = ids.shape
    loss_mask = torch.zeros(n_rows, t)
    loss_mask[:, s["prompt_len"]:] = 1
    flat_ids, flat_mask, flat_teacher = ids.flatten(), loss_mask.flatten(), teacher_at.flatten()

    b = s["block_size"]
    slot = torch.arange(b)
    decay = torch.exp(-(slot - 1).clamp(min=0).float() / s["gamma"])
    slot_w = decay - decay * (slot == 0).float()                                 # anchor slot carries no loss
    drafter = Drafter(s["hidden"], len(layer_ids), s["draft_layers"])
    opt = torch.optim.AdamW(drafter.parameters(), lr=s["lr"])
    embed, lm_head = target.model.embed_tokens, target.lm_head

    for step in range(args.steps):
        rows = torch.randperm(n_rows, generator=gen)[: s["batch"]]
        num, den = torch.zeros(()), torch.zeros(())
        per_slot_hit, per_slot_cnt = torch.zeros(b), torch.zeros(b)
        for r in rows.tolist():
            base = r * t                                                         # flat offset of the row
            ok = loss_mask[r].bool().clone()
            ok[t - b:] = False
            cand = ok.nonzero().squeeze(-1)
            anchors = cand[torch.randperm(cand.numel(), generator=gen)[: s["max_anchors"]]].sort().values
            n = anchors.numel()
            slot_flat = base + (anchors[:, None] + slot).flatten()               # flat index of every slot
            in_row = (anchors[:, None] + slot).flatten() < t
            slot_flat = torch.where(in_row, slot_flat, base + t - 1)
            block = torch.full((n * b,), s["mask_token_id"])
            block[::b] = flat_ids.index_select(0, base + anchors)
            q_pos = (anchors[:, None] + slot).flatten()
            kv_pos = torch.cat([torch.arange(t), q_pos])
            hidden = drafter(embed(block), feats[r], q_pos, kv_pos, flat_allow(anchors, t, b))
            logits = lm_head(hidden)                                             # (n*B, V)
            labels = flat_teacher.index_select(0, slot_flat)
            w = slot_w.repeat(n) * flat_mask.index_select(0, slot_flat) * in_row
            ce = F.cross_entropy(logits, labels, reduction="none")
            num, den = num + (ce * w).sum(), den + w.sum()
            hit = (logits.argmax(-1) == labels).float() * (w > 0)
            per_slot_hit.scatter_add_(0, slot.repeat(n), hit)
            per_slot_cnt.scatter_add_(0, slot.repeat(n), (w > 0).float())
        loss = num / den
        opt.zero_grad()
        loss.backward()
        opt.step()
        acc = (per_slot_hit[1:] / per_slot_cnt[1:].clamp(min=1)).tolist()
        print(f"step {step} loss {loss.item():.8f} acc {[round(a, 3) for a in acc]}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({**s, "target_layer_ids": layer_ids, "seed": args.seed}, f, indent=2)
    torch.save(drafter.state_dict(), os.path.join(args.out, "drafter.pt"))


if __name__ == "__main__":
    main()
