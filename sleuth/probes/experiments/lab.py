"""The lab: thresholds, the influence measure, and one subject with its synthetic target and batch."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from sleuth.probes.protocol import ProbeBatch, ProbeHooks, ProbeTarget
from sleuth.probes.target import Layout, make_batch, make_layout
from sleuth.probes.verdict import Expectations


NO_EFFECT = 1e-6  # relative change of the logits at or below this: the perturbed input is not seen
EFFECT = 1e-3  # at or above this: it is seen
AGREEMENT = 0.97  # share of trained slots whose recovered target must agree with a candidate teacher (near-ties aside)
ONE_HOT = 0.99  # a recovered target distribution with this much mass on one token is one-hot
SOFT_TV = 0.05  # total variation below which a recovered soft target equals a candidate's softmax
GAMMA_RTOL = 0.01  # a fitted gamma within 1 % of an accepted value matches it
EXP_FIT = 0.01  # largest residual of log-weights allowed for "exp(-(k-1)/gamma)"
DATA_DEPENDENT = 1e-3  # relative change of the slot weights between two confidence levels
WEIGHT_FIT = 0.01  # largest relative error of a weighting model (D-PACE, a gamma) against the measured weights
REDUCTION_RTOL = 1e-4  # |sum of the slot weights - 1| allowed for a promised weighted mean (float32 sums)
GRADIENT_FORM = 1e-3  # residual of grad = w * (softmax(z) - q) allowed for CE and forward KL
POSITION_FIT = 1e-3  # relative residual of a query / key against its rotation at the position found
SAMPLER_DRAWS = 24  # draws of the subject's anchor sampler
STACK_ROWS = 32  # rows per forward when perturbed copies of the batch are stacked
REFERENCE_DEPTHS = (36, 45, 64)  # target depths the subject's rule is also called at (45: rounding and truncation part)
RULE_COUNTS = (2, 3, 4, 5)  # numbers of selected layers the rule is called for, where it takes one


def influence(before: Tensor, after: Tensor) -> float:
    """max |after - before| / max |before|: how much a perturbation moved these outputs."""
    scale = before.abs().max().item()
    return (after - before).abs().max().item() / max(scale, 1e-12)


def seen(change: float) -> bool | None:
    if change >= EFFECT:
        return True
    if change <= NO_EFFECT:
        return False
    return None


class Lab:
    """One subject with its synthetic target and batch, and helpers to run it perturbed."""

    def __init__(self, subject: Any, info: dict[str, Any], target: ProbeTarget, expectations: Expectations,
                 seed: int = 0) -> None:
        # describe() is read again once the subject is built: building decides some of what it reports
        # (the layer ids its own rule chose for this target, the block size its config resolved to).
        info = {**info, **dict(subject.describe() or {})}
        self.subject, self.info, self.target, self.expectations, self.seed = subject, info, target, expectations, seed
        self.block_size = int(info["block_size"])
        # A subject whose forward takes no document ids (describe()["documents_per_row"] = 1) gets one document
        # per row; the verdicts that depend on packing then say so (never `match`).
        self.packed = info.get("documents_per_row") != 1
        self.max_rows = int(info.get("max_rows") or STACK_ROWS)
        self.layout: Layout = make_layout(self.block_size, packed=self.packed, rows=min(self.max_rows, 2))
        self.batch: ProbeBatch = make_batch(target, self.layout, seed + 1)
        self.configured: dict[str, dict[str, Any]] = dict(info.get("configured") or {})
        self.facts: dict[str, Any] = {}  # measurements one experiment leaves for a later one
        self._baseline: Tensor | None = None

    @property
    def rows(self) -> int:
        return len(self.layout.rows)

    def logits(self, batch: ProbeBatch | None = None, hooks: ProbeHooks | None = None) -> Tensor:  # [N, A, B, V]
        batch = batch or self.batch
        with torch.no_grad():
            out = self.subject.draft_logits(batch, hooks or ProbeHooks())
        n, a = batch.anchors.shape
        return out.detach().float().reshape(n, a, self.block_size, out.shape[-1])

    def logits_of_many(self, batches: list[ProbeBatch]) -> list[tuple[Tensor, Tensor]]:
        """(unperturbed, perturbed) logits for each batch, several per forward where the subject takes that
        many rows: the copies are stacked as extra rows (dozens of tiny forwards cost far more than a few
        wider ones), each chunk with an unperturbed copy of its own as the reference. Rows never interact
        in a correct drafter; a cross-row leak is measured on its own (and would show as a leak here too)."""
        per = max(1, min(self.max_rows, STACK_ROWS) // self.rows - 1)
        found: list[tuple[Tensor, Tensor]] = []
        for start in range(0, len(batches), per):
            chunk = batches[start : start + per]
            if per == 1:
                found += [(self.baseline, self.logits(b)) for b in chunk]
                continue
            stacked = self.logits(_stack([self.batch, *chunk]))
            parts = stacked.split(self.rows)
            found += [(parts[0], p) for p in parts[1:]]
        return found

    @property
    def baseline(self) -> Tensor:
        if self._baseline is None:
            self._baseline = self.logits()
        return self._baseline

    def with_anchors(self, keep: int) -> Lab:
        """This lab with only the first `keep` anchors of each row (and the padded slot): a batch whose blocks
        are fewer than the row's positions."""
        import copy

        from sleuth.probes.target import Layout, Row

        rows = tuple(Row(documents=r.documents, length=r.length, anchors=r.anchors[:keep], holes=r.holes)
                     for r in self.layout.rows)
        layout = Layout(block_size=self.block_size, seq_len=self.layout.seq_len, rows=rows, packed=self.packed)
        other = copy.copy(self)
        other.layout, other.facts, other._baseline = layout, dict(self.facts), None
        slots = layout.num_anchors
        anchors = torch.zeros(self.rows, slots, dtype=torch.long)
        valid = torch.zeros(self.rows, slots, dtype=torch.bool)
        for n, row in enumerate(rows):
            anchors[n, : len(row.anchors)] = torch.tensor(row.anchors)
            valid[n, : len(row.anchors)] = True
        other.batch = self.batch.replace(anchors=anchors, anchor_valid=valid)
        other.facts["slot0_tokens_wrong"] = [t for t in self.facts.get("slot0_tokens_wrong") or []
                                             if any(t[1] in r.anchors for r in rows)]
        return other

    def valid_blocks(self) -> list[tuple[int, int, int]]:
        return self.layout.blocks()

    def bump_block_tokens(self, tokens: list[int], seed: int, scale: float = 3.0) -> ProbeHooks:
        """Hooks that add noise to the input embeddings of these block-stream tokens (index a*B + j), every row."""

        def hook(x: Tensor) -> Tensor:
            g = torch.Generator().manual_seed(seed)
            x = x.clone()
            index = torch.tensor(tokens, dtype=torch.long)
            noise = torch.randn(x.index_select(-2, index).shape, generator=g).to(x.dtype)
            x.index_add_(x.dim() - 2, index, scale * noise)
            return x

        return ProbeHooks(block_embeddings=hook)

    def coverage(self, **extra: Any) -> dict[str, Any]:
        """What the batch exercised; experiments add what they observed."""
        layout = self.layout
        found = {
            "rows": self.rows,
            "blocks_per_row": [len(r.anchors) for r in layout.rows],
            "block_size": self.block_size,
            "documents_per_row": [len(r.documents) for r in layout.rows],
            "adjacent_anchors": len(layout.adjacent_pairs()),
            "anchors_at_document_edges": {k: len(v) for k, v in layout.edge_anchors().items()},
            "padded_anchor_slots": self.rows,
            "loss_mask_holes": sum(len(r.holes) for r in layout.rows),
        }
        if self.configured:
            found["config_values"] = self.configured
        found.update(extra)
        return found

    def packing_gap(self) -> list[str]:
        if self.packed:
            return []
        return ["documents packed in one row (the subject's forward takes no document ids or positions, so "
                "cross-document rules could not be tried)"]

    def configured_value(self, key: str) -> tuple[Any, str | None]:
        entry = self.configured.get(key)
        if not isinstance(entry, dict):
            return None, None
        return entry.get("value"), str(entry.get("source") or "")


def _stack(batches: list[ProbeBatch]) -> ProbeBatch:
    first = batches[0]
    cat = lambda name: torch.cat([getattr(b, name) for b in batches], dim=0)  # noqa: E731
    return first.replace(
        input_ids=cat("input_ids"), position_ids=cat("position_ids"), doc_ids=cat("doc_ids"), loss_mask=cat("loss_mask"),
        anchors=cat("anchors"), anchor_valid=cat("anchor_valid"), last_hidden=cat("last_hidden"), logits=cat("logits"),
        hidden_states=tuple(torch.cat([b.hidden_states[i] for b in batches], dim=0) for i in range(len(first.hidden_states))))


def from_run_config(source: str | None) -> bool:
    return bool(source) and "run config" in str(source)


def randomize_drafter(subject: Any, target: ProbeTarget, seed: int) -> int:
    """Give every drafter weight a visible random value, so every path carries signal.

    A fresh drafter (N(0, 0.02) linears, unit norms) passes perturbations through at 1e-5 scale, too close
    to rounding to call. Tensors equal to the target's (embeddings, lm_head, final norm; the norm also as w - 1,
    the x * (1 + w) convention of Qwen3.5 / Gemma checkpoints) are left alone.
    """
    g = torch.Generator().manual_seed(seed)
    shared = (target.embed_weight, target.lm_head_weight, target.norm_weight, target.norm_weight.float() - 1.0)
    changed = 0
    with torch.no_grad():
        for param in subject.parameters().values():
            if not param.is_floating_point() or any(_same(param, t) for t in shared):
                continue
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=g))
            else:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=g) / math.sqrt(fan_in))
            changed += 1
    return changed


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.detach().float(), b.float())
