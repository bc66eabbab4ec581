"""The trainer's probe entry point: how `sleuth` runs experiments on the code a run actually executed.

Every run copies the trainer's source into `<run>/code/` (this file included). `sleuth diagnose --run`
imports `trainer.probe` from that copy (its `code/` directory first on sys.path, in a separate process)
and calls `probe_subject({"run_dir": ...})`. The object returned follows sleuth's probe protocol
(docs/guides/your-trainer.md "Probes"; sleuth/probes/protocol.py): sleuth hands it a synthetic target and batches with known
answers, and the subject runs the trainer's own code on them: `StepPlan`, `build_drafter`,
`build_optimizer`, `FrozenTarget.forward_hidden` (layer selection, the teacher) and `dflash_step`
(anchors -> blocks -> mask -> drafter -> chunked loss). Nothing here re-implements a step; it only wires the
probe's inputs into the real functions, so a defect in any of them shows in the measurements.

Stable: the names `probe_subject` and `PROBE_PROTOCOL_VERSION` and the methods of `TrainerProbeSubject`
are the contract; sleuth treats runs recorded before this file existed as "not probe-able".
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from trainer.config import TrainConfig, resolve_for_target, validate_config
from trainer.run.loop import build_drafter, optimizer_step
from trainer.run.optim import build_optimizer
from trainer.run.step import StepPlan, dflash_step
from trainer.target.frozen import FrozenTarget

PROBE_PROTOCOL_VERSION = 1


def probe_subject(context: dict[str, Any]) -> TrainerProbeSubject:
    """The subject for a run directory (`context["run_dir"]`), or for a bare config (`context["config"]`
    plus `context["num_target_layers"]`)."""
    config_values = context.get("config")
    num_layers = context.get("num_target_layers")
    run_dir = context.get("run_dir")
    if run_dir is not None:
        run = Path(run_dir)
        config_values = json.loads((run / "config.json").read_text())
        info = json.loads((run / "run.json").read_text())
        num_layers = (info.get("target") or {}).get("num_layers")
    if not isinstance(config_values, dict) or not isinstance(num_layers, int):
        raise ValueError("probe_subject needs a run directory, or a config and the target's number of layers")
    return TrainerProbeSubject(validate_config(config_values), num_layers)


class _StandInCausalLM(nn.Module):
    """What FrozenTarget needs from a Hugging Face causal LM, answering with the probe's tensors.

    Its forward returns the current probe batch's hidden states (HF layout) and final logits, so the
    trainer's own layer selection and teacher choice run on inputs the probe controls.
    """

    def __init__(self, target: Any) -> None:
        super().__init__()
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        self.config = Qwen3Config(**target.config_kwargs())
        self.config._attn_implementation = "sdpa"
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(target.vocab_size, target.hidden_size)
        self.model.norm = Qwen3RMSNorm(target.hidden_size, eps=target.rms_norm_eps)
        self.lm_head = nn.Linear(target.hidden_size, target.vocab_size, bias=False)
        with torch.no_grad():
            self.model.embed_tokens.weight.copy_(target.embed_weight)
            self.model.norm.weight.copy_(target.norm_weight)
            self.lm_head.weight.copy_(target.lm_head_weight)
        # A stand-in for the frozen target: nothing of it trains (FrozenTarget freezes the real one the same way).
        self.requires_grad_(False)
        self.answer: Any = None  # the probe batch being run

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, **_kwargs: Any) -> SimpleNamespace:
        return SimpleNamespace(hidden_states=tuple(self.answer.hidden_states), logits=self.answer.logits)


class _ProbeTokenizer:
    """The few tokenizer attributes FrozenTarget reads; the probe's vocabulary has no text."""

    def __init__(self, vocab_size: int, mask_token_id: int) -> None:
        self.vocab_size, self.mask_token_id = vocab_size, mask_token_id
        self.eos_token_id, self.pad_token_id = 0, 0

    def __len__(self) -> int:
        return self.vocab_size


class TrainerProbeSubject:
    """This trainer, configured as the run was, on the probe's synthetic target (sleuth's probe protocol)."""

    def __init__(self, config: TrainConfig, num_target_layers: int) -> None:
        self.config = config
        self.num_target_layers = num_target_layers

    def describe(self) -> dict[str, Any]:
        config = resolve_for_target(self.config, self.num_target_layers)
        run = "run config config.json:"
        # What the run's config sets for the rules sleuth judges (it tells "the code ignored the config" from
        # "the config is wrong"); a run's config.json holds every value explicitly.
        configured: dict[str, dict[str, Any]] = {
            "loss": {"value": config.loss, "source": run + "loss"},
            "weighting": {"value": "dpace" if config.loss_weighting == "dpace" else
                          ("none" if config.loss_decay_gamma is None else "fixed-exp"), "source": run + "loss_weighting"},
            "dpace_alpha": {"value": config.dpace_alpha, "source": run + "dpace_alpha"},
        }
        if config.loss_decay_gamma is not None:
            configured["gamma"] = {"value": config.loss_decay_gamma, "source": run + "loss_decay_gamma"}
        if self.config.target_layer_ids is not None:
            configured["target_layer_ids"] = {"value": list(self.config.target_layer_ids), "source": run + "target_layer_ids"}
        return {
            "name": "dflash-sleuth trainer",
            "protocol": PROBE_PROTOCOL_VERSION,
            "block_size": config.block_size,
            "num_target_layers": self.num_target_layers,
            "layer_ids": list(config.target_layer_ids or []),
            "layer_id_convention": "zlab",
            "configured": configured,
            "anchor_exclusions": ["last B positions"],  # trainer/model/anchors.py
            "anchor_sampler_source": "trainer.run.step.sample_step_anchors",
            "layer_ids_source": "TrainConfig.resolved_layer_ids for the target's depth",
            "notes": [f"the run's config: loss {config.loss}, gamma {config.loss_decay_gamma}"],
        }

    def layer_ids_for(self, num_target_layers: int) -> list[int]:
        """The trainer's own id rule for a target of that depth (the run's explicit ids, if it set them)."""
        return list(self.config.resolved_layer_ids(num_target_layers))

    def feature_projection(self) -> nn.Module:
        return self.drafter.fc

    def sample_anchors(self, batch: Any, num_anchors: int) -> tuple[Tensor, Tensor]:
        """The training loop's sampler (sample_step_anchors) with max_anchors = num_anchors; the step number
        is drawn from torch's global generator, which the probe seeds per draw."""
        from dataclasses import replace

        from trainer.run.step import sample_step_anchors

        plan = replace(self.plan, max_anchors=num_anchors)
        rows = {"loss_mask": batch.loss_mask, "doc_ids": batch.doc_ids}
        return sample_step_anchors(rows, plan, seed=self.config.seed, step=int(torch.randint(0, 2**30, (1,))))

    def build(self, target: Any) -> None:
        self.stand_in = _StandInCausalLM(target)
        self.stand_in.requires_grad_(False)  # as FrozenTarget.load freezes a real target
        self.target = FrozenTarget(self.stand_in, _ProbeTokenizer(target.vocab_size, target.mask_token_id),
                                   Path("probe-target"), "probe", mask_token_id=target.mask_token_id)
        # The run's own mask token id belongs to its real vocabulary; the probe's target has its own.
        self.run_config = resolve_for_target(self.config.model_copy(update={"mask_token_id": None}),
                                             self.num_target_layers)
        # A run's reduced draft vocabulary maps its real vocabulary; the probe's has 64 tokens, all drafted.
        self.plan = StepPlan.from_config(self.run_config, self.target)
        self.drafter = build_drafter(self.run_config, self.target, self.plan).float()

    def parameters(self) -> dict[str, nn.Parameter]:
        found = {f"drafter.{n}": p for n, p in self.drafter.named_parameters()}
        found.update({f"target.{n}": p for n, p in self.stand_in.named_parameters()})
        return found

    def draft_layers(self) -> list[nn.Module]:
        return list(self.drafter.layers)

    def rotary(self) -> nn.Module | None:
        return self.drafter.rotary_emb

    def _step(self, batch: Any, hooks: Any) -> tuple[Tensor, list[Tensor]]:
        """dflash_step on the probe batch, the hooks on the block embeddings and on the drafter's logits.

        The drafter's logits go through `dflash_step`'s own intervention point: what the hook returns is
        scored by the run's chunked loss with the run's chunk size (config.json's loss_chunk_size), so the
        gradients a probe takes are the run's loss path's, chunking included."""
        self.stand_in.answer = batch
        target = self.target
        embed = FrozenTarget.embed.__get__(target)
        drafted: list[Tensor] = []

        def hooked_logits(logits: Tensor) -> Tensor:
            out = hooks.draft_logits(logits)
            drafted.append(out)
            return out

        target.embed = lambda ids: hooks.block_embeddings(embed(ids))  # type: ignore[method-assign]
        try:
            rows = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "doc_ids": batch.doc_ids,
                    "loss_mask": batch.loss_mask}
            loss, _metrics = dflash_step(target, self.drafter, rows, batch.anchors, batch.anchor_valid, self.plan,
                                         draft_logits_hook=hooked_logits)
        finally:
            del target.embed
        return loss, drafted

    def draft_logits(self, batch: Any, hooks: Any) -> Tensor:
        self.drafter.eval()
        _loss, drafted = self._step(batch, hooks)
        n, a = batch.anchors.shape
        return drafted[0].reshape(n, a, self.run_config.block_size, -1)

    def loss(self, batch: Any, hooks: Any) -> Tensor:
        self.drafter.train()
        loss, _drafted = self._step(batch, hooks)
        return loss

    def train_step(self, batch: Any) -> None:
        """One step of the training loop: its optimizer (build_optimizer) and its update (optimizer_step)."""
        self.drafter.train()
        optimizer = build_optimizer(self.run_config, self.drafter)
        optimizer_step(self.run_config, self.drafter, optimizer, self.loss(batch, _NO_HOOKS))


def _identity(tensor: Tensor) -> Tensor:
    return tensor


# The probe protocol's hooks, doing nothing (the trainer does not import sleuth's definition).
_NO_HOOKS = SimpleNamespace(block_embeddings=_identity, draft_logits=_identity)
