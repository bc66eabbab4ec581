#!/usr/bin/env python
"""DFlash drafter training, "objective-as-a-module" style.

Everything lives in one nn.Module: ``DFlashObjective.forward(input_ids, loss_mask)``
runs the frozen target, samples anchors, builds block inputs, position ids and the
attention mask, runs the drafter layers and returns ``(loss, metrics)``.  The training
loop outside is three lines.
"""
import argparse
import json
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(1)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, pos, theta):
    """Neox-style RoPE. x: [b, h, s, d], pos: [b, s]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None, :, None] * inv          # [b, 1, s, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class DFlashObjective(nn.Module):
    """Drafter + frozen target + DFlash loss in one module."""

    def __init__(self, target, block_size=4, n_draft_layers=2, n_taps=3, gamma=4.0,
                 max_anchors=4, mask_token_id=None, draft_intermediate=96, seed=0):
        super().__init__()
        tc = target.config
        self.target = target.eval().requires_grad_(False)   # embed + lm_head come from here, frozen
        self.B, self.gamma, self.max_anchors = block_size, gamma, max_anchors
        self.mask_token_id = tc.vocab_size - 1 if mask_token_id is None else mask_token_id
        L = tc.num_hidden_layers
        if n_taps == 1:
            self.layer_ids = [L // 2]
        else:
            self.layer_ids = [round(1 + i * (L - 4) / (n_taps - 1)) for i in range(n_taps)]
        H = tc.hidden_size
        self.nh, self.nkv, self.hd = tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim
        self.theta = float(tc.rope_parameters["rope_theta"])
        self.fc = nn.Linear(n_taps * H, H, bias=False)
        self.hidden_norm = RMSNorm(H)
        self.layers = nn.ModuleList()
        for _ in range(n_draft_layers):
            self.layers.append(nn.ModuleDict(dict(
                ln1=RMSNorm(H), ln2=RMSNorm(H),
                q=nn.Linear(H, self.nh * self.hd, bias=False),
                k=nn.Linear(H, self.nkv * self.hd, bias=False),
                v=nn.Linear(H, self.nkv * self.hd, bias=False),
                o=nn.Linear(self.nh * self.hd, H, bias=False),
                q_norm=RMSNorm(self.hd), k_norm=RMSNorm(self.hd),
                gate=nn.Linear(H, draft_intermediate, bias=False),
                up=nn.Linear(H, draft_intermediate, bias=False),
                down=nn.Linear(draft_intermediate, H, bias=False),
            )))
        self.norm = RMSNorm(H)
        self.gen = torch.Generator().manual_seed(seed)

    # ---------------------------------------------------------------- helpers
    def _slot_offsets(self):
        """Offset of every block slot from its anchor: 0 (anchor), 1, ..., B-1."""
        return torch.arange(self.B)

    def _target_index(self, anchors):
        """Index into the target's per-position predictions for every block slot."""
        return anchors[..., None] + self._slot_offsets()

    def _slot_weights(self):
        k = self._slot_offsets().float()
        w = torch.exp(-(k - 1) / self.gamma)
        w[0] = 0.0                                   # the anchor slot is given, not predicted
        return w

    @staticmethod
    def _ctx_ok(k_pos, a_pos, include_anchor=True):
        """Is context position k visible to the block anchored at a?"""
        last = a_pos if include_anchor else a_pos - 1
        return k_pos <= last

    def _sample_anchors(self, loss_mask):
        b, T = loss_mask.shape
        ok = loss_mask.bool().clone()
        ok[:, T - self.B:] = False                   # a block must fit in the sequence
        picks = []
        for r in range(b):
            cand = ok[r].nonzero().squeeze(-1)
            sel = cand[torch.randperm(cand.numel(), generator=self.gen)[: self.max_anchors]]
            picks.append(sel.sort().values)
        n = min(p.numel() for p in picks)
        return torch.stack([p[:n] for p in picks])    # [b, N]

    def _mask(self, anchors, T):
        b, N = anchors.shape
        a_q = anchors.repeat_interleave(self.B, dim=1)                 # [b, N*B]
        ctx = self._ctx_ok(torch.arange(T)[None, None, :], a_q[:, :, None])
        bq = torch.arange(N).repeat_interleave(self.B)
        own = (bq[:, None] == bq[None, :]).expand(b, -1, -1)            # bidirectional in-block
        return torch.cat([ctx, own], dim=-1)                           # [b, N*B, T + N*B]

    def _layer(self, p, x, ctx, q_pos, k_pos, mask):
        b, S, _ = x.shape
        T = ctx.shape[1]
        h = p["ln1"](x)
        q = p["q"](h).view(b, S, self.nh, self.hd).transpose(1, 2)
        k = torch.cat([p["k"](ctx), p["k"](h)], 1).view(b, T + S, self.nkv, self.hd).transpose(1, 2)
        v = torch.cat([p["v"](ctx), p["v"](h)], 1).view(b, T + S, self.nkv, self.hd).transpose(1, 2)
        q = rotate(p["q_norm"](q), q_pos, self.theta)
        k = rotate(p["k_norm"](k), k_pos, self.theta)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = (q @ k.transpose(-1, -2)) / self.hd ** 0.5
        att = att.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(b, S, self.nh * self.hd)
        x = x + p["o"](o)
        h = p["ln2"](x)
        return x + p["down"](F.silu(p["gate"](h)) * p["up"](h))

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, loss_mask):
        b, T = input_ids.shape
        with torch.no_grad():
            out = self.target(input_ids=input_ids, output_hidden_states=True)
            taps = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
            pred = out.logits.argmax(-1)             # pred[t] = target's choice for token t+1
        ctx = self.hidden_norm(self.fc(taps))

        anchors = self._sample_anchors(loss_mask)   # [b, N]
        N = anchors.shape[1]
        slot_pos = anchors[..., None] + self._slot_offsets()            # [b, N, B]
        blk = torch.full((b, N, self.B), self.mask_token_id, dtype=torch.long)
        blk[..., 0] = input_ids.gather(1, anchors)
        x = self.target.model.embed_tokens(blk.flatten(1))
        q_pos = slot_pos.flatten(1)
        k_pos = torch.cat([torch.arange(T).expand(b, T), q_pos], 1)
        mask = self._mask(anchors, T)
        for p in self.layers:
            x = self._layer(p, x, ctx, q_pos, k_pos, mask)
        logits = self.target.lm_head(self.norm(x)).view(b, N, self.B, -1)

        labels = pred.gather(1, self._target_index(anchors).flatten(1)).view(b, N, self.B)
        valid = loss_mask.gather(1, slot_pos.flatten(1)).view(b, N, self.B).float()
        w = self._slot_weights() * valid
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(b, N, self.B)
        loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
        acc = ((logits.argmax(-1) == labels).float() * (valid > 0))[..., 1:]
        metrics = {f"position_{k + 1}_acc": (acc[..., k].sum() / valid[..., k + 1].sum().clamp_min(1)).item()
                   for k in range(self.B - 1)}
        return loss, metrics


def make_target(run_dir, layers=8, hidden=48, vocab=112, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=96,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=12, max_position_embeddings=256, tie_word_embeddings=False)
    path = os.path.join(run_dir, "target")
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return Qwen3ForCausalLM.from_pretrained(path), path


def make_batch(g, b, T, vocab, mask_token_id):
    ids = torch.randint(0, vocab, (b, T), generator=g)
    ids[ids == mask_token_id] = 0
    lm = torch.zeros(b, T, dtype=torch.long)
    for r in range(b):
        plen = int(torch.randint(4, 9, (1,), generator=g))
        lm[r, plen:] = 1                             # answer tokens are supervised
    return ids, lm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default="run_out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="dflash_mono_", dir=os.environ.get("TMPDIR"))
    target, tpath = make_target(tmp)
    obj = DFlashObjective(target, block_size=args.block_size, gamma=args.gamma)
    cfg = dict(target=tpath, target_layers=target.config.num_hidden_layers, block_size=obj.B,
               gamma=obj.gamma, target_layer_ids=obj.layer_ids, mask_token_id=obj.mask_token_id,
               max_anchors=obj.max_anchors, draft_layers=len(obj.layers), loss="ce_target_argmax",
               lr=args.lr, steps=args.steps)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    opt = torch.optim.AdamW([p for p in obj.parameters() if p.requires_grad], lr=args.lr)
    g = torch.Generator().manual_seed(1)
    ids, lm = make_batch(g, 2, 32, target.config.vocab_size, obj.mask_token_id)   # one batch, overfit
    for step in range(args.steps):
        loss, m = obj(ids, lm)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f} pos1_acc {m['position_1_acc']:.3f}")


if __name__ == "__main__":
    main()
