"""The DSpark drafter: the DFlash drafter plus a Markov logit head and a confidence head.

The DFlash backbone drafts the block's hidden states in one forward exactly as before (DSparkDrafter is a
DFlashDrafter; its forward is inherited). Two small heads are added on top:
    * the Markov head biases slot k's logits by W2 . m_k, where m_k is built from W1[prev_k], the embedding of
      the token before slot k's label (rule `dspark.markov_prev_token`): with sample_from_anchor that is
      x[a+k] (prev_0 is the anchor); without it x[a+k-1], with prev_0 the anchor. 'vanilla' m_k = W1[prev_k];
      'gated' m_k = sigmoid(G [h_k; W1[prev_k]]) * W1[prev_k]; 'rnn' a gated recurrent state over the slots.
    * the confidence head predicts slot k's acceptance rate 1 - TV(draft_k, target_k) from [h_k; W1[prev_k]].
At inference the Markov head runs left to right: prev_k is the token drafted at slot k-1 (`markov_step`).

References: vllm-project/speculators 0.9.0 speculators/models/dspark/model_definitions.py (MarkovHead,
ConfidenceHead) and core.py:157-200 (after speculators #806); /work/shared/DFLASH_FAMILY.md, DSpark.
Weight names are speculators': markov_head.markov_w1.weight [V_verifier, r], markov_head.markov_w2.weight
[V_draft, r], markov_head.gate_proj.*, markov_head.joint_proj.*, confidence_head.proj.{weight,bias}.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from trainer.model.drafter import DFlashDrafter, draft_config_from_target

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    """Low-rank first-order logit bias: W2 . m(prev, h). `features` gives m; W2 is applied by the caller's head
    (its rows sit next to the lm_head's, so the loss never builds the bias as a separate [.., V] tensor)."""

    def __init__(self, verifier_vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int,
                 head_type: str = "vanilla") -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"markov rank must be >= 1, got {rank}")
        if head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov head type must be one of {MARKOV_HEAD_TYPES}, got {head_type!r}")
        self.head_type = head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(verifier_vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # speculators model_definitions.py:36
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            # one projection of [state; W1[prev]; h] gives the gate, the candidate state and the output
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def prev_embeddings(self, prev_ids: Tensor) -> Tensor:  # [..., B] -> [..., B, r]
        return self.markov_w1(prev_ids.long())

    def features(
        self,
        prev_emb: Tensor,  # [M, B, r] W1[prev_k] of every slot of M blocks
        hidden: Tensor,  # [M, B, H] the backbone's final-normed hidden states
    ) -> Tensor:  # [M, B, r]: the bias of slot k is markov_w2(features[:, k])
        prev_emb = prev_emb.to(self.markov_w2.weight.dtype)
        if self.head_type == "vanilla":
            return prev_emb
        hidden = hidden.to(prev_emb.dtype)
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1))) * prev_emb
        state = prev_emb.new_zeros(prev_emb.shape[0], self.rank)  # [M, r]
        outputs = []
        for k in range(prev_emb.shape[1]):
            out, state = self.rnn_step(prev_emb[:, k], hidden[:, k], state)
            outputs.append(out)
        return torch.stack(outputs, dim=1)

    def step(
        self,
        prev_emb: Tensor,  # [M, r] W1[prev_k] of one slot
        hidden: Tensor,  # [M, H] that slot's backbone state
        state: Tensor | None,  # [M, r] the rnn head's state after slot k-1 (None before slot 0)
    ) -> tuple[Tensor, Tensor | None]:  # slot k's features [M, r], the state after it
        """One slot of `features`, for decoding left to right (prev_k is the token drafted at slot k-1)."""
        prev_emb = prev_emb.to(self.markov_w2.weight.dtype)
        if self.head_type == "rnn":
            state = prev_emb.new_zeros(prev_emb.shape[0], self.rank) if state is None else state
            return self.rnn_step(prev_emb, hidden.to(prev_emb.dtype), state)
        return self.features(prev_emb[:, None], hidden[:, None])[:, 0], state

    def rnn_step(self, prev_emb: Tensor, hidden: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:  # [M, r] each
        gate, candidate, out = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return torch.tanh(out), state


class ConfidenceHead(nn.Module):
    """Slot k's predicted acceptance rate, as a logit: Linear(H [+ r], 1)."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: Tensor) -> Tensor:  # [..., D] -> [...]
        return self.proj(features).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """A DFlashDrafter (same backbone, same forward) with DSpark's Markov and confidence heads."""

    def __init__(self, config: Any, num_features: int, block_size: int, mask_token_id: int,
                 dspark: Mapping[str, Any], draft_vocab_size: int | None = None) -> None:
        super().__init__(config, num_features=num_features, block_size=block_size, mask_token_id=mask_token_id)
        self.sample_from_anchor = bool(dspark["sample_from_anchor"])
        rank = int(dspark["markov_rank"])
        hidden = config.hidden_size
        self.markov_head: MarkovHead | None = None
        if rank > 0:
            self.markov_head = MarkovHead(config.vocab_size, draft_vocab_size or config.vocab_size, rank, hidden,
                                          dspark["markov_head_type"])
        self.confidence_with_markov = bool(dspark["confidence_head_with_markov"]) and self.markov_head is not None
        self.confidence_head: ConfidenceHead | None = None
        if dspark["enable_confidence_head"]:
            if dspark["confidence_head_with_markov"] and self.markov_head is None:
                raise ValueError("confidence_head_with_markov requires markov_rank > 0")
            self.confidence_head = ConfidenceHead(hidden + (rank if self.confidence_with_markov else 0))

    @classmethod
    def from_target_config(  # type: ignore[override]
        cls,
        target_config: Any,
        num_layers: int,
        num_features: int,
        block_size: int,
        mask_token_id: int,
        shape: Mapping[str, Any] | None = None,
        dspark: Mapping[str, Any] | None = None,
    ) -> DSparkDrafter:
        if dspark is None:
            raise ValueError("a DSpark drafter needs its dspark settings")
        config = draft_config_from_target(target_config, num_layers, shape)
        config.block_size = block_size
        config.dflash_config = {"mask_token_id": mask_token_id, "num_features": num_features}
        config.dspark_config = dict(dspark)  # a saved config explains the heads, as dflash_config the backbone
        return cls(config, num_features=num_features, block_size=block_size, mask_token_id=mask_token_id,
                   dspark=dspark)

    @property
    def label_offset(self) -> int:
        """Slot k's label is token a + k + label_offset (1 with sample_from_anchor, else 0)."""
        return 1 if self.sample_from_anchor else 0

    def heads(
        self,
        hidden: Tensor,  # [M, B, H] final-normed backbone states of M blocks
        prev_ids: Tensor,  # [M, B] prev_k of every slot (dspark.markov_prev_token)
    ) -> tuple[Tensor | None, Tensor | None]:  # Markov features [M, B, r] (or None), confidence logits [M, B]
        prev_emb = self.markov_head.prev_embeddings(prev_ids) if self.markov_head is not None else None
        markov = self.markov_head.features(prev_emb, hidden) if self.markov_head is not None else None
        confidence = None
        if self.confidence_head is not None:
            inputs = torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1) if self.confidence_with_markov else hidden
            confidence = self.confidence_head(inputs)
        return markov, confidence


def training_prev_ids(
    input_ids: Tensor,  # [N, S]
    anchors: Tensor,  # [N, A]
    block_size: int,
    sample_from_anchor: bool,
) -> Tensor:  # [N, A, B] long
    """prev_k for training (rule `dspark.markov_prev_token`): the data token right before slot k's label.

    sample_from_anchor: the label of slot k is x[a+k+1], so prev_k = x[a+k] (prev_0 = the anchor).
    Otherwise the label is x[a+k] and prev_k = x[a+k-1], with prev_0 = the anchor (slot 0 is untrained).
    This is speculators' rule after #806 (dspark/core.py:157-168); before it both modes took the second form.
    """
    offsets = torch.arange(block_size, device=anchors.device)  # [B]
    if not sample_from_anchor:
        offsets = (offsets - 1).clamp(min=0)
    positions = anchors.unsqueeze(-1) + offsets  # [N, A, B], < S because anchors avoid the last B positions
    return input_ids.gather(1, positions.flatten(1)).view_as(positions)
