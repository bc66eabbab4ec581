"""DFlash drafter training written as pure functions over a dict of tensors.

The drafter is a plain pytree {"fc", "hidden_norm", "layers": [...], "norm"}; every piece of the forward pass
is a function of (params, inputs). Only the drafter's leaves are optimised; the target's embedding and
lm_head are used read-only.

    python train.py --steps 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

CONFIG = {
    "target_layers": 8, "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "intermediate": 64,
    "vocab": 96, "mask_token_id": 95, "draft_layers": 2, "num_taps": 3, "block_size": 4, "gamma": 4.0,
    "max_anchors": 8, "seq_len": 40, "prompt_len": 8, "num_samples": 8, "batch_size": 2, "lr": 3e-3,
    "rope_theta": 10000.0, "eps": 1e-6,
}


# ----------------------------------------------------------------------------- target and data
def build_target(cfg: dict, path: str) -> Qwen3ForCausalLM:
    """A tiny random Qwen3, saved and loaded back like a real checkpoint."""
    if not os.path.exists(os.path.join(path, "config.json")):
        with torch.random.fork_rng():
            torch.manual_seed(1234)
            _save_new_target(cfg, path)
    target = Qwen3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    target.requires_grad_(False)
    return target


def _save_new_target(cfg: dict, path: str) -> None:
    config = Qwen3Config(hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                         num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                         head_dim=cfg["head_dim"], num_hidden_layers=cfg["target_layers"],
                         vocab_size=cfg["vocab"], max_position_embeddings=256, tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(path)


def select_layers(num_layers: int, k: int) -> list[int]:
    if k == 1:
        return [num_layers // 2]
    return [int(round(1 + i * (num_layers - 4) / (k - 1))) for i in range(k)]


@torch.no_grad()
def make_data(target, cfg: dict, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of random tokens, answers generated greedily by the target (the data the target would write)."""
    n, t, p = cfg["num_samples"], cfg["seq_len"], cfg["prompt_len"]
    prompts = torch.randint(0, cfg["mask_token_id"], (n, p), generator=gen)
    ids = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=t - p,
                          min_new_tokens=t - p, do_sample=False, pad_token_id=0)
    loss_mask = torch.zeros(n, t)
    loss_mask[:, p:] = 1.0
    return ids[:, :t], loss_mask


@torch.no_grad()
def teacher_pass(target, ids: torch.Tensor, taps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    out = target(ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in taps], dim=-1)  # (N, T, k*H)
    return feats, out.logits.argmax(dim=-1)  # (N, T)


# ----------------------------------------------------------------------------- parameters
def init_params(cfg: dict, gen: torch.Generator) -> dict:
    h, d, hq, hk, m = cfg["hidden"], cfg["head_dim"], cfg["heads"], cfg["kv_heads"], cfg["intermediate"]

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return (torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)).requires_grad_()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n).requires_grad_()

    layers = [{"ln1": ones(h), "ln2": ones(h), "q": lin(hq * d, h), "k": lin(hk * d, h), "v": lin(hk * d, h),
               "o": lin(h, hq * d), "q_norm": ones(d), "k_norm": ones(d), "gate": lin(m, h), "up": lin(m, h),
               "down": lin(h, m)} for _ in range(cfg["draft_layers"])]
    return {"fc": lin(h, cfg["num_taps"] * h), "hidden_norm": ones(h), "layers": layers, "norm": ones(h)}


def leaves(params: dict) -> list[torch.Tensor]:
    out = [params["fc"], params["hidden_norm"], params["norm"]]
    for layer in params["layers"]:
        out += list(layer.values())
    return out


# ----------------------------------------------------------------------------- the drafter as functions
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x: (heads, P, D); pos: (P,). Half-split (neox) rotation, as in HF Qwen3."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(p: dict, x: torch.Tensor, ctx: torch.Tensor, q_pos, kv_pos, mask, cfg: dict) -> torch.Tensor:
    """x: (Q, H) block tokens; ctx: (T, H) fused context. Keys/values = [context ; block]."""
    d, hq, hk = cfg["head_dim"], cfg["heads"], cfg["kv_heads"]
    q = (x @ p["q"].T).view(-1, hq, d).transpose(0, 1)                        # (hq, Q, D)
    k = torch.cat([ctx @ p["k"].T, x @ p["k"].T]).view(-1, hk, d).transpose(0, 1)  # (hk, T+Q, D)
    v = torch.cat([ctx @ p["v"].T, x @ p["v"].T]).view(-1, hk, d).transpose(0, 1)
    q = rope(rms_norm(q, p["q_norm"], cfg["eps"]), q_pos, cfg["rope_theta"])
    k = rope(rms_norm(k, p["k_norm"], cfg["eps"]), kv_pos, cfg["rope_theta"])
    k, v = k.repeat_interleave(hq // hk, 0), v.repeat_interleave(hq // hk, 0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)             # (hq, Q, D)
    return out.transpose(0, 1).reshape(x.shape[0], hq * d) @ p["o"].T


def decoder_layer(p: dict, x, ctx, q_pos, kv_pos, mask, cfg: dict) -> torch.Tensor:
    x = x + attention(p, rms_norm(x, p["ln1"], cfg["eps"]), ctx, q_pos, kv_pos, mask, cfg)
    hdn = rms_norm(x, p["ln2"], cfg["eps"])
    return x + (F.silu(hdn @ p["gate"].T) * (hdn @ p["up"].T)) @ p["down"].T


def draft_forward(params: dict, embed, feats, block_ids, q_pos, kv_pos, mask, cfg: dict) -> torch.Tensor:
    ctx = rms_norm(feats @ params["fc"].T, params["hidden_norm"], cfg["eps"])  # (T, H)
    x = embed(block_ids)                                                       # (Q, H)
    for p in params["layers"]:
        x = decoder_layer(p, x, ctx, q_pos, kv_pos, mask, cfg)
    return rms_norm(x, params["norm"], cfg["eps"])


# ----------------------------------------------------------------------------- blocks, targets, weights
def choose(n_items: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(torch.ones(n_items), k, replacement=True, generator=gen)


def sample_anchors(loss_mask_row: torch.Tensor, cfg: dict, gen: torch.Generator) -> torch.Tensor:
    valid = loss_mask_row.bool().clone()
    valid[-cfg["block_size"]:] = False
    candidates = valid.nonzero().squeeze(-1)
    k = min(cfg["max_anchors"], candidates.numel())
    return candidates[choose(candidates.numel(), k, gen)].sort().values


def block_mask(anchors: torch.Tensor, t: int, b: int) -> torch.Tensor:
    """(n*B, T + n*B) boolean: context strictly before the anchor, and the block's own slots."""
    n = anchors.numel()
    q_anchor = anchors.repeat_interleave(b)
    ctx_ok = torch.arange(t)[None, :] < q_anchor[:, None]
    q_block = torch.arange(n * b) // b
    blk_ok = q_block[:, None] == q_block[None, :]
    return torch.cat([ctx_ok, blk_ok], dim=1)


def gather_teacher(teacher_row: torch.Tensor, anchors: torch.Tensor, b: int, shift: int = 0) -> torch.Tensor:
    idx = anchors[:, None] + torch.arange(b)[None, :] - shift
    return teacher_row[idx.clamp(0, teacher_row.numel() - 1)]                  # (n, B)


def slot_weights(b: int, gamma: float) -> torch.Tensor:
    k = torch.arange(b, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / gamma)
    w[0] = 0.0
    return w


def row_loss(params, embed, lm_head, feats, ids, teacher, loss_mask, cfg, gen) -> tuple[torch.Tensor, ...]:
    t, b = ids.numel(), cfg["block_size"]
    anchors = sample_anchors(loss_mask, cfg, gen)
    n = anchors.numel()
    block_ids = torch.full((n, b), cfg["mask_token_id"], dtype=torch.long)
    block_ids[:, 0] = ids[anchors]
    q_pos = (anchors[:, None] + torch.arange(b)[None, :]).reshape(-1)
    kv_pos = torch.cat([torch.arange(t), q_pos])
    mask = block_mask(anchors, t, b)
    hidden = draft_forward(params, embed, feats, block_ids.reshape(-1), q_pos, kv_pos, mask, cfg)
    logits = lm_head(hidden).view(n, b, -1)
    labels = gather_teacher(teacher, anchors, b)
    label_pos = anchors[:, None] + torch.arange(b)[None, :]
    supervised = loss_mask[label_pos.clamp(max=t - 1)] * (label_pos < t).float()
    w = slot_weights(b, cfg["gamma"])[None, :] * supervised
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(n, b)
    correct = ((logits.argmax(-1) == labels).float() * (w > 0)).sum()
    return (ce * w).sum(), w.sum(), correct, (w > 0).sum()


# ----------------------------------------------------------------------------- training
def train(steps: int, seed: int, out_dir: str, workdir: str) -> list[float]:
    cfg = dict(CONFIG)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    target = build_target(cfg, os.path.join(workdir, "target"))
    taps = select_layers(cfg["target_layers"], cfg["num_taps"])
    ids, loss_mask = make_data(target, cfg, gen)
    feats, teacher = teacher_pass(target, ids, taps)
    embed, lm_head = target.model.embed_tokens, target.lm_head
    params = init_params(cfg, gen)
    opt = torch.optim.AdamW(leaves(params), lr=cfg["lr"], weight_decay=0.0)
    history = []
    for step in range(steps):
        rows = torch.randperm(cfg["num_samples"], generator=gen)[: cfg["batch_size"]]
        num, den, correct, count = 0.0, 0.0, 0.0, 0.0
        for r in rows.tolist():
            a, b_, c, d = row_loss(params, embed, lm_head, feats[r], ids[r], teacher[r], loss_mask[r], cfg, gen)
            num, den, correct, count = num + a, den + b_, correct + c, count + d
        loss = num / den.clamp(min=1e-6)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(leaves(params), 1.0)
        opt.step()
        history.append(loss.item())
        print(f"step {step} loss {loss.item():.8f} acc {float(correct / max(float(count), 1.0)):.4f}", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**cfg, "target_layer_ids": taps, "steps": steps, "seed": seed}, f, indent=2)
    torch.save({"params": params, "config": cfg, "target_layer_ids": taps}, os.path.join(out_dir, "drafter.pt"))
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="run_out")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "t01_functional"))
    args = parser.parse_args()
    train(args.steps, args.seed, args.out, args.workdir)


if __name__ == "__main__":
    main()
