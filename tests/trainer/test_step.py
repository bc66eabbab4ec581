"""The training step's wiring, on a real saved HF target: what the drafter is given (block tokens,
positions anchor + j, the mask), and what the loss is computed against."""

from __future__ import annotations

import pytest
import torch

from test_target import CPU, save_tiny_target
from tiny_targets import save_family_target
from trainer.config import build_config, resolve_for_target
from trainer.data.datasets import Document, batch_for_step, pack_documents
from trainer.model.attention_mask import sdpa_mask
from trainer.run.loop import build_drafter
from trainer.run.step import StepPlan, dflash_step, sample_step_anchors
from trainer.target.embedded import build_embedded_tokenizer
from trainer.target.frozen import FrozenTarget


class Recorder(torch.nn.Module):
    """The real drafter, with what it was called with kept for the test."""

    def __init__(self, drafter: torch.nn.Module) -> None:
        super().__init__()
        self.drafter = drafter
        self.calls: list[tuple] = []

    def forward(self, block_embeds, context_features, position_ids, attention_mask=None):
        self.calls.append((block_embeds, context_features, position_ids, attention_mask))
        return self.drafter(block_embeds, context_features, position_ids, attention_mask=attention_mask)


def test_the_step_feeds_anchor_blocks_at_anchor_plus_j(tmp_path):
    torch.manual_seed(0)
    tokenizer = build_embedded_tokenizer(small=True)
    target = FrozenTarget.load(str(save_tiny_target(tmp_path / "t", tokenizer)), CPU)
    config = resolve_for_target(
        build_config(overrides=["block_size=4", "max_anchors=3", "draft_layers=1", "target_layer_ids=[0,2]",
                                "seq_len=24", "batch_size=2"]),
        target.num_layers,
    )
    plan = StepPlan.from_config(config, target)
    # Two documents per row: position ids restart at 0 for the second one.
    docs = [Document(list(range(5, 5 + n)), [1] * n) for n in (9, 11, 7, 13)]
    batch = batch_for_step(pack_documents(docs, config.seq_len, target.pad_token_id), 1, config.batch_size, 0)
    anchors, valid = sample_step_anchors(batch, plan, seed=0, step=1)
    drafter = Recorder(build_drafter(config, target, plan))

    loss, metrics = dflash_step(target, drafter, batch, anchors, valid, plan)

    assert torch.isfinite(loss) and 0.0 <= metrics["acc"] <= 1.0
    block_embeds, features, positions, _ = drafter.calls[0]
    N, A, B = anchors.shape[0], anchors.shape[1], config.block_size
    expected_ids = torch.full((N, A, B), plan.mask_token_id)
    expected_positions = torch.zeros((N, A, B), dtype=torch.long)
    for n in range(N):
        for a in range(A):
            p = int(anchors[n, a])
            expected_ids[n, a, 0] = batch["input_ids"][n, p]  # slot 0: the anchor token itself
            for j in range(B):
                expected_positions[n, a, j] = batch["position_ids"][n, p] + j  # the anchor's position + j
    assert torch.equal(block_embeds, target.embed(expected_ids.reshape(N, A * B)))
    S = batch["input_ids"].shape[1]
    assert torch.equal(positions[:, :S], batch["position_ids"])  # context keeps its own positions
    assert torch.equal(positions[:, S:], expected_positions.reshape(N, A * B))
    assert features.shape == (N, S, 2 * target.hidden_size)  # both selected layers feed fc


def naive_step_loss(target, hidden, batch, anchors, valid, plan):
    """The step's loss as it was built before chunking: the model's own [N, S, V] logits, gathered at p+j-1,
    the drafter's whole [N, A, B, V] logits, float32 log-softmax, CE against the teacher's argmax."""
    from trainer.model.loss import LOSS_REDUCTION_EPS, gather_block_logits, slot_weights

    N, A = anchors.shape
    B = plan.block_size
    _, logits = target.forward_packed(batch["input_ids"], batch["position_ids"], batch["doc_ids"],
                                      plan.feature_layer_ids, plan.logits_source)  # [N, S, V]
    vocab = plan.draft_token_ids
    if vocab is not None:
        logits = logits[..., vocab]
    teacher = gather_block_logits(logits, anchors, B).float()  # [N, A, B, V]
    draft_logp = torch.log_softmax(target.logits(hidden, vocab).reshape(N, A, B, -1).float(), dim=-1)
    per_slot = -draft_logp.gather(-1, teacher.argmax(-1, keepdim=True)).squeeze(-1)
    weights = slot_weights(anchors, valid, batch["loss_mask"], batch["doc_ids"], B, plan.gamma)
    count = (weights > 0).flatten(1).sum(1)
    return ((weights * per_slot).flatten(1).sum(1) / (count + LOSS_REDUCTION_EPS)).mean()


def dense_masks(anchors, valid, doc_ids, plan):
    """The drafter's masks as whole SDPA grids (one per layer type when layers slide): the path before the
    CPU's segmented attention, independent of it."""
    attention = plan.draft_attention
    if attention is None or not attention.slides:
        return sdpa_mask(anchors, valid, doc_ids, plan.block_size, plan.context_includes_anchor)
    return {kind: sdpa_mask(anchors, valid, doc_ids, plan.block_size, plan.context_includes_anchor,
                            attention.window_of(kind), attention.sliding_window_non_causal)
            for kind in set(attention.layer_types)}


SLIDING = ["draft_layers=2", "draft_config.layer_types=[sliding_attention,full_attention]",
           "draft_config.sliding_window=5"]


@pytest.mark.parametrize("family, drafter", [("qwen3", ["draft_layers=1"]), ("qwen3", SLIDING), ("qwen3_5", SLIDING)])
def test_the_chunked_step_equals_the_whole_tensor_step_in_loss_and_gradients(tmp_path, family, drafter):
    """Teacher logits only where slots need them, the loss in chunks of one block, segmented CPU attention:
    the same loss and the same gradient on every drafter weight as the step that built [N, S, V] and
    [N, A, B, V] with dense masks (a draft vocabulary, an intermediate-layer teacher and the final one; a
    drafter with a sliding-window layer; a hybrid recurrent Qwen3.5 target run per document)."""
    torch.manual_seed(0)
    tokenizer = build_embedded_tokenizer(small=True)
    path = (save_tiny_target(tmp_path / "t", tokenizer) if family == "qwen3"
            else save_family_target(family, tmp_path / "t", tokenizer))
    target = FrozenTarget.load(str(path), CPU)
    if family != "qwen3":
        target.packing = "per_document"  # what the fidelity check picks for a recurrent target on CPU
    docs = [Document(list(range(5, 5 + n)), [1] * n) for n in (9, 11, 7, 13)]
    for source, vocab in (("final", None), (1, torch.tensor([3, 5, 7, 8, 9, 11, 12, 15, 20]))):
        config = resolve_for_target(
            build_config(overrides=["block_size=4", "max_anchors=4", "target_layer_ids=[0,2]", "seq_len=24",
                                    "batch_size=2", "loss_chunk_size=4", f"target_logits_source={source}",
                                    *drafter]),
            target.num_layers,
        )
        plan = StepPlan.from_config(config, target, vocab)
        batch = batch_for_step(pack_documents(docs, config.seq_len, target.pad_token_id), 1, config.batch_size, 0)
        anchors, valid = sample_step_anchors(batch, plan, seed=0, step=1)
        drafter_module = Recorder(build_drafter(config, target, plan))
        loss, _ = dflash_step(target, drafter_module, batch, anchors, valid, plan)
        loss.backward()
        ours = {name: p.grad.clone() for name, p in drafter_module.named_parameters()}
        drafter_module.zero_grad()
        block_embeds, features, positions, _ = drafter_module.calls[0]
        hidden = drafter_module.drafter(block_embeds, features, positions,
                                        attention_mask=dense_masks(anchors, valid, batch["doc_ids"], plan))
        expected = naive_step_loss(target, hidden, batch, anchors, valid, plan)
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for name, p in drafter_module.named_parameters():
            torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
