"""DFlash training on a small trainer hierarchy: TrainerBase owns the loop and the hook order, DFlashTrainer
fills the hooks (target, drafter, batches, loss).

    python train.py --steps 2
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half


@dataclass
class Cfg:
    target_layers: int = 8
    taps: int = 3
    hidden: int = 32
    vocab: int = 96
    mask_token_id: int = 95
    draft_layers: int = 2
    block_size: int = 4
    gamma: float = 4.0
    max_anchors: int = 8
    seq_len: int = 40
    prompt_len: int = 8
    samples: int = 8
    batch: int = 2
    lr: float = 3e-3
    seed: int = 0
    workdir: str = os.path.join(tempfile.gettempdir(), "t06_hooks")
    out: str = "run_out"


class TrainerBase:
    """The loop and the order of the hooks. Subclasses implement the build_* and compute_loss hooks."""

    def __init__(self, cfg: Cfg):
        self.cfg = cfg
        self.history: list[float] = []

    # hooks ---------------------------------------------------------------
    def build_target(self) -> nn.Module:
        raise NotImplementedError

    def build_drafter(self) -> nn.Module:
        raise NotImplementedError

    def build_data(self) -> None:
        pass

    def compute_loss(self, step: int) -> torch.Tensor:
        raise NotImplementedError

    def freeze(self) -> None:
        self.target.requires_grad_(False)
        self.target.eval()

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.drafter.parameters() if p.requires_grad]

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.trainable_parameters(), lr=self.cfg.lr)

    def on_step_end(self, step: int, loss: float) -> None:
        print(f"step {step} loss {loss:.8f}", flush=True)

    def save(self) -> None:
        pass

    # fixed order -----------------------------------------------------------
    def setup(self) -> None:
        torch.manual_seed(self.cfg.seed)
        self.gen = torch.Generator().manual_seed(self.cfg.seed)
        self.target = self.build_target()
        self.drafter = self.build_drafter()
        self.freeze()
        self.build_data()
        self.optimizer = self.build_optimizer()

    def fit(self, steps: int) -> list[float]:
        self.setup()
        for step in range(steps):
            loss = self.compute_loss(step)
            self.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), 1.0)
            self.optimizer.step()
            self.history.append(loss.item())
            self.on_step_end(step, loss.item())
        self.save()
        return self.history


# --------------------------------------------------------------------------- the drafter
class DraftAttention(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm, self.k_norm = Qwen3RMSNorm(self.hd, c.rms_norm_eps), Qwen3RMSNorm(self.hd, c.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = ctx.shape
        return self.k_proj(ctx).view(b, t, self.nkv, self.hd), self.v_proj(ctx).view(b, t, self.nkv, self.hd)

    def forward(self, x, ctx_kv, rope_q, rope_kv, allow):
        b, q_len, _ = x.shape
        k_ctx, v_ctx = ctx_kv
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.nh, self.hd)).transpose(1, 2)
        k = torch.cat([k_ctx, self.k_proj(x).view(b, q_len, self.nkv, self.hd)], 1)
        v = torch.cat([v_ctx, self.v_proj(x).view(b, q_len, self.nkv, self.hd)], 1).transpose(1, 2)
        k = self.k_norm(k).transpose(1, 2)
        (cq, sq), (ck, sk) = rope_q, rope_kv
        q = q * cq[:, None] + rotate_half(q) * sq[:, None]
        k = k * ck[:, None] + rotate_half(k) * sk[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allow, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DraftLayer(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.attn = DraftAttention(c)
        self.mlp = Qwen3MLP(c)
        self.ln_attn, self.ln_mlp = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps), Qwen3RMSNorm(c.hidden_size,
                                                                                            c.rms_norm_eps)

    def forward(self, x, ctx_kv, rope_q, rope_kv, allow):
        x = x + self.attn(self.ln_attn(x), ctx_kv, rope_q, rope_kv, allow)
        return x + self.mlp(self.ln_mlp(x))


class DFlashDrafter(nn.Module):
    """Carries its own copies of the target's embedding and lm_head, so a checkpoint is self-contained."""

    def __init__(self, c: Qwen3Config, num_taps: int, embed: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        self.embed_tokens, self.lm_head = embed, lm_head
        self.fc = nn.Linear(num_taps * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(c)

    def forward(self, block_ids, feats, q_pos, kv_pos, allow):
        x = self.embed_tokens(block_ids)
        ctx = self.hidden_norm(self.fc(feats))
        ctx_kv = self.layers[0].attn.context_kv(ctx)
        rope_q, rope_kv = self.rotary(x, q_pos), self.rotary(x, kv_pos)
        for layer in self.layers:
            x = layer(x, ctx_kv, rope_q, rope_kv, allow)
        return self.lm_head(self.norm(x))


# --------------------------------------------------------------------------- the DFlash trainer
class DFlashTrainer(TrainerBase):
    def qwen3(self, layers: int) -> Qwen3Config:
        c = self.cfg
        return Qwen3Config(hidden_size=c.hidden, intermediate_size=2 * c.hidden, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=c.hidden // 4, num_hidden_layers=layers,
                           vocab_size=c.vocab, max_position_embeddings=256, tie_word_embeddings=False)

    def build_target(self) -> nn.Module:
        path = os.path.join(self.cfg.workdir, "target")
        if not os.path.exists(os.path.join(path, "config.json")):
            state = torch.get_rng_state()
            torch.manual_seed(2468)
            Qwen3ForCausalLM(self.qwen3(self.cfg.target_layers)).save_pretrained(path)
            torch.set_rng_state(state)
        return Qwen3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32)

    def layer_ids(self) -> list[int]:
        n, k = self.cfg.target_layers, self.cfg.taps
        return [n // 2] if k == 1 else [int(round(1 + i * (n - 4) / (k - 1))) for i in range(k)]

    def build_drafter(self) -> nn.Module:
        return DFlashDrafter(self.qwen3(self.cfg.draft_layers), self.cfg.taps,
                             copy.deepcopy(self.target.model.embed_tokens), copy.deepcopy(self.target.lm_head))

    @torch.no_grad()
    def build_data(self) -> None:
        c = self.cfg
        prompts = torch.randint(0, c.mask_token_id, (c.samples, c.prompt_len), generator=self.gen)
        new = c.seq_len - c.prompt_len
        self.ids = self.target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                                        min_new_tokens=new, do_sample=False, pad_token_id=0)[:, : c.seq_len]
        self.loss_mask = torch.zeros(self.ids.shape)
        self.loss_mask[:, c.prompt_len:] = 1
        out = self.target(self.ids, output_hidden_states=True)
        self.feats = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids()], -1)
        self.teacher = out.logits.argmax(-1)

    def anchors(self, rows: torch.Tensor) -> torch.Tensor:
        ok = self.loss_mask[rows].bool()
        ok[:, -self.cfg.block_size:] = False
        out = []
        for r in range(ok.shape[0]):
            cand = ok[r].nonzero().squeeze(-1)
            out.append(cand[torch.randperm(cand.numel(), generator=self.gen)[: self.cfg.max_anchors]].sort().values)
        return torch.stack(out)

    def compute_loss(self, step: int) -> torch.Tensor:
        c, b = self.cfg, self.cfg.block_size
        rows = torch.randperm(c.samples, generator=self.gen)[: c.batch]
        ids, t = self.ids[rows], self.ids.shape[1]
        a = self.anchors(rows)                                           # (bsz, n)
        bsz, n = a.shape
        slot = torch.arange(b)
        block = torch.full((bsz, n, b), c.mask_token_id)
        block[..., 0] = ids.gather(1, a)
        q_pos = (a[..., None] + slot).flatten(1)
        kv_pos = torch.cat([torch.arange(t).expand(bsz, t), q_pos], 1)
        qa = a.repeat_interleave(b, 1)
        qb = torch.arange(n * b) // b
        allow = torch.cat([torch.arange(t)[None, None] < qa[..., None],
                           (qb[:, None] == qb[None]).expand(bsz, -1, -1)], -1)[:, None]
        logits = self.drafter(block.flatten(1), self.feats[rows], q_pos, kv_pos, allow).view(bsz, n, b, -1)
        labels = self.teacher[rows].gather(1, (q_pos - 1).clamp(min=0)).view(bsz, n, b)
        w = self.loss_mask[rows].gather(1, q_pos.clamp(max=t - 1)).view(bsz, n, b) * (q_pos < t).view(bsz, n, b)
        w = w * (slot > 0) * torch.exp(-(slot - 1).clamp(min=0) / c.gamma)
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(bsz, n, b)
        return (ce * w).sum() / w.sum()

    def save(self) -> None:
        os.makedirs(self.cfg.out, exist_ok=True)
        with open(os.path.join(self.cfg.out, "config.json"), "w") as f:
            json.dump({**asdict(self.cfg), "target_layer_ids": self.layer_ids()}, f, indent=2)
        torch.save({"state_dict": self.drafter.state_dict(), "history": self.history},
                   os.path.join(self.cfg.out, "drafter.pt"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="run_out")
    args = ap.parse_args()
    DFlashTrainer(Cfg(seed=args.seed, out=args.out)).fit(args.steps)


if __name__ == "__main__":
    main()
