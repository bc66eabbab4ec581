#!/usr/bin/env python
"""Train a DFlash block drafter against a tiny Qwen3 target. One script, one main(), no framework.

    python train.py --steps 2
"""

import argparse
import json
import math
import os
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-layers", type=int, default=10)
    ap.add_argument("--num-taps", type=int, default=4, help="target layers fed to fc")
    ap.add_argument("--hs-offset", type=int, default=0,
                    help="index in HF hidden_states of the first decoder layer's output")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=6)
    ap.add_argument("--gamma", type=float, default=7.0)
    ap.add_argument("--max-anchors", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=10)
    ap.add_argument("--num-samples", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=96)
    ap.add_argument("--mask-token-id", type=int, default=95)
    ap.add_argument("--out", default="run_out")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "t02_argparse_inline"))
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    H, B, V, L = args.hidden, args.block_size, args.vocab, args.target_layers
    heads, kv_heads, head_dim = 4, 2, H // 4

    # --- target: build once, save, load like any checkpoint
    tdir = os.path.join(args.workdir, f"target_L{L}")
    if not os.path.exists(os.path.join(tdir, "config.json")):
        torch.manual_seed(777)
        Qwen3ForCausalLM(Qwen3Config(hidden_size=H, intermediate_size=2 * H, num_attention_heads=heads,
                                     num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=L,
                                     vocab_size=V, max_position_embeddings=256,
                                     tie_word_embeddings=False)).save_pretrained(tdir)
        torch.manual_seed(args.seed)
    target = Qwen3ForCausalLM.from_pretrained(tdir, torch_dtype=torch.float32).eval().requires_grad_(False)

    # --- which target layers the drafter reads
    k = args.num_taps
    taps = [L // 2] if k == 1 else [int(round(1 + i * (L - 4) / (k - 1))) for i in range(k)]

    # --- data: random prompts, answers written by the target, loss on the answer only
    with torch.no_grad():
        prompts = torch.randint(0, args.mask_token_id, (args.num_samples, args.prompt_len), generator=g)
        n_new = args.seq_len - args.prompt_len
        ids = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n_new,
                              min_new_tokens=n_new, do_sample=False, pad_token_id=0)[:, : args.seq_len]
        loss_mask = torch.zeros_like(ids, dtype=torch.float32)
        loss_mask[:, args.prompt_len:] = 1
        hs = target(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[t + args.hs_offset] for t in taps], dim=-1)  # (N, T, k*H)
    T = ids.shape[1]

    # --- drafter parameters (target embedding and lm_head are borrowed, frozen)
    def make_layer():
        return nn.ModuleDict({
            "ln1": Qwen3RMSNorm(H, eps=1e-6), "ln2": Qwen3RMSNorm(H, eps=1e-6),
            "q": nn.Linear(H, heads * head_dim, bias=False), "k": nn.Linear(H, kv_heads * head_dim, bias=False),
            "v": nn.Linear(H, kv_heads * head_dim, bias=False), "o": nn.Linear(heads * head_dim, H, bias=False),
            "q_norm": Qwen3RMSNorm(head_dim, eps=1e-6), "k_norm": Qwen3RMSNorm(head_dim, eps=1e-6),
            "gate": nn.Linear(H, 2 * H, bias=False), "up": nn.Linear(H, 2 * H, bias=False),
            "down": nn.Linear(2 * H, H, bias=False)})

    drafter = nn.ModuleDict({"fc": nn.Linear(k * H, H, bias=False), "hidden_norm": Qwen3RMSNorm(H, eps=1e-6),
                             "layers": nn.ModuleList([make_layer() for _ in range(args.draft_layers)]),
                             "norm": Qwen3RMSNorm(H, eps=1e-6)})
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.01)
    embed, lm_head = target.model.embed_tokens, target.lm_head

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))

    def rot(x, pos):  # x (b, h, P, D), pos (b, P)
        ang = pos[:, None, :, None].float() * inv_freq
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        return x * cos + torch.cat([-x[..., head_dim // 2:], x[..., : head_dim // 2]], -1) * sin

    slot = torch.arange(B)
    decay = torch.exp(-(slot - 1).clamp(min=0).float() / args.gamma)  # (B,)

    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "metrics.jsonl"), "w")
    for step in range(args.steps):
        t0 = time.time()
        rows = torch.randperm(args.num_samples, generator=g)[: args.batch_size]
        # anchors: up to max_anchors supervised positions per row, not in the last B, without replacement
        anchors = []
        for r in rows.tolist():
            ok = loss_mask[r].bool().clone()
            ok[-B:] = False
            cand = ok.nonzero().squeeze(-1)
            pick = cand[torch.randperm(cand.numel(), generator=g)[: args.max_anchors]].sort().values
            anchors.append(pick)
        if len({a.numel() for a in anchors}) != 1:
            raise ValueError("rows drew different anchor counts; use rows of equal supervision")
        A = torch.stack(anchors)                                        # (b, n)
        n = A.shape[1]
        bsz = A.shape[0]
        x_ids = torch.full((bsz, n, B), args.mask_token_id, dtype=torch.long)
        x_ids[:, :, 0] = torch.gather(ids[rows], 1, A)
        x = embed(x_ids.view(bsz, n * B))                               # (b, Q, H)
        q_pos = (A[:, :, None] + slot).view(bsz, n * B)
        kv_pos = torch.cat([torch.arange(T).expand(bsz, T), q_pos], 1)
        qa = A.repeat_interleave(B, dim=1)                              # anchor of each query
        qb = torch.arange(n * B) // B
        allow = torch.cat([torch.arange(T)[None, None, :] < qa[:, :, None],
                           (qb[:, None] == qb[None, :]).expand(bsz, -1, -1)], dim=2)[:, None]  # (b,1,Q,T+Q)
        ctx = drafter["hidden_norm"](drafter["fc"](feats[rows]))       # (b, T, H)
        for lyr in drafter["layers"]:
            hn = lyr["ln1"](x)
            q = lyr["q_norm"](lyr["q"](hn).view(bsz, -1, heads, head_dim)).transpose(1, 2)
            kk = lyr["k"](torch.cat([ctx, hn], 1)).view(bsz, -1, kv_heads, head_dim)
            vv = lyr["v"](torch.cat([ctx, hn], 1)).view(bsz, -1, kv_heads, head_dim).transpose(1, 2)
            kk = lyr["k_norm"](kk).transpose(1, 2)
            q, kk = rot(q, q_pos), rot(kk, kv_pos)
            att = F.scaled_dot_product_attention(q, kk, vv, attn_mask=allow, enable_gqa=True)
            x = x + lyr["o"](att.transpose(1, 2).reshape(bsz, n * B, heads * head_dim))
            hn = lyr["ln2"](x)
            x = x + lyr["down"](F.silu(lyr["gate"](hn)) * lyr["up"](hn))
        logits = lm_head(drafter["norm"](x)).view(bsz, n, B, V)

        # labels: slot j of the block at anchor p is the data token p+j
        lab_pos = A[:, :, None] + slot                                  # (b, n, B)
        in_range = lab_pos < T
        lab_pos = lab_pos.clamp(max=T - 1)
        labels = torch.gather(ids[rows][:, None, :].expand(-1, n, -1), 2, lab_pos)
        sup = torch.gather(loss_mask[rows][:, None, :].expand(-1, n, -1), 2, lab_pos) * in_range
        w = sup * decay
        ce = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(bsz, n, B)
        loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            hit = (logits.argmax(-1) == labels).float()
            acc = {f"acc_{j}": float((hit[..., j] * sup[..., j]).sum() / sup[..., j].sum().clamp(min=1))
                   for j in range(1, B)}
        rec = {"step": step, "loss": loss.item(), "sec": round(time.time() - t0, 3), **acc}
        log.write(json.dumps(rec) + "\n")
        print(f"step {step} loss {loss.item():.8f} acc_1 {acc['acc_1']:.4f}", flush=True)
    log.close()
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({**vars(args), "target_layer_ids": taps, "heads": heads, "kv_heads": kv_heads}, f, indent=2)
    torch.save({"state_dict": drafter.state_dict(), "args": vars(args), "target_layer_ids": taps},
               os.path.join(args.out, "drafter.pt"))


if __name__ == "__main__":
    main()
