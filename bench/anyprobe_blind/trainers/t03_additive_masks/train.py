"""DFlash drafter on packed rows, attention masks as additive float biases (0 / -inf) fed to SDPA.

Each training row packs several documents; positions restart at every document; the drafter's queries are
the anchored blocks of the row, its keys and values the fused target features of the row followed by the
blocks' own tokens.

    python train.py --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

NEG_INF = float("-inf")


@dataclass
class Setup:
    target_layers: int = 8
    num_taps: int = 3
    hidden: int = 32
    vocab: int = 96
    mask_token_id: int = 95
    draft_layers: int = 2
    block_size: int = 4
    gamma: float = 7.0
    max_anchors: int = 8          # per packed row
    doc_lens: tuple = (20, 28)    # documents packed into one row
    prompt_len: int = 6
    num_rows: int = 6
    rows_per_step: int = 2
    lr: float = 3e-3
    seed: int = 0


def qwen3_config(s: Setup, layers: int) -> Qwen3Config:
    return Qwen3Config(hidden_size=s.hidden, intermediate_size=2 * s.hidden, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=s.hidden // 4, num_hidden_layers=layers,
                       vocab_size=s.vocab, max_position_embeddings=256, tie_word_embeddings=False)


def load_target(s: Setup, path: str) -> Qwen3ForCausalLM:
    if not os.path.exists(os.path.join(path, "config.json")):
        with torch.random.fork_rng():
            torch.manual_seed(4321)
            Qwen3ForCausalLM(qwen3_config(s, s.target_layers)).save_pretrained(path)
    return Qwen3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval().requires_grad_(False)


def tap_layers(num_layers: int, k: int) -> list[int]:
    return [num_layers // 2] if k == 1 else [round(1 + i * (num_layers - 4) / (k - 1)) for i in range(k)]


@torch.no_grad()
def packed_rows(target, s: Setup, taps: list[int], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Documents written by the target, each run through it on its own, then packed side by side."""
    rows = {"ids": [], "loss_mask": [], "feats": [], "teacher": [], "doc": [], "pos": []}
    for _ in range(s.num_rows):
        parts = {k: [] for k in rows}
        for d, n in enumerate(s.doc_lens):
            prompt = torch.randint(0, s.mask_token_id, (1, s.prompt_len), generator=gen)
            ids = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n - s.prompt_len,
                                  min_new_tokens=n - s.prompt_len, do_sample=False, pad_token_id=0)[0, :n]
            out = target(ids[None], output_hidden_states=True)
            mask = torch.zeros(n)
            mask[s.prompt_len:] = 1
            parts["ids"].append(ids)
            parts["loss_mask"].append(mask)
            parts["feats"].append(torch.cat([out.hidden_states[i + 1][0] for i in taps], -1))
            parts["teacher"].append(out.logits[0].argmax(-1))
            parts["doc"].append(torch.full((n,), d))
            parts["pos"].append(torch.arange(n))
        for k in rows:
            rows[k].append(torch.cat(parts[k]))
    return {k: torch.stack(v) for k, v in rows.items()}


class BlockAttention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.hd, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.hd, eps=cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, bias):
        """x (1, Q, H) block tokens, ctx (1, T, H) fused context, bias (Q, T+Q) additive."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.nh, self.hd))).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)
        k = self.k_norm(self.k_proj(kv_in).unflatten(-1, (self.nkv, self.hd))).transpose(1, 2)
        v = self.v_proj(kv_in).unflatten(-1, (self.nkv, self.hd)).transpose(1, 2)
        (cq, sq), (ck, sk) = rope_q, rope_kv
        q = q * cq[:, None] + rotate_half(q) * sq[:, None]
        k = k * ck[:, None] + rotate_half(k) * sk[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DraftLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = BlockAttention(cfg)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, x, ctx, rope_q, rope_kv, bias):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, bias)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, cfg: Qwen3Config, num_taps: int):
        super().__init__()
        self.fc = nn.Linear(num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(cfg)

    def forward(self, x, feats, q_pos, kv_pos, bias):
        ctx = self.hidden_norm(self.fc(feats))
        rope_q, rope_kv = self.rotary(x, q_pos[None]), self.rotary(x, kv_pos[None])
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_kv, bias)
        return self.norm(x)


def pick_anchors(loss_mask: torch.Tensor, s: Setup, gen: torch.Generator) -> torch.Tensor:
    ok = loss_mask.bool().clone()
    ok[-s.block_size:] = False
    cand = ok.nonzero().squeeze(-1)
    return cand[torch.randperm(cand.numel(), generator=gen)[: s.max_anchors]].sort().values


def additive_bias(anchors: torch.Tensor, doc: torch.Tensor, b: int) -> torch.Tensor:
    """(n*B, T + n*B): 0 where a query may look, -inf elsewhere."""
    t, n = doc.numel(), anchors.numel()
    q_anchor = anchors.repeat_interleave(b)
    q_doc = doc[q_anchor]
    kv = torch.arange(t)
    ctx_ok = (kv[None, :] < q_anchor[:, None]) & (doc[None, :] <= q_doc[:, None])
    q_blk = torch.arange(n * b) // b
    blk_ok = q_blk[:, None] == q_blk[None, :]
    zero, neg = torch.zeros(()), torch.tensor(NEG_INF)
    return torch.cat([torch.where(ctx_ok, zero, neg), torch.where(blk_ok, zero, neg)], dim=1)


def row_objective(drafter, embed, lm_head, row: dict, s: Setup, gen) -> tuple[torch.Tensor, torch.Tensor]:
    b, t = s.block_size, row["ids"].numel()
    anchors = pick_anchors(row["loss_mask"], s, gen)
    n = anchors.numel()
    slots = torch.arange(b)
    block = torch.full((n, b), s.mask_token_id, dtype=torch.long)
    block[:, 0] = row["ids"][anchors]
    q_pos = (row["pos"][anchors][:, None] + slots).reshape(-1)
    kv_pos = torch.cat([row["pos"], q_pos])
    bias = additive_bias(anchors, row["doc"], b)
    hidden = drafter(embed(block.reshape(1, -1)), row["feats"][None], q_pos, kv_pos, bias)
    logits = lm_head(hidden)[0].view(n, b, -1)
    at = anchors[:, None] + slots                                   # packed index of each slot's token
    labels = row["teacher"][(at - 1).clamp(min=0)]                  # target's prediction for token at
    same_doc = row["doc"][at.clamp(max=t - 1)] == row["doc"][anchors][:, None]
    keep = (at < t) & same_doc & (slots > 0)
    w = keep.float() * row["loss_mask"][at.clamp(max=t - 1)] * torch.exp(-(slots - 1).clamp(min=0) / s.gamma)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(n, b)
    return (ce * w).sum(), w.sum()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="run_out")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "t03_additive_masks"))
    a = ap.parse_args()
    s = Setup(seed=a.seed)
    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    target = load_target(s, os.path.join(a.workdir, "target"))
    taps = tap_layers(s.target_layers, s.num_taps)
    data = packed_rows(target, s, taps, gen)
    drafter = Drafter(qwen3_config(s, s.draft_layers), len(taps))
    opt = torch.optim.AdamW(drafter.parameters(), lr=s.lr)
    for step in range(a.steps):
        rows = torch.randperm(s.num_rows, generator=gen)[: s.rows_per_step].tolist()
        num = den = torch.zeros(())
        for r in rows:
            n_, d_ = row_objective(drafter, target.model.embed_tokens, target.lm_head,
                                   {k: v[r] for k, v in data.items()}, s, gen)
            num, den = num + n_, den + d_
        loss = num / den.clamp(min=1e-6)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.8f}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump({**asdict(s), "target_layer_ids": taps}, f, indent=2)
    torch.save({"state_dict": drafter.state_dict(), "setup": asdict(s)}, os.path.join(a.out, "drafter.pt"))


if __name__ == "__main__":
    main()
