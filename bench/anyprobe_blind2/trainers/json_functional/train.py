#!/usr/bin/env python
"""DFlash drafter trainer, functional style driven by a nested JSON config.

The drafter is a plain dict of tensors (no nn.Module); ``draft_forward(P, ...)`` is a pure
function.  All knobs live in dflash.json (nested sections run/target/draft/loss/optim/data);
``--set section.key=value`` overrides them.  Labels are the data tokens (SpecForge style).
"""
import argparse
import copy
import json
import math
import os
import tempfile

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(1)


# ------------------------------------------------------------------ config
def load_config(path, overrides=()):
    with open(path) as f:
        cfg = json.load(f)
    for item in overrides:
        key, val = item.split("=", 1)
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = json.loads(val)
    return cfg


def resolve_layer_ids(num_layers, num_taps):
    if num_taps == 1:
        return [num_layers // 2]
    span = num_layers - 4
    return [round(1 + i * span / (num_taps - 1)) for i in range(num_taps)]


# ------------------------------------------------------------------ target side
def build_target(tcfg, workdir):
    hf = Qwen3Config(
        vocab_size=tcfg["vocab_size"], hidden_size=tcfg["hidden_size"],
        intermediate_size=tcfg["intermediate_size"], num_hidden_layers=tcfg["num_hidden_layers"],
        num_attention_heads=tcfg["num_attention_heads"], num_key_value_heads=tcfg["num_key_value_heads"],
        head_dim=tcfg["head_dim"], rope_parameters={"rope_type": "default", "rope_theta": tcfg["rope_theta"]},
        max_position_embeddings=256, tie_word_embeddings=False)
    path = os.path.join(workdir, "tiny_qwen3")
    Qwen3ForCausalLM(hf).save_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path).eval()
    model.requires_grad_(False)
    return model, path


def tap_features(hidden_states, layer_ids):
    """Concatenate the selected layers. hidden_states: the tuple from output_hidden_states=True."""
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


# ------------------------------------------------------------------ drafter (pure functions)
def init_params(cfg, gen):
    t, d = cfg["target"], cfg["draft"]
    H, hd = t["hidden_size"], t["head_dim"]
    nq, nkv, I = t["num_attention_heads"], t["num_key_value_heads"], d["intermediate_size"]

    def lin(o, i):
        return (torch.randn(o, i, generator=gen) / math.sqrt(i)).requires_grad_()

    P = {"fc": lin(H, t["num_taps"] * H), "hidden_norm": torch.ones(H, requires_grad=True),
         "norm": torch.ones(H, requires_grad=True)}
    for l in range(d["num_layers"]):
        P.update({
            f"{l}.ln1": torch.ones(H, requires_grad=True), f"{l}.ln2": torch.ones(H, requires_grad=True),
            f"{l}.q": lin(nq * hd, H), f"{l}.k": lin(nkv * hd, H), f"{l}.v": lin(nkv * hd, H),
            f"{l}.o": lin(H, nq * hd), f"{l}.qn": torch.ones(hd, requires_grad=True),
            f"{l}.kn": torch.ones(hd, requires_grad=True),
            f"{l}.gate": lin(I, H), f"{l}.up": lin(I, H), f"{l}.down": lin(H, I)})
    return P


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    ang = pos[:, None, :, None].float() * freq
    x1, x2 = x[..., :half], x[..., half:]
    c, s = ang.cos(), ang.sin()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def draft_forward(P, cfg, frozen, taps, block_ids, q_pos, k_pos, mask):
    t = cfg["target"]
    nq, nkv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    ctx = rms(taps @ P["fc"].T, P["hidden_norm"])
    x = F.embedding(block_ids, frozen["embed"])
    b, S, _ = x.shape
    T = ctx.shape[1]
    for l in range(cfg["draft"]["num_layers"]):
        h = rms(x, P[f"{l}.ln1"])
        q = (h @ P[f"{l}.q"].T).view(b, S, nq, hd).transpose(1, 2)
        kv_in = torch.cat([ctx, h], 1)                     # context first, then block tokens
        k = (kv_in @ P[f"{l}.k"].T).view(b, T + S, nkv, hd).transpose(1, 2)
        v = (kv_in @ P[f"{l}.v"].T).view(b, T + S, nkv, hd).transpose(1, 2)
        q = rope(rms(q, P[f"{l}.qn"]), q_pos, t["rope_theta"])
        k = rope(rms(k, P[f"{l}.kn"]), k_pos, t["rope_theta"])
        k = k.repeat_interleave(nq // nkv, 1)
        v = v.repeat_interleave(nq // nkv, 1)
        s = (q @ k.transpose(-1, -2)) * hd ** -0.5
        s = s.masked_fill(~mask[:, None], float("-inf"))
        o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, S, nq * hd)
        x = x + o @ P[f"{l}.o"].T
        h = rms(x, P[f"{l}.ln2"])
        x = x + (F.silu(h @ P[f"{l}.gate"].T) * (h @ P[f"{l}.up"].T)) @ P[f"{l}.down"].T
    return rms(x, P["norm"]) @ frozen["lm_head"].T


# ------------------------------------------------------------------ objective pieces
def sample_anchors(loss_mask, B, max_anchors, gen):
    T = loss_mask.shape[1]
    rows = []
    for r in range(loss_mask.shape[0]):
        cand = torch.nonzero(loss_mask[r, : T - B]).flatten()
        rows.append(cand[torch.randperm(len(cand), generator=gen)[:max_anchors]].sort().values)
    n = min(len(x) for x in rows)
    return torch.stack([x[:n] for x in rows])


def block_layout(anchors, T, B):
    b, N = anchors.shape
    pos = (anchors[:, :, None] + torch.arange(B)).reshape(b, N * B)     # anchor + j
    a_of_q = anchors.repeat_interleave(B, 1)
    ctx_vis = torch.arange(T)[None, None, :] < a_of_q[:, :, None]
    bid = torch.arange(N).repeat_interleave(B)
    own = (bid[:, None] == bid[None, :]).expand(b, -1, -1)
    k_pos = torch.cat([torch.arange(T).expand(b, T), pos], 1)
    return pos, k_pos, torch.cat([ctx_vis, own], -1)


def slot_weights(loss_cfg, B):
    gamma = float(loss_cfg.get("decay_gamma", 1.0))
    k = torch.arange(B, dtype=torch.float32)
    w = torch.exp(-(k - 1.0) / gamma)
    w[0] = 0.0
    return w


def dflash_loss(logits, labels, valid, w):
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    ww = w.repeat(labels.shape[1] // w.numel())[None] * valid
    return (ce * ww).sum() / ww.sum().clamp_min(1e-6)


# ------------------------------------------------------------------ main
def make_data(dcfg, vocab, mask_id, gen):
    b, T = dcfg["batch"], dcfg["seq_len"]
    ids = torch.randint(0, vocab - 1, (b, T), generator=gen)
    ids = torch.where(ids == mask_id, torch.zeros_like(ids), ids)
    lo, hi = dcfg["prompt_len"]
    plen = torch.randint(lo, hi, (b, 1), generator=gen)
    loss_mask = (torch.arange(T)[None] >= plen).long()
    return ids, loss_mask


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="dflash.json")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args()
    cfg = load_config(a.config, a.set)
    if a.steps is not None:
        cfg["run"]["steps"] = a.steps
    T_cfg, D_cfg = cfg["target"], cfg["draft"]
    cfg["target"]["layer_ids"] = resolve_layer_ids(T_cfg["num_hidden_layers"], T_cfg["num_taps"])

    gen = torch.Generator().manual_seed(cfg["run"]["seed"])
    torch.manual_seed(cfg["run"]["seed"])
    work = tempfile.mkdtemp(prefix="dflash_json_", dir=os.environ.get("TMPDIR"))
    target, tpath = build_target(T_cfg, work)
    cfg["target"]["path"] = tpath
    out_dir = cfg["run"]["out_dir"]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)

    frozen = {"embed": target.model.embed_tokens.weight.detach().clone(),
              "lm_head": target.lm_head.weight.detach().clone()}       # never handed to the optimizer
    P = init_params(cfg, gen)
    opt = torch.optim.AdamW(list(P.values()), lr=cfg["optim"]["lr"], weight_decay=cfg["optim"]["weight_decay"])
    B, mask_id = D_cfg["block_size"], D_cfg["mask_token_id"]
    w = slot_weights(cfg["loss"], B)
    ids, loss_mask = make_data(cfg["data"], T_cfg["vocab_size"], mask_id, gen)
    T = ids.shape[1]
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        taps = tap_features(hs, cfg["target"]["layer_ids"])
    for step in range(cfg["run"]["steps"]):
        anchors = sample_anchors(loss_mask, B, cfg["data"]["max_anchors"], gen)
        pos, k_pos, mask = block_layout(anchors, T, B)
        block_ids = torch.full_like(pos, mask_id)
        block_ids[:, ::B] = ids.gather(1, anchors)
        logits = draft_forward(P, cfg, frozen, taps, block_ids, pos, k_pos, mask)
        labels = ids.gather(1, pos)                      # slot j of anchor p -> data token p+j
        valid = loss_mask.gather(1, pos).float()
        loss = dflash_loss(logits, labels, valid, w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
