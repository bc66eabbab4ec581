"""The training step's wiring, on a real saved HF target: what the drafter is given (block tokens,
positions anchor + j, the mask), and what the loss is computed against."""

from __future__ import annotations

import torch

from test_target import CPU, save_tiny_target
from trainer.config import build_config, resolve_for_target
from trainer.data.datasets import Document, batch_for_step, pack_documents
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
