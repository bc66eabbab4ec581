"""Probe entry for examples/anyprobe, written by `sleuth probe init` from the pieces sleuth located and called.

What is wired (methods that reach a TODO raise NotImplementedError: the probes that need them report
`unknown` "not provided by the entry", the others run):
    describe      wired
    build         wired
    parameters    wired
    draft_logits  wired
    loss          wired
    train_step    wired
    draft_layers  wired
    rotary        wired

Fill in every TODO(sleuth), then check and run it:
    sleuth probe check --probe-entry probe_entry_scaffolded:subject --code examples/anyprobe
    sleuth diagnose --code examples/anyprobe --probe-entry probe_entry_scaffolded:subject
The protocol (call order, shapes, hooks) is documented in sleuth/probes/protocol.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

import tiny_dflash

BLOCK_SIZE = 8
GAMMA = 4.0
NUM_TARGET_LAYERS = 8  # the probe's synthetic target; the layer rule is called with it
DRAFT_LAYERS = 2  # a tiny drafter
LAYER_IDS = tiny_dflash.select_target_layers(num_layers=NUM_TARGET_LAYERS, count=3)  # the trainer's own rule, at the probe target's depth


def _todo(what: str) -> Any:
    raise NotImplementedError(f"TODO(sleuth): {what}")


def _instance(cls: type) -> Any:
    """An object of the trainer's class without running its __init__ (the entry only calls methods that need
    the class's own attributes; set any others it reads here)."""
    return object.__new__(cls)


def _cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """Document offsets [0, end_0, end_1, ...] of one packed row."""
    starts = torch.nonzero(torch.diff(doc_ids, prepend=doc_ids[:1] - 1)).flatten()
    return torch.cat([starts, torch.tensor([doc_ids.numel()])]).to(torch.int32)


class _Hooked:
    """While active, the module's output is replaced by `fn(output)` (the protocol's hooks, on the drafter's
    own embedding / head modules)."""

    def __init__(self, module: nn.Module | None, fn: Any) -> None:
        self.module, self.fn, self.handle = module, fn, None

    def __enter__(self) -> _Hooked:
        if self.module is not None:
            self.handle = self.module.register_forward_hook(lambda _m, _a, out: self.fn(out))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.handle.remove()


class Subject:
    def describe(self) -> dict[str, Any]:
        info = {"name": "anyprobe (sleuth probe init)", "protocol": 1, "block_size": BLOCK_SIZE,
                "num_target_layers": NUM_TARGET_LAYERS, "layer_id_convention": "zlab",
                "documents_per_row": "packed"}
        if LAYER_IDS is not None:
            info["layer_ids"] = list(LAYER_IDS)
        return info

    def build(self, target: Any) -> None:
        self.target = target
        # the target's embeddings, lm_head and final norm as frozen modules sharing its tensors (not copies)
        self.embed = nn.Embedding.from_pretrained(target.embed_weight, freeze=True)
        self.embed.weight = nn.Parameter(target.embed_weight, requires_grad=False)
        self.lm_head = nn.Linear(target.hidden_size, target.vocab_size, bias=False)
        self.lm_head.weight = nn.Parameter(target.lm_head_weight, requires_grad=False)
        self.final_norm = nn.RMSNorm(target.hidden_size, eps=target.rms_norm_eps)
        self.final_norm.weight = nn.Parameter(target.norm_weight, requires_grad=False)
        # Drafter (anyprobe/tiny_dflash.py:135), with the target's sizes
        self.drafter = tiny_dflash.Drafter(hidden_size=target.hidden_size, num_context_layers=len(LAYER_IDS or [1, 3, 5]), num_layers=DRAFT_LAYERS, num_heads=target.num_heads, head_dim=target.head_dim, intermediate_size=target.intermediate_size)

    def parameters(self) -> dict[str, Any]:
        return dict(self.drafter.named_parameters())

    def draft_logits(self, batch: Any, hooks: Any) -> torch.Tensor:
        n, a = batch.anchors.shape
        ids = torch.full((n, a, BLOCK_SIZE), self.target.mask_token_id)
        ids[..., 0] = batch.input_ids.gather(1, batch.anchors)  # slot 0: the anchor; the others: the mask token
        ids = ids.view(n, a * BLOCK_SIZE)  # block-major: token t is slot t % B of block t // B
        x = hooks.block_embeddings(self.embed(ids))  # [N, A*B, H]
        features = tiny_dflash.gather_context(hidden_states=batch.hidden_states, layer_ids=LAYER_IDS)  # anyprobe/tiny_dflash.py:39
        # your training step: `hidden = drafter(block, gather_context(out.hidden_states, layer_ids), positions, block_visibility(anchors, batch['doc_ids'], b))` (anyprobe/tiny_dflash.py:180)
        mask = tiny_dflash.block_visibility(anchors=batch.anchors, doc_ids=batch.doc_ids, block_size=BLOCK_SIZE)  # anyprobe/tiny_dflash.py:44
        # your training step: `hidden = drafter(block, gather_context(out.hidden_states, layer_ids), positions, block_visibility(anchors, batch['doc_ids'], b))` (anyprobe/tiny_dflash.py:181)
        block_positions = tiny_dflash.block_position_ids(position_ids=batch.position_ids, anchors=batch.anchors, block_size=BLOCK_SIZE)  # anyprobe/tiny_dflash.py:56
        # your training step: `positions = torch.cat([batch['position_ids'], block_position_ids(batch['position_ids'], anchors, b)], dim=1)` (anyprobe/tiny_dflash.py:179)
        positions = torch.cat([batch.position_ids, block_positions.reshape(n, -1)], dim=1)  # check: sleuth joins the context's and the block's positions
        hidden = self.drafter(block_embeddings=x, context_features=features, position_ids=positions, visible=mask)  # Drafter.forward (anyprobe/tiny_dflash.py:145)
        return hooks.draft_logits(self.lm_head(hidden)).view(n, a, BLOCK_SIZE, -1)

    def loss(self, batch: Any, hooks: Any) -> torch.Tensor:
        logits = self.draft_logits(batch, hooks)  # [N, A, B, V], through hooks.draft_logits
        teacher = tiny_dflash.slot_targets(target_logits=batch.logits, anchors=batch.anchors, block_size=BLOCK_SIZE)  # anyprobe/tiny_dflash.py:61
        # your training step: `loss = dflash_loss(logits, slot_targets(out.logits, anchors, b), slot_weights(b, settings.gamma), valid)` (anyprobe/tiny_dflash.py:183)
        weights = tiny_dflash.slot_weights(block_size=BLOCK_SIZE, gamma=GAMMA)  # anyprobe/tiny_dflash.py:68
        # your training step: `loss = dflash_loss(logits, slot_targets(out.logits, anchors, b), slot_weights(b, settings.gamma), valid)` (anyprobe/tiny_dflash.py:183)
        return tiny_dflash.dflash_loss(draft_logits=logits[0], teacher_logits=teacher, weights=weights, anchor_valid=batch.anchor_valid)  # anyprobe/tiny_dflash.py:73

    def train_step(self, batch: Any) -> None:
        optimizer = tiny_dflash.build_optimizer(drafter=self.drafter, lr=0.001)  # anyprobe/tiny_dflash.py:154
        identity = SimpleNamespace(block_embeddings=lambda x: x, draft_logits=lambda x: x)
        optimizer.zero_grad()
        self.loss(batch, identity).backward()
        optimizer.step()

    def draft_layers(self) -> list[nn.Module]:
        return list(self.drafter.layers)

    def rotary(self) -> nn.Module | None:
        return self.drafter.rotary


def subject(context: dict[str, Any]) -> Subject:
    """The entry point: `--probe-entry probe_entry_scaffolded:subject`."""
    return Subject()
