"""A class-based DFlash trainer: an nn.Module drafter and a Trainer object, settings from small.yaml.

Blind-benchmark subject: written from the project's README, docs and /work/shared/DFLASH.md only.
"""
import argparse
import math
import tempfile
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding


@dataclass
class Settings:
    block_size: int = 8
    loss_decay_gamma: float = 4.0
    num_taps: int = 3
    draft_layers: int = 2
    mask_token_id: int = 255
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 1
    steps: int = 2
    batch: int = 2
    seq_len: int = 64
    anchors_per_row: int = 4
    seed: int = 0


def build_target(seed):
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    folder = tempfile.mkdtemp(prefix="target-")
    Qwen3ForCausalLM(cfg).save_pretrained(folder)
    model = Qwen3ForCausalLM.from_pretrained(folder)
    model.eval().requires_grad_(False)
    return model


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class ContextBlockAttention(nn.Module):
    """Queries from the block; keys and values from the fused context, then from the block."""

    def __init__(self, cfg):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def forward(self, x, context, q_rot, k_rot, mask):
        n, t, _ = x.shape
        s = context.shape[1]
        q = self.q_norm(self.q_proj(x).view(n, t, self.heads, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(context), self.k_proj(x)], dim=1).view(n, s + t, self.kv_heads, self.head_dim)
        v = torch.cat([self.v_proj(context), self.v_proj(x)], dim=1).view(n, s + t, self.kv_heads, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        (cq, sq), (ck, sk) = q_rot, k_rot
        q = q * cq.unsqueeze(1) + rotate_half(q) * sq.unsqueeze(1)
        k = k * ck.unsqueeze(1) + rotate_half(k) * sk.unsqueeze(1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(n, t, -1))


class DraftLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = ContextBlockAttention(cfg)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, x, context, q_rot, k_rot, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, q_rot, k_rot, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockDrafter(nn.Module):
    def __init__(self, target, settings, tap_ids):
        super().__init__()
        cfg = target.config
        self.block_size = settings.block_size
        self.mask_token_id = settings.mask_token_id
        self.tap_ids = tap_ids
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
        self.embed_tokens.requires_grad_(False)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight.data.copy_(target.lm_head.weight)
        self.lm_head.requires_grad_(False)
        self.fc = nn.Linear(len(tap_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(settings.draft_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(cfg)

    def attention_mask(self, anchors, seq_len):
        n, a = anchors.shape
        b = self.block_size
        q_block = torch.arange(a * b) // b
        anchor_of_query = anchors.repeat_interleave(b, dim=1)
        context_ok = torch.arange(seq_len).view(1, 1, -1) < anchor_of_query.unsqueeze(-1)
        block_ok = (q_block.view(-1, 1) == q_block.view(1, -1)).unsqueeze(0).expand(n, -1, -1)
        return torch.cat([context_ok, block_ok], dim=-1).unsqueeze(1)

    def forward(self, hidden_states, input_ids, position_ids, anchors):
        n, s = input_ids.shape
        a, b = anchors.shape[1], self.block_size
        features = torch.cat([hidden_states[i + 1] for i in self.tap_ids], dim=-1)
        context = self.hidden_norm(self.fc(features))
        block_tokens = torch.full((n, a, b), self.mask_token_id, dtype=torch.long)
        block_tokens[:, :, 0] = input_ids.gather(1, anchors)
        x = self.embed_tokens(block_tokens.flatten(1))
        block_positions = (position_ids.gather(1, anchors).unsqueeze(-1) + torch.arange(b)).flatten(1)
        q_rot = self.rotary_emb(x, block_positions)
        k_rot = self.rotary_emb(x, torch.cat([position_ids, block_positions], dim=1))
        mask = self.attention_mask(anchors, s)
        for layer in self.layers:
            x = layer(x, context, q_rot, k_rot, mask)
        return self.lm_head(self.norm(x)).view(n, a, b, -1)


class Trainer:
    def __init__(self, settings):
        self.s = settings
        self.target = build_target(settings.seed)
        depth = self.target.config.num_hidden_layers
        k = settings.num_taps
        self.tap_ids = [round(1 + i * (depth - 4) / (k - 1)) for i in range(k)]
        self.drafter = BlockDrafter(self.target, settings, self.tap_ids)
        trainable = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay)
        total = settings.steps

        def shape(step):
            if step < settings.warmup_steps:
                return (step + 1) / settings.warmup_steps
            done = (step - settings.warmup_steps) / max(1, total - settings.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, done)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, shape)
        self.rng = torch.Generator().manual_seed(settings.seed + 7)

    def sample_anchors(self, loss_mask):
        b = self.s.block_size
        picked = []
        for row in loss_mask:
            candidates = row[:-b].nonzero().squeeze(-1)
            order = torch.randperm(candidates.numel(), generator=self.rng)
            picked.append(candidates[order[: self.s.anchors_per_row]].sort().values)
        return torch.stack(picked)

    def teacher(self, input_ids):
        with torch.no_grad():
            out = self.target(input_ids=input_ids, output_hidden_states=True)
        return out.hidden_states, out.logits

    def loss(self, draft_logits, teacher_logits, anchors, loss_mask):
        n, a, b, v = draft_logits.shape
        j = torch.arange(b)
        source = (anchors.unsqueeze(-1) + j - 1).clamp(min=0)  # slot j is verified against position p+j-1
        labels = teacher_logits.argmax(-1).gather(1, source.flatten(1)).view(n, a, b)
        keep = loss_mask.gather(1, (anchors.unsqueeze(-1) + j).flatten(1)).view(n, a, b).float()
        weights = torch.exp(-(j.float() - 1) / self.s.loss_decay_gamma) * (j > 0).float()
        weights = weights * keep
        logp = F.log_softmax(draft_logits.float(), dim=-1)
        nll = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return (nll * weights).sum() / weights.sum()

    def batch(self):
        ids = torch.randint(3, 250, (self.s.batch, self.s.seq_len), generator=self.rng)
        loss_mask = torch.ones_like(ids)
        loss_mask[:, :6] = 0
        positions = torch.arange(self.s.seq_len).expand_as(ids)
        return ids, positions, loss_mask

    def fit(self):
        self.drafter.train()
        for step in range(self.s.steps):
            ids, positions, loss_mask = self.batch()
            hidden_states, logits = self.teacher(ids)
            anchors = self.sample_anchors(loss_mask)
            draft = self.drafter(hidden_states, ids, positions, anchors)
            loss = self.loss(draft, logits, anchors, loss_mask)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            print(f"[{step + 1}/{self.s.steps}] loss={loss.item():.4f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small.yaml")
    ap.add_argument("--steps", type=int)
    args = ap.parse_args()
    with open(args.config) as fh:
        values = yaml.safe_load(fh) or {}
    if args.steps is not None:
        values["steps"] = args.steps
    Trainer(Settings(**values)).fit()


if __name__ == "__main__":
    main()
