"""A probe entry for tiny_dflash.py written by hand: the protocol's eight methods, each wired to the trainer.

    sleuth probe check --probe-entry probe_entry_handwritten:subject --code examples/anyprobe
    sleuth diagnose --code examples/anyprobe --probe-entry probe_entry_handwritten:subject

The probe owns the target (sleuth/probes/protocol.py): this entry builds the trainer's Drafter for it, feeds the
probe's batch through the trainer's own functions in the order train_step uses them, and applies the two hooks
where the protocol asks (the block embeddings, the draft logits). It uses the target's embeddings and lm_head
directly, as the trainer does.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import tiny_dflash as trainer

NUM_TARGET_LAYERS = 8


class TinyDFlashSubject:
    def __init__(self, settings: trainer.Settings) -> None:
        self.settings = settings
        self.layer_ids = trainer.select_target_layers(NUM_TARGET_LAYERS, settings.num_context_layers)

    def describe(self) -> dict[str, Any]:
        return {"name": "tiny_dflash (hand-written entry)", "protocol": 1, "block_size": self.settings.block_size,
                "num_target_layers": NUM_TARGET_LAYERS, "layer_ids": self.layer_ids, "layer_id_convention": "zlab",
                "documents_per_row": "packed", "notes": [f"gamma {self.settings.gamma}"]}

    def build(self, target: Any) -> None:
        self.target = target
        self.drafter = trainer.Drafter(target.hidden_size, len(self.layer_ids), self.settings.num_draft_layers,
                                       target.num_heads, target.head_dim, target.intermediate_size)

    def parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.drafter.named_parameters())

    def draft_layers(self) -> list[nn.Module]:
        return list(self.drafter.layers)

    def rotary(self) -> nn.Module:
        return self.drafter.rotary

    def _logits(self, batch: Any, hooks: Any) -> Tensor:  # [N, A, B, V], as train_step computes them
        n, a = batch.anchors.shape
        b = self.settings.block_size
        ids = torch.full((n, a, b), self.target.mask_token_id)
        ids[..., 0] = batch.input_ids.gather(1, batch.anchors)
        block = hooks.block_embeddings(F.embedding(ids.view(n, a * b), self.target.embed_weight))
        positions = torch.cat([batch.position_ids, trainer.block_position_ids(batch.position_ids, batch.anchors, b)], dim=1)
        hidden = self.drafter(block, trainer.gather_context(batch.hidden_states, self.layer_ids), positions,
                              trainer.block_visibility(batch.anchors, batch.doc_ids, b))
        return hooks.draft_logits(hidden @ self.target.lm_head_weight.T).view(n, a, b, -1)

    def draft_logits(self, batch: Any, hooks: Any) -> Tensor:
        return self._logits(batch, hooks)

    def loss(self, batch: Any, hooks: Any) -> Tensor:
        b = self.settings.block_size
        return trainer.dflash_loss(self._logits(batch, hooks), trainer.slot_targets(batch.logits, batch.anchors, b),
                                   trainer.slot_weights(b, self.settings.gamma), batch.anchor_valid)

    def train_step(self, batch: Any) -> None:
        optimizer = trainer.build_optimizer(self.drafter, self.settings.lr)
        no_hooks = SimpleNamespace(block_embeddings=lambda x: x, draft_logits=lambda x: x)
        optimizer.zero_grad()
        self.loss(batch, no_hooks).backward()
        optimizer.step()


def subject(context: dict[str, Any]) -> TinyDFlashSubject:
    """`--probe-entry probe_entry_handwritten:subject`; `--config` values override the trainer's Settings."""
    config = context.get("config") or {}
    known = {k: v for k, v in config.items() if k in trainer.Settings.__dataclass_fields__}
    return TinyDFlashSubject(trainer.Settings(**known))
