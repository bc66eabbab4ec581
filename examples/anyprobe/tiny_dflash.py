"""A small DFlash drafter trainer, written plainly: the trainer the three ways of probing are shown on.

    python tiny_dflash.py --target ./Qwen3-0.6B --data rows.pt --steps 1000

Nothing here knows about sleuth. examples/anyprobe/ shows the three ways to let sleuth run it:
  1. no adapter:   sleuth diagnose --code examples/anyprobe --probe
  2. scaffolded:   sleuth probe init --code examples/anyprobe  (probe_entry_scaffolded.py is its output, completed)
  3. hand-written: probe_entry_handwritten.py, the protocol's eight methods wired by hand
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class Settings:
    block_size: int = 8
    gamma: float = 4.0  # slot k >= 1 weighs exp(-(k-1)/gamma)
    num_context_layers: int = 3  # target layers the drafter reads
    num_draft_layers: int = 2
    anchors_per_row: int = 32
    lr: float = 1e-3


def select_target_layers(num_layers: int, count: int) -> list[int]:
    """z-lab ids: `count` layers evenly from 1 to L-3 (one layer: the middle one)."""
    if count == 1:
        return [num_layers // 2]
    return [round(1 + i * (num_layers - 4) / (count - 1)) for i in range(count)]


def gather_context(hidden_states: tuple[Tensor, ...], layer_ids: list[int]) -> Tensor:
    """[N, S, k*H]: the selected layers' outputs (hidden_states[0] is the embeddings, so id i is index i + 1)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def block_visibility(anchors: Tensor, doc_ids: Tensor, block_size: int) -> Tensor:
    """[N, A*B, S + A*B] bool, True = may attend: same-document context before the anchor, and the own block."""
    n, s = doc_ids.shape
    q = anchors.shape[1] * block_size
    block_of = torch.arange(q) // block_size
    anchor = anchors[:, block_of]  # [N, Q]
    context = torch.arange(s)[None, None, :] < anchor[..., None]
    context &= doc_ids[:, None, :] == doc_ids.gather(1, anchor)[..., None]
    own_block = (block_of[:, None] == block_of[None, :]).expand(n, q, q)
    return torch.cat([context, own_block], dim=-1)


def block_position_ids(position_ids: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """[N, A*B]: block token j of the block anchored at p sits at position_ids[p] + j."""
    return (position_ids.gather(1, anchors)[..., None] + torch.arange(block_size)).flatten(1)


def slot_targets(target_logits: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """[N, A, B, V]: slot j learns the target's prediction made at p + j - 1."""
    n, a = anchors.shape
    where = (anchors[..., None] + torch.arange(block_size) - 1).clamp(min=0).view(n, -1)
    return target_logits.gather(1, where[..., None].expand(-1, -1, target_logits.shape[-1])).view(n, a, block_size, -1)


def slot_weights(block_size: int, gamma: float) -> Tensor:
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def dflash_loss(draft_logits: Tensor, teacher_logits: Tensor, weights: Tensor, anchor_valid: Tensor) -> Tensor:
    """Cross-entropy of every slot against the target's argmax, weighted per slot; invalid anchors left out."""
    ce = F.cross_entropy(draft_logits.flatten(0, -2).float(), teacher_logits.argmax(-1).flatten(),
                         reduction="none").view(teacher_logits.shape[:-1])  # [N, A, B]
    w = weights * anchor_valid[..., None]
    return (ce * w).sum() / w.sum().clamp_min(1e-6)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float = 1e6) -> None:
        super().__init__()
        self.register_buffer("inv_freq", theta ** (-torch.arange(0, head_dim, 2).float() / head_dim), persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:  # [N, T] -> 2 x [N, T, head_dim]
        angles = position_ids[..., None].float() * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [N, heads, T, hd]
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]


class DraftLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.attn_norm, self.mlp_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.up, self.down = nn.Linear(hidden, ffn, bias=False), nn.Linear(ffn, hidden, bias=False)

    def forward(self, hidden_states: Tensor, context: Tensor, cos: Tensor, sin: Tensor, visible: Tensor) -> Tensor:
        n, q, _ = hidden_states.shape
        x = self.attn_norm(hidden_states)
        both = torch.cat([context, x], dim=1)  # the context's K/V first, then the block's

        def heads(t: Tensor) -> Tensor:
            return t.view(n, t.shape[1], self.heads, self.head_dim).transpose(1, 2)

        queries = rotate(heads(self.q_proj(x)), cos[:, -q:], sin[:, -q:])
        keys = rotate(heads(self.k_proj(both)), cos, sin)
        out = F.scaled_dot_product_attention(queries, keys, heads(self.v_proj(both)), attn_mask=visible[:, None])
        hidden_states = hidden_states + self.o_proj(out.transpose(1, 2).reshape(n, q, -1))
        return hidden_states + self.down(F.silu(self.up(self.mlp_norm(hidden_states))))


class Drafter(nn.Module):
    """fc over the selected target layers, its norm, the draft layers; embeddings and lm_head are the target's."""

    def __init__(self, hidden_size: int, num_context_layers: int, num_layers: int, num_heads: int, head_dim: int,
                 intermediate_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(num_context_layers * hidden_size, hidden_size, bias=False)
        self.hidden_norm = RMSNorm(hidden_size)
        self.layers = nn.ModuleList(DraftLayer(hidden_size, num_heads, head_dim, intermediate_size)
                                    for _ in range(num_layers))
        self.norm = RMSNorm(hidden_size)
        self.rotary = Rotary(head_dim)

    def forward(self, block_embeddings: Tensor, context_features: Tensor, position_ids: Tensor, visible: Tensor) -> Tensor:
        context = self.hidden_norm(self.fc(context_features))
        cos, sin = self.rotary(block_embeddings, position_ids)
        x = block_embeddings
        for layer in self.layers:
            x = layer(x, context, cos, sin, visible)
        return self.norm(x)


def build_optimizer(drafter: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)


def sample_anchors(loss_mask: Tensor, settings: Settings, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Up to anchors_per_row positions with a loss, never in the last B of a row: [N, A] and which are real."""
    n, s = loss_mask.shape
    allowed = loss_mask.bool().clone()
    allowed[:, s - settings.block_size:] = False
    scores = torch.rand(n, s, generator=generator).masked_fill(~allowed, -1.0)
    top = scores.topk(settings.anchors_per_row, dim=1)
    order = top.indices.sort(dim=1)
    return order.values, top.values.gather(1, order.indices) >= 0


def train_step(drafter: Drafter, target: nn.Module, batch: dict[str, Tensor], optimizer: torch.optim.Optimizer,
               settings: Settings, layer_ids: list[int], mask_token_id: int, generator: torch.Generator) -> float:
    with torch.no_grad():
        out = target(input_ids=batch["input_ids"], position_ids=batch["position_ids"], output_hidden_states=True)
    anchors, valid = sample_anchors(batch["loss_mask"], settings, generator)
    n, a = anchors.shape
    b = settings.block_size
    ids = torch.full((n, a, b), mask_token_id)
    ids[..., 0] = batch["input_ids"].gather(1, anchors)
    block = target.get_input_embeddings()(ids.view(n, a * b))
    positions = torch.cat([batch["position_ids"], block_position_ids(batch["position_ids"], anchors, b)], dim=1)
    hidden = drafter(block, gather_context(out.hidden_states, layer_ids), positions,
                     block_visibility(anchors, batch["doc_ids"], b))
    logits = target.get_output_embeddings()(hidden).view(n, a, b, -1)
    loss = dflash_loss(logits, slot_targets(out.logits, anchors, b), slot_weights(b, settings.gamma), valid)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", required=True, help="a torch file of packed rows: input_ids, position_ids, doc_ids, loss_mask")
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    settings = Settings()
    target = AutoModelForCausalLM.from_pretrained(args.target).eval().requires_grad_(False)
    config = target.config
    layer_ids = select_target_layers(config.num_hidden_layers, settings.num_context_layers)
    drafter = Drafter(config.hidden_size, len(layer_ids), settings.num_draft_layers, config.num_attention_heads,
                      config.hidden_size // config.num_attention_heads, config.intermediate_size)
    optimizer = build_optimizer(drafter, settings.lr)
    rows = torch.load(args.data)
    generator = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        batch = {key: value[step % len(value)][None] for key, value in rows.items()}
        loss = train_step(drafter, target, batch, optimizer, settings, layer_ids, config.vocab_size - 1, generator)
        if step % 100 == 0:
            print(f"step {step} loss {loss:.4f} ppl {math.exp(loss):.2f}")


if __name__ == "__main__":
    main()
