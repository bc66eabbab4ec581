"""The probe protocol over vllm-project/speculators' DFlash model (`speculators.models.dflash`).

The worker has put the diagnosed copy's import root first on sys.path; this adapter refuses to run if
`speculators` came from anywhere else. It drives the model the way speculators' trainer does:
`DFlashDraftModel(DFlashSpeculatorConfig(...))`, the verifier's embeddings / lm_head / final norm loaded
into it, `model(...)` with the call kwargs of `DFlashDraftModel.get_trainer_kwargs` (its defaults, or the
values of `--config`: loss_fn, dflash_decay_gamma, per_position_loss_weight, dpace_alpha, block_size), and
`speculators.train.optimizers.build_optimizers` for the optimizer step. Only the anchor sampler is
replaced, by one returning the probe's anchors. The hooks sit on the modules the forward calls for the
block embeddings (`embed_tokens`) and the draft logits (`lm_head`).

Layer selection is not speculators' code: its hidden states arrive pre-selected from vLLM (ids in vLLM's
convention, id i = hidden_states[i]), so the adapter selects them and `target_layer_ids` is not probed.
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


class SpeculatorsSubject:
    def __init__(self, package_dir: str, context: dict[str, Any]) -> None:
        import speculators
        from speculators.models.dflash import DFlashSpeculatorConfig
        from speculators.models.dflash import core
        from speculators.models.dflash.core import DFlashDraftModel

        where = Path(speculators.__file__).resolve().parent
        if where != Path(package_dir).resolve():
            raise ImportError(f"speculators was imported from {where}, not from the diagnosed {package_dir}")
        self.core, self.model_class, self.config_class = core, DFlashDraftModel, DFlashSpeculatorConfig
        config = context.get("config") or {}
        self.block_size = int(config.get("block_size") or DFlashSpeculatorConfig.model_fields["block_size"].default)
        self.loss_fn = str(config.get("loss_fn") or _default_loss_fn())
        chosen = {k: config[k] for k in ("dflash_decay_gamma", "per_position_loss_weight", "dpace_alpha") if k in config}
        train_kwargs, _ = DFlashDraftModel.get_trainer_kwargs(loss_fn=self.loss_fn, loss_implementation="eager", **chosen)
        self.call_kwargs = train_kwargs
        # speculators' own default selection for a verifier without explicit ids (models/utils.py).
        self.layer_ids = [2, TARGET_LAYERS // 2, TARGET_LAYERS - 3]

    def describe(self) -> dict[str, Any]:
        kwargs = self.call_kwargs
        return {
            "name": "speculators DFlashDraftModel",
            "protocol": 1,
            "block_size": self.block_size,
            "num_target_layers": TARGET_LAYERS,
            "layer_ids": self.layer_ids,
            "layer_id_convention": "external",
            "notes": [f"trainer call kwargs: loss {self.loss_fn} (eager), gamma {kwargs['gamma']}, "
                      f"per-position weight {kwargs['per_position_loss_weight']}"],
        }

    def build(self, target: Any) -> None:
        layer_config = target.qwen3_config(num_hidden_layers=DRAFT_LAYERS)
        layer_config._attn_implementation = "sdpa"  # dense masks on CPU (flex attention needs compilation)
        config = self.config_class(
            transformer_layer_config=layer_config,
            draft_vocab_size=target.vocab_size,  # the full vocabulary: no d2t / t2d mapping
            block_size=self.block_size,
            aux_hidden_state_layer_ids=self.layer_ids,
            mask_token_id=target.mask_token_id,
        )
        self.model = self.model_class(config).float()
        self.model.load_state_dict({
            "embed_tokens.weight": target.embed_weight,
            "lm_head.weight": target.lm_head_weight,
            "verifier_lm_head.weight": target.lm_head_weight,
            "verifier_norm.weight": target.norm_weight,
        }, strict=False)

    def parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())

    def draft_layers(self) -> list[nn.Module]:
        return list(self.model.layers)

    def rotary(self) -> nn.Module | None:
        return self.model.rotary_emb

    @contextlib.contextmanager
    def _wired(self, batch: Any, hooks: Any) -> Iterator[list[Tensor]]:
        anchors, valid = batch.anchors[0].clone(), batch.anchor_valid[0].clone()

        def given_anchors(loss_mask: Tensor, num_anchors: int, block_size: int) -> tuple[Tensor, Tensor]:
            return anchors.clone(), valid.clone()

        drafted: list[Tensor] = []

        def on_logits(_module: nn.Module, _args: Any, output: Tensor) -> Tensor:
            out = hooks.draft_logits(output)
            drafted.append(out)
            return out

        handles = [self.model.embed_tokens.register_forward_hook(lambda _m, _a, out: hooks.block_embeddings(out)),
                   self.model.lm_head.register_forward_hook(on_logits)]
        original = self.core.select_anchors
        self.core.select_anchors = given_anchors
        try:
            yield drafted
        finally:
            self.core.select_anchors = original
            for handle in handles:
                handle.remove()

    def _forward(self, batch: Any, hooks: Any) -> tuple[Tensor, list[Tensor]]:
        if batch.input_ids.shape[0] != 1:
            raise ValueError("speculators' DFlash forward takes one packed row")
        features = torch.cat([batch.hidden_states[i] for i in self.layer_ids], dim=-1)  # vLLM ids: hidden_states[i]
        kwargs = {**self.call_kwargs, "max_anchors": int(batch.anchors.shape[1])}
        with self._wired(batch, hooks) as drafted:
            _, loss, _metrics = self.model(
                hidden_states=features,
                input_ids=batch.input_ids,
                loss_mask=batch.loss_mask,
                verifier_last_hidden_states=batch.last_hidden,
                document_ids=batch.doc_ids,
                position_ids=batch.position_ids,
                **kwargs,
            )
        return loss, drafted

    def draft_logits(self, batch: Any, hooks: Any) -> Tensor:
        self.model.eval()
        _loss, drafted = self._forward(batch, hooks)
        return drafted[0].reshape(1, batch.anchors.shape[1], self.block_size, -1)

    def loss(self, batch: Any, hooks: Any) -> Tensor:
        self.model.train()
        loss, _drafted = self._forward(batch, hooks)
        return loss

    def train_step(self, batch: Any) -> None:
        from speculators.train.optimizers import build_optimizers

        # speculators' TrainerConfig defaults (train/trainer.py): AdamW, weight decay 0.01.
        settings = SimpleNamespace(optimizer="adamw", lr=1e-3, weight_decay=0.01)
        optimizers = build_optimizers(self.model, settings)
        identity = SimpleNamespace(block_embeddings=lambda x: x, draft_logits=lambda x: x)
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.loss(batch, identity).backward()
        for optimizer in optimizers:
            optimizer.step()


def _default_loss_fn() -> str:
    """speculators' default loss for DFlash training (train/config/schema.py), "ce" if it cannot be read."""
    try:
        from speculators.train.config.schema import _DEFAULT_LOSS_FN

        return _DEFAULT_LOSS_FN.get("dflash", "ce")
    except Exception:  # an older layout: the documented default
        return "ce"
