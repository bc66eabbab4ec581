"""DFlash drafter as a Lightning-style module (training_step / configure_optimizers / hooks) driven by a
twenty-line trainer; no Lightning dependency.

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
from torch.utils.data import DataLoader, Dataset
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

HPARAMS = {"target_layers": 8, "num_taps": 4, "hidden": 32, "vocab": 96, "mask_token_id": 95, "draft_layers": 2,
           "block_size": 4, "gamma": 4.0, "max_anchors": 8, "seq_len": 40, "prompt_len": 6, "samples": 8,
           "batch_size": 2, "lr": 3e-3}


def qwen3(h: dict, layers: int) -> Qwen3Config:
    return Qwen3Config(hidden_size=h["hidden"], intermediate_size=2 * h["hidden"], num_attention_heads=4,
                       num_key_value_heads=2, head_dim=h["hidden"] // 4, num_hidden_layers=layers,
                       vocab_size=h["vocab"], max_position_embeddings=256, tie_word_embeddings=False)


class PromptAnswers(Dataset):
    """Prompts of random tokens with answers the target writes; loss on the answer."""

    def __init__(self, target, h: dict, gen: torch.Generator):
        with torch.no_grad():
            p = torch.randint(0, h["mask_token_id"], (h["samples"], h["prompt_len"]), generator=gen)
            new = h["seq_len"] - h["prompt_len"]
            self.ids = target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=new,
                                       min_new_tokens=new, do_sample=False, pad_token_id=0)[:, : h["seq_len"]]
        self.loss_mask = torch.zeros(self.ids.shape)
        self.loss_mask[:, h["prompt_len"]:] = 1

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "loss_mask": self.loss_mask[i]}


class Attention(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm, self.k_norm = Qwen3RMSNorm(self.hd, c.rms_norm_eps), Qwen3RMSNorm(self.hd, c.rms_norm_eps)

    def forward(self, x, ctx, cs_q, cs_kv, bias):
        b, q_len, _ = x.shape
        both = torch.cat([ctx, x], 1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(b, both.shape[1], self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(both).view(b, both.shape[1], self.nkv, self.hd).transpose(1, 2)
        q = q * cs_q[0][:, None] + rotate_half(q) * cs_q[1][:, None]
        k = k * cs_kv[0][:, None] + rotate_half(k) * cs_kv[1][:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, q_len, -1))


class Layer(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Qwen3MLP(c)

    def forward(self, x, ctx, cs_q, cs_kv, bias):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cs_q, cs_kv, bias)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModule(nn.Module):
    def __init__(self, h: dict, target: Qwen3ForCausalLM, generator: torch.Generator):
        super().__init__()
        self.h, self.gen = h, generator
        self.target = target
        n, k = h["target_layers"], h["num_taps"]
        self.layer_ids = [n // 2] if k == 1 else [int(round(1 + i * (n - 4) / (k - 1))) for i in range(k)]
        c = qwen3(h, h["draft_layers"])
        self.fc = nn.Linear(k * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(c)

    # hooks -----------------------------------------------------------------
    def on_train_start(self) -> None:
        self.target.requires_grad_(False).eval()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW((p for n, p in self.named_parameters()
                                  if p.requires_grad and not n.startswith("target.")), lr=self.h["lr"])

    # steps -------------------------------------------------------------------
    @torch.no_grad()
    def teacher(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.target(ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], -1)
        top1 = out.logits.argmax(-1)
        return feats, F.pad(top1[:, :-1], (1, 0))          # [p] -> the target's prediction for token p

    def anchors(self, loss_mask: torch.Tensor) -> torch.Tensor:
        b = self.h["block_size"]
        ok = loss_mask.bool().clone()
        ok[:, -b:] = False
        score = torch.rand(ok.shape, generator=self.gen).masked_fill(~ok, float("-inf"))
        k = self.h["max_anchors"]
        if int(ok.sum(1).min()) < k:
            raise ValueError(f"every row needs at least max_anchors={k} anchor candidates")
        return score.topk(k, dim=1).indices.sort(dim=1).values

    def bias(self, anchors: torch.Tensor, t: int) -> torch.Tensor:
        b = self.h["block_size"]
        bsz, n = anchors.shape
        q_anchor = anchors.repeat_interleave(b, 1)[..., None]                 # (bsz, Q, 1)
        ctx_ok = ~(torch.arange(t)[None, None] >= q_anchor)
        qb = torch.arange(n * b) // b
        blk_ok = (qb[:, None] == qb[None]).expand(bsz, -1, -1)
        blocked = 1.0 - torch.cat([ctx_ok, blk_ok], -1).float()
        return (blocked * -1e9)[:, None]

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        bsz, t = ids.shape
        b, slot = self.h["block_size"], torch.arange(self.h["block_size"])
        feats, predicted = self.teacher(ids)
        anchors = self.anchors(loss_mask)
        n = anchors.shape[1]
        tok = torch.full((bsz, n, b), self.h["mask_token_id"])
        tok[..., 0] = ids.gather(1, anchors)
        pos = (anchors[..., None] + slot).flatten(1)
        kv_pos = torch.cat([torch.arange(t).expand(bsz, t), pos], 1)
        x = self.target.model.embed_tokens(tok.flatten(1))
        ctx = self.hidden_norm(self.fc(feats))
        cs_q, cs_kv = self.rotary(x, pos), self.rotary(x, kv_pos)
        bias = self.bias(anchors, t)
        for layer in self.layers:
            x = layer(x, ctx, cs_q, cs_kv, bias)
        logits = self.target.lm_head(self.norm(x))
        in_seq = pos < t
        pos_c = pos.clamp(max=t - 1)
        labels = predicted.gather(1, pos_c)
        w_slot = torch.exp(-(slot - 1).float() / self.h["gamma"]) * (slot != 0)
        w = loss_mask.gather(1, pos_c) * in_seq * w_slot.repeat(n)
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(bsz, -1)
        return (ce * w).sum() / w.sum()


class MiniTrainer:
    def __init__(self, max_steps: int):
        self.max_steps = max_steps

    def fit(self, module: DFlashModule, loader: DataLoader) -> list[float]:
        module.on_train_start()
        opt, losses, step = module.configure_optimizers(), [], 0
        while step < self.max_steps:
            for batch_idx, batch in enumerate(loader):
                loss = module.training_step(batch, batch_idx)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                print(f"step {step} loss {loss.item():.8f}", flush=True)
                step += 1
                if step >= self.max_steps:
                    break
        return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="run_out")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "t10_lightning_like"))
    args = ap.parse_args()
    h = HPARAMS
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    tdir = os.path.join(args.workdir, "target")
    if not os.path.exists(os.path.join(tdir, "config.json")):
        torch.manual_seed(97531)
        Qwen3ForCausalLM(qwen3(h, h["target_layers"])).save_pretrained(tdir)
        torch.manual_seed(args.seed)
    target = Qwen3ForCausalLM.from_pretrained(tdir, torch_dtype=torch.float32)
    data = PromptAnswers(target, h, gen)
    loader = DataLoader(data, batch_size=h["batch_size"], shuffle=True, generator=gen)
    module = DFlashModule(h, target, gen)
    MiniTrainer(args.steps).fit(module, loader)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({**h, "target_layer_ids": module.layer_ids, "seed": args.seed}, f, indent=2)
    torch.save({k: v for k, v in module.state_dict().items() if not k.startswith("target.")},
               os.path.join(args.out, "drafter.pt"))


if __name__ == "__main__":
    main()
