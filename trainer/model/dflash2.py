"""DFlash2: the DFlash drafter with local dynamic convolutions in every layer and a candidate selector.

Two additions, both from z-lab's DFlash2 as speculators 0.9.0 trains it (models/dflash2/model_definitions.py;
facts and citations in ../shared/DFLASH_FAMILY.md, "DFlash2"):

  * GroupedDynamicCausalConv around attention and around the MLP of each decoder layer:
        out[i, c] = sum_t (base[t, c] + delta[i, t, c // g]) * x[i - t, c],   t = 0 .. k-1
    over the block's own slots; a tap that would reach into the previous block is zero ((i mod B) < t).
    delta comes from one Linear(H -> 2*k*H/g) of the sublayer's input, for the input-side and the output-side
    convolution both. At init base[:, 0] = 1, the other taps and the projection are 0: the layer is exactly
    DFlash's (rule `dflash2.conv_identity_init`).
  * CandidateSelector: codebooks P, S in R^{V x r} and a projection W: H -> r. It re-scores the unary top-K
        score(c) = unary[c] + <P[prev] * W h, S[c]>
    where prev is the token before the slot's target (the anchor for slot 1).

The layers are DFlashDrafter's (trainer/model/drafter.py): this module only wraps them. Weight names follow
speculators' (layers.{i}.attention_conv.base_kernel, ...kernel_projection.weight, candidate_selector.*).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from transformers import Qwen3Config

from trainer.config import ConfigError, DFlash2Config
from trainer.model.drafter import DFlashDecoderLayer, DFlashDrafter, draft_config_from_target


def grouped_dynamic_conv(
    x: Tensor,  # [N, Q, H], Q a whole number of blocks laid out block after block
    delta: Tensor,  # [N, Q, k, G] per-slot tap offsets, one per group of g channels (G = H // g)
    base: Tensor,  # [k, H] static taps
    block_size: int,
) -> Tensor:  # [N, Q, H]
    n, q_len, hidden = x.shape
    kernel_size, groups = delta.shape[-2], delta.shape[-1]
    grouped = x.view(n, q_len, groups, hidden // groups)  # [N, Q, G, g]
    slot = torch.arange(q_len, device=x.device).remainder(block_size)  # position within the block
    out = torch.zeros_like(grouped)
    for tap in range(kernel_size):
        shifted = grouped if tap == 0 else torch.cat([grouped.new_zeros(n, tap, groups, hidden // groups),
                                                      grouped[:, :-tap]], dim=1)
        coefficient = base[tap].to(x.dtype).view(1, 1, groups, -1) + delta[:, :, tap, :, None]
        # A tap never reaches into the previous block: that block's slots are not this block's past.
        inside = slot.ge(tap).view(1, q_len, 1, 1)
        out = out + shifted * coefficient * inside
    return out.view(n, q_len, hidden)


class GroupedDynamicCausalConv(nn.Module):
    """The input-side and output-side convolutions of one sublayer, both driven by its input."""

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.block_size, self.kernel_size = block_size, kernel_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [in/out, k, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():  # identity: the sublayer sees and returns exactly what DFlash's would
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:  # [N, Q, H] -> convolved input, output-side taps
        n, q_len, _ = x.shape
        delta = self.kernel_projection(x).view(n, q_len, 2, self.kernel_size, self.num_groups)
        return grouped_dynamic_conv(x, delta[:, :, 0], self.base_kernel[0], self.block_size), delta[:, :, 1]

    def finish(self, y: Tensor, delta: Tensor) -> Tensor:
        return grouped_dynamic_conv(y, delta, self.base_kernel[1], self.block_size)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """DFlash's decoder layer with a convolution pair around attention and around the MLP."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        shape = (config.hidden_size, config.block_size, config.conv_kernel_size, config.conv_group_size)
        self.attention_conv = GroupedDynamicCausalConv(*shape)
        self.mlp_conv = GroupedDynamicCausalConv(*shape)

    def forward(self, x: Tensor, context: Tensor, cos: Tensor, sin: Tensor, attention_mask, past_key_values) -> Tensor:
        h, out_taps = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, context, cos, sin, attention_mask, past_key_values), out_taps)
        h, out_taps = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), out_taps)  # [N, Q, H]


class CandidateSelector(nn.Module):
    """Re-ranks the unary top-K: unary[c] + <predecessor_codebook[prev] * W h, successor_codebook[c]>."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, initializer_range: float) -> None:
        super().__init__()
        self.top_k = top_k
        # bare Parameters, not Embeddings: speculators saves them as `candidate_selector.*_codebook`
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=initializer_range)

    def transition_scores(
        self,
        hidden: Tensor,  # [M, H] the drafter's final hidden state of each slot
        predecessor_ids: Tensor,  # [M]
        candidate_ids: Tensor,  # [M, K]
    ) -> Tensor:  # [M, K]
        context = self.predecessor_codebook[predecessor_ids] * self.hidden_projection(hidden).to(
            self.predecessor_codebook.dtype)  # [M, r]
        return (context.unsqueeze(-2) * self.successor_codebook[candidate_ids]).sum(dim=-1)

    @torch.no_grad()
    def greedy_walk(
        self,
        unary_logits: Tensor,  # [P, V] logits of the slots that propose, in order
        hidden: Tensor,  # [P, H]
        anchor_id: int,  # the first slot's predecessor
    ) -> tuple[Tensor, Tensor, Tensor]:  # tokens [P], candidate ids [P, K], candidate scores [P, K]
        """z-lab's greedy proposal: each slot takes the best-scored candidate, which is the next slot's
        predecessor (the walk starts at the anchor; rule `dflash2.anchor_is_bonus`)."""
        candidates = unary_logits.topk(self.top_k, dim=-1).indices  # [P, K]
        tokens, scores = [], []
        previous = torch.tensor([anchor_id], device=hidden.device)
        for slot in range(hidden.shape[0]):
            score = unary_logits[slot, candidates[slot]] + self.transition_scores(
                hidden[slot : slot + 1], previous, candidates[slot : slot + 1])[0].to(unary_logits.dtype)  # [K]
            previous = candidates[slot, score.argmax()].view(1)
            tokens.append(previous)
            scores.append(score)
        return torch.cat(tokens), candidates, torch.stack(scores)


class DFlash2Drafter(DFlashDrafter):
    """DFlashDrafter whose layers carry DFlash2's convolutions, plus the candidate selector.

    forward is DFlashDrafter's (final-normed hidden states); the selector reads those hidden states and the
    target's unary logits, in the training step (trainer/model/dflash2_loss.py) and in decoding
    (trainer/eval/speculative.py DFlash2Proposer)."""

    def __init__(self, config: Qwen3Config, num_features: int, block_size: int, mask_token_id: int) -> None:
        super().__init__(config, num_features, block_size, mask_token_id)
        for layer in self.layers:  # DFlashDrafter's N(0, 0.02) init reached the kernel projections too
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        self.candidate_selector = CandidateSelector(
            config.vocab_size, config.hidden_size, config.selector_rank, config.selector_top_k,
            config.initializer_range,
        )

    def _make_layer(self, config: Qwen3Config, layer_idx: int) -> nn.Module:
        return DFlash2DecoderLayer(config, layer_idx)

    @classmethod
    def from_target_config(
        cls,
        target_config: Any,
        num_layers: int,
        num_features: int,
        block_size: int,
        mask_token_id: int,
        shape: Mapping[str, Any] | None = None,
        dflash2: DFlash2Config | None = None,
    ) -> DFlash2Drafter:
        config = with_dflash2_settings(draft_config_from_target(target_config, num_layers, shape),
                                       dflash2 or DFlash2Config(), block_size)
        config.dflash_config = {"mask_token_id": mask_token_id, "num_features": num_features}
        return cls(config, num_features=num_features, block_size=block_size, mask_token_id=mask_token_id)


SETTINGS_ON_CONFIG = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def with_dflash2_settings(config: Qwen3Config, settings: DFlash2Config, block_size: int) -> Qwen3Config:
    """The draft config with DFlash2's shape on it (checked against its sizes): what the layers and the
    selector are built from, and what an export writes."""
    check_dflash2_shape(settings, config.hidden_size, config.vocab_size, block_size)
    config.block_size = block_size
    for name in SETTINGS_ON_CONFIG:
        setattr(config, name, getattr(settings, name))
    return config


def check_dflash2_shape(settings: DFlash2Config, hidden_size: int, vocab_size: int, block_size: int) -> None:
    """The constraints that need the target's sizes (rules `dflash2.conv_shapes`, `dflash2.full_vocab`)."""
    if hidden_size % settings.conv_group_size:
        raise ConfigError(f"dflash2.conv_group_size {settings.conv_group_size} does not divide the hidden size "
                          f"{hidden_size}")
    if settings.conv_kernel_size > block_size:
        raise ConfigError(f"dflash2.conv_kernel_size {settings.conv_kernel_size} exceeds block_size {block_size}")
    if settings.selector_top_k > vocab_size:
        raise ConfigError(f"dflash2.selector_top_k {settings.selector_top_k} exceeds the vocabulary ({vocab_size})")
