"""A whole DFlash drafter and training step in one file, exposing sleuth's probe protocol.

    sleuth diagnose --code examples/probe_protocol.py --probe-entry probe_protocol:subject

sleuth imports this module in a separate process (the file's directory first on sys.path), calls
`subject(context)` and runs its experiments on the object returned: `describe`, `build`, `parameters`,
`draft_logits`, `loss`, `train_step`, `draft_layers`, `rotary` (sleuth/probes/protocol.py documents each).
Your own trainer needs the same few methods, each wired to the functions your training really uses.

`context["config"]` holds the run's settings (`gamma`, `loss`, `weighting`, `block_size`); `describe()`
reports each one it uses and where it came from (the run's config, or this file's default), so sleuth can
tell "the code ignored the configured gamma" from "the configured gamma is wrong". It may also carry
`defects` (a list of names in DEFECTS) to plant one of the bugs the probes catch; sleuth's own tests use
that to check every probe on a correct and a broken implementation (tests/probes/ also mutates this file
automatically, so keep every DFlash rule in plain code here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DEFECTS = {
    "fc_subset": "fc reads all selected layers but the last",
    "layer_offset": "layer id i reads hidden_states[i] instead of hidden_states[i + 1]",
    "anchor_leak": "a block sees context at its anchor (kv <= anchor)",
    "future_context": "a block sees context after its anchor",
    "cross_block": "block tokens see the other blocks' tokens",
    "causal_block": "slots see only earlier slots of their block",
    "context_first_layer_only": "only the first layer attends to the context",
    "position_offset": "block token j sits at anchor + j + 1",
    "teacher_last_selected": "the teacher is lm_head(norm(h)) of the last selected layer",
    "no_shift": "slot j is trained toward the target's prediction at p+j",
    "slot0_weighted": "slot 0 gets loss weight",
    "trainable_head": "embeddings and lm_head are trained",
    "anchor_tiling": "per-query anchors tiled with repeat instead of repeat_interleave",
    "cross_document": "a block sees the context of earlier documents in its row",
    "query_positions": "queries rotated at their slot index 0..B-1 instead of anchor + j",
    "softmax_ce": "cross-entropy applied to softmax(logits) instead of the logits",
    "self_labels": "each slot is trained toward the drafter's own argmax",
    "gamma_ignored": "the loss decays with gamma 4 whatever the config says",
    "sampler_ranks": "the sampler returns ranks among the eligible positions instead of the positions",
    "sampler_valid_nonzero": "the valid flags read off the zero-padded anchors (anchors > 0): an anchor at position 0 is lost",
    "mask_is_pad": "slots 1..B-1 hold the pad token (0) instead of the mask token",
    "fc_interleaved": "fc's input interleaves the layers feature by feature (stack, then flatten)",
    "context_detached": "the fused context is detached before the layers (fc never trains)",
    "shared_context_kv": "every layer takes the context's K/V from layer 0's k/v projections (projected once, reused)",
    "no_hidden_norm": "fc's output enters the layers unnormalised (no hidden_norm)",
    "output_hidden_norm": "the drafter's output is normalised with hidden_norm, its final norm left unused",
    "loss_over_weights": "the weighted loss divided by the sum of the weights, not by the trained slots' count",
    "scale_from_hidden": "attention scores scaled by 1/sqrt(hidden / heads) instead of 1/sqrt(head_dim)",
}
DEFAULTS = {"gamma": 4.0, "loss": "ce", "weighting": "decay", "block_size": 6}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", theta ** (-torch.arange(0, head_dim, 2).float() / head_dim), persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:  # [N, T] -> 2 x [N, T, hd]
        angles = position_ids[..., None].float() * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [N, heads, T, hd], cos/sin [N, T, hd]
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + turned * sin[:, None]


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, intermediate: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.scale: float | None = None  # None: SDPA's 1/sqrt(head_dim)
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, heads * head_dim, bias=False) for _ in range(3))
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)
        self.up, self.down = nn.Linear(hidden, intermediate, bias=False), nn.Linear(intermediate, hidden, bias=False)

    def forward(self, hidden_states: Tensor, context: Tensor | None, cos: Tensor, sin: Tensor, mask: Tensor,
                query_rotation: tuple[Tensor, Tensor] | None = None, context_kv_from: Layer | None = None) -> Tensor:
        n, q_len, _ = hidden_states.shape
        q_cos, q_sin = query_rotation or (cos[:, -q_len:], sin[:, -q_len:])  # the block's own positions
        x = self.norm1(hidden_states)
        keys_in = x if context is None else torch.cat([context, x], dim=1)  # context K/V first, then the block's
        if context is None:
            cos, sin, mask = cos[:, -q_len:], sin[:, -q_len:], mask[..., -q_len:]

        def split(t: Tensor) -> Tensor:
            return t.view(n, -1, self.heads, self.head_dim).transpose(1, 2)

        q = rotate(split(self.q(x)), q_cos, q_sin)
        if context_kv_from is not None and context is not None:  # the defect: another layer's projection of it
            k_in = torch.cat([context_kv_from.k(context), self.k(x)], dim=1)
            v_in = torch.cat([context_kv_from.v(context), self.v(x)], dim=1)
        else:
            k_in, v_in = self.k(keys_in), self.v(keys_in)
        k = rotate(split(k_in), cos, sin)
        out = F.scaled_dot_product_attention(q, k, split(v_in), attn_mask=mask[:, None], scale=self.scale)
        hidden_states = hidden_states + self.o(out.transpose(1, 2).reshape(n, q_len, -1))
        return hidden_states + self.down(F.silu(self.up(self.norm2(hidden_states))))


class Drafter(nn.Module):
    def __init__(self, num_features: int, hidden: int, layers: int, heads: int, head_dim: int,
                 intermediate: int, theta: float, context_first_layer_only: bool, block_size: int,
                 context_detached: bool = False, shared_context_kv: bool = False, no_hidden_norm: bool = False,
                 output_hidden_norm: bool = False) -> None:
        super().__init__()
        self.no_hidden_norm, self.output_hidden_norm = no_hidden_norm, output_hidden_norm
        self.block_size, self.context_detached, self.shared_context_kv = block_size, context_detached, shared_context_kv
        self.fc = nn.Linear(num_features * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, head_dim, intermediate) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.rotary = Rotary(head_dim, theta)
        self.context_first_layer_only = context_first_layer_only

    def forward(self, block: Tensor, features: Tensor, position_ids: Tensor, mask: Tensor,
                slot_positions: bool = False) -> Tensor:
        context = self.fc(features) if self.no_hidden_norm else self.hidden_norm(self.fc(features))  # [N, S, H]
        if self.context_detached:
            context = context.detach()
        cos, sin = self.rotary(block, position_ids)
        query_rotation = None
        if slot_positions:  # the defect: queries at their slot index within the block
            n, q_len, _ = block.shape
            slots = (torch.arange(q_len) % self.block_size).expand(n, -1)
            query_rotation = self.rotary(block, slots)
        for index, layer in enumerate(self.layers):
            sees = index == 0 or not self.context_first_layer_only
            shared = self.layers[0] if self.shared_context_kv and index > 0 else None
            block = layer(block, context if sees else None, cos, sin, mask, query_rotation, shared)
        return self.hidden_norm(block) if self.output_hidden_norm else self.norm(block)


def reference_layer_ids(num_layers: int, k: int) -> list[int]:
    return [num_layers // 2] if k == 1 else [round(1 + i * (num_layers - 4) / (k - 1)) for i in range(k)]


class TinyDFlash:
    """The probe protocol over this file's drafter and loss."""

    def __init__(self, defects: set[str], config: dict[str, Any] | None = None, num_target_layers: int = 8,
                 num_features: int = 3) -> None:
        unknown = defects - set(DEFECTS)
        if unknown:
            raise ValueError(f"unknown defects {sorted(unknown)}")
        given = config or {}
        self.settings = {key: given.get(key, default) for key, default in DEFAULTS.items()}
        self.sources = {key: "run config " + key if key in given else "default of examples/probe_protocol.py"
                        for key in DEFAULTS}
        self.defects = defects
        self.block_size = int(self.settings["block_size"])
        self.gamma, self.loss_kind, self.weighting = self.settings["gamma"], self.settings["loss"], self.settings["weighting"]
        self.num_target_layers, self.num_features = num_target_layers, num_features
        self.layer_ids = self.layer_ids_for(num_target_layers)

    def layer_ids_for(self, num_target_layers: int, count: int | None = None) -> list[int]:
        """This implementation's layer-id rule, for a target of any depth (and any number of layers)."""
        return reference_layer_ids(num_target_layers, count or self.num_features)

    def feature_projection(self) -> nn.Module:
        return self.drafter.fc

    def describe(self) -> dict[str, Any]:
        weighting = {"decay": "fixed-exp" if self.gamma is not None else "none", "dpace": "dpace"}[self.weighting]
        # "no decay" is set by gamma None: its source is gamma's
        weighting_source = self.sources["gamma" if weighting == "none" else "weighting"]
        configured = {"weighting": {"value": weighting, "source": weighting_source},
                      "loss": {"value": self.loss_kind, "source": self.sources["loss"]}}
        if weighting == "fixed-exp":
            configured["gamma"] = {"value": self.gamma, "source": self.sources["gamma"]}
        if weighting == "dpace":
            configured["dpace_alpha"] = {"value": 0.5, "source": "default of examples/probe_protocol.py"}
        return {"name": "probe_protocol example", "protocol": 1, "block_size": self.block_size,
                "num_target_layers": self.num_target_layers, "layer_ids": self.layer_ids,
                "layer_id_convention": "zlab", "configured": configured, "anchor_exclusions": ["last B positions"],
                "loss_reduction": "token_mean",  # loss(): the weighted sum over the number of trained slots
                "layer_ids_source": "reference_layer_ids (this file's rule) for the target's depth",
                "notes": sorted(self.defects)}

    def build(self, target: Any) -> None:
        self.target = target
        if "trainable_head" in self.defects:
            self.embed = nn.Parameter(target.embed_weight.clone())
            self.head = nn.Parameter(target.lm_head_weight.clone())
        else:  # the target's own tensors, never trained
            self.embed, self.head = target.embed_weight, target.lm_head_weight
        read = self.layer_ids[:-1] if "fc_subset" in self.defects else self.layer_ids
        self.read = [i if "layer_offset" in self.defects else i + 1 for i in read]  # hidden_states indices
        self.drafter = Drafter(len(self.read), target.hidden_size, 2, target.num_heads, target.head_dim,
                               target.intermediate_size, target.rope_theta, "context_first_layer_only" in self.defects,
                               self.block_size, "context_detached" in self.defects,
                               "shared_context_kv" in self.defects, "no_hidden_norm" in self.defects,
                               "output_hidden_norm" in self.defects)
        if "scale_from_hidden" in self.defects:
            for layer in self.drafter.layers:
                layer.scale = (target.hidden_size // target.num_heads) ** -0.5

    def parameters(self) -> dict[str, nn.Parameter]:
        found = dict(self.drafter.named_parameters())
        if isinstance(self.embed, nn.Parameter):
            found.update({"embed": self.embed, "lm_head": self.head})
        return found

    def draft_layers(self) -> list[nn.Module]:
        return list(self.drafter.layers)

    def rotary(self) -> nn.Module:
        return self.drafter.rotary

    def mask(self, anchors: Tensor, doc_ids: Tensor) -> Tensor:  # [N, Q, S+Q] bool
        n, s = doc_ids.shape
        b, q_len = self.block_size, anchors.shape[1] * self.block_size
        block_of = torch.arange(q_len) // b
        if "anchor_tiling" in self.defects:
            anchor = anchors.repeat(1, b)  # [N, Q], anchors[q % A]: the wrong tiling
        else:
            anchor = anchors.repeat_interleave(b, dim=1)  # [N, Q], anchors[q // B]
        kv = torch.arange(s)[None, None, :]
        if "future_context" in self.defects:
            before = torch.ones(n, q_len, s, dtype=torch.bool)
        elif "anchor_leak" in self.defects:
            before = kv <= anchor[..., None]
        else:
            before = kv < anchor[..., None]
        same_doc = doc_ids[:, None, :] == doc_ids.gather(1, anchor)[..., None]
        if "cross_document" in self.defects:
            same_doc = doc_ids[:, None, :] <= doc_ids.gather(1, anchor)[..., None]
        own = block_of[:, None] == block_of[None, :]
        if "cross_block" in self.defects:
            own = torch.ones_like(own)
        if "causal_block" in self.defects:
            own = own & (torch.arange(q_len)[None, :] <= torch.arange(q_len)[:, None])
        return torch.cat([before & same_doc, own.expand(n, -1, -1)], dim=-1)

    def _logits(self, batch: Any, hooks: Any) -> Tensor:  # [N, A*B, V]
        n, a = batch.anchors.shape
        b = self.block_size
        ids = torch.full((n, a, b), 0 if "mask_is_pad" in self.defects else self.target.mask_token_id)
        ids[:, :, 0] = batch.input_ids.gather(1, batch.anchors)
        block = hooks.block_embeddings(F.embedding(ids.view(n, a * b), self.embed))
        if "fc_interleaved" in self.defects:
            features = torch.stack([batch.hidden_states[i] for i in self.read], dim=-1).flatten(-2)
        else:
            features = torch.cat([batch.hidden_states[i] for i in self.read], dim=-1)
        shift = 1 if "position_offset" in self.defects else 0
        block_positions = batch.position_ids.gather(1, batch.anchors)[..., None] + torch.arange(b) + shift
        positions = torch.cat([batch.position_ids, block_positions.view(n, a * b)], dim=1)
        hidden = self.drafter(block, features, positions, self.mask(batch.anchors, batch.doc_ids),
                              slot_positions="query_positions" in self.defects)
        return hooks.draft_logits(hidden @ self.head.T)

    def draft_logits(self, batch: Any, hooks: Any) -> Tensor:
        n, a = batch.anchors.shape
        return self._logits(batch, hooks).view(n, a, self.block_size, -1)

    def loss(self, batch: Any, hooks: Any) -> Tensor:
        n, a = batch.anchors.shape
        b = self.block_size
        logits = self._logits(batch, hooks).view(n, a, b, -1).float()
        logp = F.log_softmax(logits.softmax(-1) if "softmax_ce" in self.defects else logits, dim=-1)
        teacher = batch.logits
        if "teacher_last_selected" in self.defects:
            h = batch.hidden_states[self.layer_ids[-1] + 1]
            normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.target.rms_norm_eps) * self.target.norm_weight
            teacher = normed @ self.target.lm_head_weight.T
        shift = 0 if "no_shift" in self.defects else -1
        labels = batch.anchors[..., None] + torch.arange(b)  # [N, A, B] the position of the token slot j predicts
        where = (labels + shift).clamp(0, teacher.shape[1] - 1)  # the target's prediction of that token
        target = teacher.gather(1, where.view(n, -1, 1).expand(-1, -1, teacher.shape[-1])).view(n, a, b, -1)
        if "self_labels" in self.defects:
            target = logits.detach()
        if self.loss_kind == "ce":
            per_slot = -logp.gather(-1, target.argmax(-1, keepdim=True)).squeeze(-1)
        else:
            q = F.log_softmax(target, -1)
            per_slot = (q.exp() * (q - logp)).sum(-1)
        # Which slots are trained: a real block (not a padded anchor slot), slot >= 1, a supervised token at p+j.
        inside = labels < batch.loss_mask.shape[1]
        supervised = batch.loss_mask.gather(1, labels.clamp(max=batch.loss_mask.shape[1] - 1).view(n, -1)).view(n, a, b)
        mask = (batch.anchor_valid[..., None] & inside & (supervised > 0)).float()
        slot = torch.arange(b, dtype=torch.float32)
        if "slot0_weighted" not in self.defects:
            mask = mask * (slot > 0).float()
        if self.weighting == "dpace":  # speculators' D-PACE: suffix sums of cumulative smoothed confidence
            with torch.no_grad():
                smooth = torch.where(mask > 0, 0.5 * torch.exp(-per_slot) + 0.5, torch.ones_like(per_slot))
                prefix = torch.cumprod(smooth, -1)
                weights = torch.flip(torch.cumsum(torch.flip(prefix * mask, [-1]), -1), [-1]) * mask
        else:
            gamma = 4.0 if "gamma_ignored" in self.defects else self.gamma
            decay = torch.ones(b) if gamma is None else torch.exp(-(slot - 1).clamp(min=0) / gamma)
            weights = decay * mask
        if "loss_over_weights" in self.defects:
            return (weights * per_slot).sum() / weights.sum().clamp_min(1e-12)
        return (weights * per_slot).sum() / (weights > 0).sum().clamp_min(1)

    def sample_anchors(self, batch: Any, num_anchors: int) -> tuple[Tensor, Tensor]:
        """The anchors a training step would draw: uniform without replacement over supervised positions,
        never in the last B positions of the row, sorted; rows with fewer are padded with invalid slots."""
        n, s = batch.loss_mask.shape
        anchors = torch.zeros(n, num_anchors, dtype=torch.long)
        valid = torch.zeros(n, num_anchors, dtype=torch.bool)
        eligible = batch.loss_mask.bool().clone()
        eligible[:, max(s - self.block_size, 0) :] = False
        for row in range(n):
            candidates = eligible[row].nonzero().squeeze(-1)
            count = min(num_anchors, candidates.numel())
            chosen = torch.randperm(candidates.numel())[:count]
            picked = chosen if "sampler_ranks" in self.defects else candidates[chosen]
            anchors[row, :count] = picked.sort().values
            valid[row, :count] = True
        if "sampler_valid_nonzero" in self.defects:
            valid = anchors > 0
        return anchors, valid

    def train_step(self, batch: Any) -> None:
        trainable = [p for p in self.parameters().values() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-2)
        identity = type("NoHooks", (), {"block_embeddings": staticmethod(lambda x: x),
                                        "draft_logits": staticmethod(lambda x: x)})()
        optimizer.zero_grad()
        self.loss(batch, identity).backward()
        optimizer.step()


def subject(context: dict[str, Any]) -> TinyDFlash:
    """The entry point sleuth calls: `--probe-entry probe_protocol:subject`."""
    config = dict(context.get("config") or {})
    return TinyDFlash(set(config.pop("defects", [])), config)
