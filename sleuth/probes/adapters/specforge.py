"""The probe protocol over sgl-project/SpecForge's DFlash draft model and its training wrapper.

Wires SpecForge's own pieces the way its trainer does (algorithms/model_providers.py): a
`DFlashDraftModel(Qwen3Config + dflash_config)`, the target's embeddings and lm_head as frozen modules
(its `TargetEmbeddingsAndHead` loader freezes them), `OnlineDFlashModel(...)` with the configured
`loss_decay_gamma` / `loss_type` (SpecForge's defaults unless `--config` says otherwise), and features
selected by its own `extract_context_feature` (z-lab ids). Only the anchor sampler is replaced, by one
returning the probe's anchors. SpecForge packs one sample per row (positions are `arange` over the row),
so it is probed on one-document rows. When SpecForge cannot be imported here (it needs packages or a GPU
this interpreter lacks), the worker reports every probe `unknown` with the import error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

DRAFT_LAYERS = 2
TARGET_LAYERS = 8
BLOCK_SIZE = 8


class SpecForgeSubject:
    def __init__(self, package_dir: str, context: dict[str, Any]) -> None:
        import specforge
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.modeling.draft.dflash import DFlashDraftModel, build_target_layer_ids, extract_context_feature

        where = Path(specforge.__file__).resolve().parent
        if where != Path(package_dir).resolve():
            raise ImportError(f"specforge was imported from {where}, not from the diagnosed {package_dir}")
        self.online_class, self.draft_class, self.extract = OnlineDFlashModel, DFlashDraftModel, extract_context_feature
        config = context.get("config") or {}
        self.block_size = int(config.get("block_size") or BLOCK_SIZE)
        self.gamma = config.get("loss_decay_gamma")  # SpecForge's training default: None (no decay)
        self.loss_type = str(config.get("loss_type") or "dflash")
        self.layer_ids = list(build_target_layer_ids(TARGET_LAYERS, DRAFT_LAYERS))

    def describe(self) -> dict[str, Any]:
        return {
            "name": "SpecForge OnlineDFlashModel",
            "protocol": 1,
            "block_size": self.block_size,
            "num_target_layers": TARGET_LAYERS,
            "layer_ids": self.layer_ids,
            "layer_id_convention": "zlab",
            "documents_per_row": 1,
            "notes": [f"loss_type {self.loss_type}, loss_decay_gamma {self.gamma}"],
        }

    def build(self, target: Any) -> None:
        config = target.qwen3_config(num_hidden_layers=DRAFT_LAYERS)
        config._attn_implementation = "sdpa"
        config.block_size = self.block_size
        config.num_target_layers = TARGET_LAYERS
        config.layer_types = ["full_attention"] * DRAFT_LAYERS
        config.dflash_config = {"mask_token_id": target.mask_token_id, "target_layer_ids": self.layer_ids}
        draft = self.draft_class(config).float()
        embed = nn.Embedding(target.vocab_size, target.hidden_size)
        head = nn.Linear(target.hidden_size, target.vocab_size, bias=False)
        with torch.no_grad():
            embed.weight.copy_(target.embed_weight)
            head.weight.copy_(target.lm_head_weight)
        embed.requires_grad_(False)  # as TargetEmbeddingsAndHead.from_pretrained leaves them
        head.requires_grad_(False)
        self.model = self.online_class(
            draft_model=draft, target_lm_head=head, target_embed_tokens=embed, mask_token_id=target.mask_token_id,
            block_size=self.block_size, attention_backend="sdpa", num_anchors=3, loss_decay_gamma=self.gamma,
            loss_type=self.loss_type,
            # 0 evaluates the objective in one piece; chunks add activation checkpointing, whose recomputation
            # would call lm_head again behind the probe's hook. The loss is the same sum either way.
            objective_chunk_blocks=0,
        )

    def parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())

    def draft_layers(self) -> list[nn.Module]:
        return list(self.model.draft_model.layers)

    def rotary(self) -> nn.Module | None:
        return self.model.draft_model.rotary_emb

    @contextlib.contextmanager
    def _wired(self, batch: Any, hooks: Any) -> Iterator[list[Tensor]]:
        anchors, valid = batch.anchors.clone(), batch.anchor_valid.clone()
        self.model.num_anchors = int(anchors.shape[1])
        self.model._sample_anchor_positions = lambda seq_len, loss_mask, device: (anchors.clone(), valid.clone())
        drafted: list[Tensor] = []

        def on_logits(_module: nn.Module, _args: Any, output: Tensor) -> Tensor:
            out = hooks.draft_logits(output)
            drafted.append(out)
            return out

        handles = [self.model.embed_tokens.register_forward_hook(lambda _m, _a, out: hooks.block_embeddings(out)),
                   self.model.lm_head.register_forward_hook(on_logits)]
        try:
            yield drafted
        finally:
            del self.model._sample_anchor_positions
            for handle in handles:
                handle.remove()

    def _forward(self, batch: Any, hooks: Any) -> tuple[Tensor, list[Tensor]]:
        features = self.extract(list(batch.hidden_states), self.layer_ids)
        with self._wired(batch, hooks) as drafted:
            loss, _accuracy, _metrics = self.model(input_ids=batch.input_ids, hidden_states=features,
                                                   loss_mask=batch.loss_mask)
        return loss, drafted

    def draft_logits(self, batch: Any, hooks: Any) -> Tensor:
        self.model.eval()
        _loss, drafted = self._forward(batch, hooks)
        return torch.cat(drafted, dim=1).reshape(batch.anchors.shape[0], batch.anchors.shape[1], self.block_size, -1)

    def loss(self, batch: Any, hooks: Any) -> Tensor:
        self.model.train()
        loss, _drafted = self._forward(batch, hooks)
        return loss

    def train_step(self, batch: Any) -> None:
        # SpecForge's BF16Optimizer is AdamW over the parameters that require grad (specforge/optimizer.py).
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-3)
        optimizer.zero_grad()
        self.loss(batch, SimpleNamespace(block_embeddings=lambda x: x, draft_logits=lambda x: x)).backward()
        optimizer.step()
