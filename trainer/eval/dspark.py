"""Speculative decoding with a DSpark drafter: one backbone forward per block, then the Markov head left to right.

Slot k's logits are lm_head(h_k) + W2 . m_k(prev_k), where prev_0 is the anchor and prev_k is the token drafted
at slot k-1 (SpecForge modeling/draft/dspark.py:82-117; rule `dspark.markov_prev_token` at inference). With
sample_from_anchor every slot proposes (slot k drafts position anchor+k+1, B proposals per verify step); without
it slots 1..B-1 do, as in DFlash, and prev_1 is the anchor. The chain follows the greedy choice of each slot: at
temperature 0 that is exactly the token the loop drafts, and at temperature > 0 the returned distributions stay a
valid proposal (they depend on the context only), so decoding stays lossless, but the chain does not follow the
sampled tokens as DSpark's own sampler does.

Confidence-scheduled drafting (`confidence_min`, llama.cpp #25173 `--spec-draft-conf-min`): the confidence head
predicts slot k's acceptance rate sigmoid(c_k) from [h_k; W1[prev_k]]; drafting stops after the last slot whose
predicted chance of a fully accepted prefix, prod_{j<=k} sigmoid(c_j), is at least the threshold (one slot always
drafts). The verify step then holds fewer drafts, never different ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from trainer.eval.speculative import DFlashProposer, EvalError


class DSparkProposer(DFlashProposer):
    """A DSparkDrafter on its frozen target: DFlash's block forward, then the sequential Markov bias."""

    def __init__(self, drafter: Any, target: Any, vocab_ids: Tensor | None = None, served_as: Any = None,
                 confidence_min: float | None = None) -> None:
        if vocab_ids is not None:
            raise EvalError("a DSpark drafter decodes over the target's full vocabulary (no draft vocabulary)")
        if confidence_min is not None and drafter.confidence_head is None:
            raise EvalError("confidence-scheduled drafting needs the drafter's confidence head")
        super().__init__(drafter, target, vocab_ids, served_as)
        self.confidence_min = confidence_min

    def num_proposals(self, block_size: int) -> int:
        return block_size if self.drafter.sample_from_anchor else block_size - 1

    @torch.no_grad()
    def propose(self, block_ids: Tensor, context_features: Tensor, position_ids: Tensor, cache: DynamicCache) -> Tensor:
        hidden = self.block_hidden(block_ids, context_features, position_ids, cache)  # [1, B, H]
        logits = self.target.logits(hidden.to(self.target.dtype))[0].float()  # [B, V] before the Markov bias
        drafter, head = self.drafter, self.drafter.markov_head
        first = 0 if drafter.sample_from_anchor else 1  # the first slot that proposes
        prev = block_ids[0, :1]  # [1] the anchor
        state = None
        survive = 1.0  # the confidence head's chance that every slot drafted so far is accepted
        drafted = []
        for k in range(hidden.shape[1]):
            slot = logits[k]  # [V]
            prev_emb = head.prev_embeddings(prev) if head is not None else None  # [1, r]
            if head is not None:
                features, state = head.step(prev_emb, hidden[:, k], state)  # [1, r]
                slot = slot + head.markov_w2(features)[0].float()
            if k < first:
                continue
            if self.confidence_min is not None:
                survive *= self._accept_chance(hidden[:, k], prev_emb)
                if drafted and survive < self.confidence_min:
                    break
            drafted.append(slot)
            prev = slot.argmax(dim=-1, keepdim=True)  # prev_{k+1}: the token slot k drafts
        return torch.stack(drafted)[None]  # [1, P, V]

    def _accept_chance(self, hidden: Tensor, prev_emb: Tensor | None) -> float:  # [1, H], [1, r] -> sigmoid(c_k)
        drafter = self.drafter
        inputs = torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1) if drafter.confidence_with_markov else hidden
        return float(torch.sigmoid(drafter.confidence_head(inputs)[0].float()))


def _register() -> None:
    from trainer.eval.speculative import register_proposer
    from trainer.model.dspark import DSparkDrafter

    register_proposer(DSparkDrafter, DSparkProposer)


_register()
