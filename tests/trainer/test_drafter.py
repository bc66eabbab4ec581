"""The drafter module: fc over all features, cache equivalence, isolation through the real mask, training."""

import pytest
import torch
from transformers import DynamicCache, Qwen3Config

from trainer.model.attention_mask import flex_block_mask, sdpa_mask
from trainer.model.drafter import DFlashDrafter, crop_cache
from trainer.model.loss import decay_weights, dflash_loss

HIDDEN, FEATURES, BLOCK, VOCAB = 32, 3, 4, 50


def make_drafter(seed=0, num_layers=2):
    torch.manual_seed(seed)
    target_config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    )
    drafter = DFlashDrafter.from_target_config(target_config, num_layers, FEATURES, BLOCK, mask_token_id=VOCAB - 1)
    # Non-trivial norm gains, so a bug that skips a norm cannot hide behind weights of one.
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return drafter.eval()


def test_weight_names_follow_the_z_lab_layout():
    drafter = make_drafter(num_layers=2)
    names = set(drafter.state_dict())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
        expected |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        expected |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert names == expected
    assert drafter.config.num_hidden_layers == 2 and drafter.config.hidden_size == HIDDEN


def test_draft_config_copies_the_target_shape():
    target_config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=9, num_attention_heads=6,
        num_key_value_heads=3, head_dim=16, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    drafter = DFlashDrafter.from_target_config(target_config, 3, FEATURES, BLOCK, mask_token_id=7)
    config = drafter.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (48, 80, 3)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (6, 3, 16)
    assert config.rms_norm_eps == 1e-5 and config.rope_parameters["rope_theta"] == 5e5
    assert drafter.layers[0].self_attn.k_proj.weight.shape == (3 * 16, 48)
    assert (drafter.block_size, drafter.mask_token_id, drafter.num_features) == (BLOCK, 7, FEATURES)


def test_fc_reads_every_selected_layer():
    drafter = make_drafter()
    assert drafter.fc.weight.shape == (HIDDEN, FEATURES * HIDDEN)
    torch.manual_seed(1)
    block = torch.randn(1, BLOCK, HIDDEN)
    context = torch.randn(1, 6, FEATURES * HIDDEN)
    positions = torch.arange(6 + BLOCK).unsqueeze(0)
    with torch.no_grad():
        base = drafter(block, context, positions)
        for chunk in range(FEATURES):
            perturbed = context.clone()
            perturbed[..., chunk * HIDDEN : (chunk + 1) * HIDDEN] += 1.0
            out = drafter(block, perturbed, positions)
            assert (out - base).abs().max() > 1e-3, f"feature chunk {chunk} does not reach the output"


def test_fused_context_is_normed_after_fc():
    # fc is linear and hidden_norm (an RMSNorm) removes scale, so scaling every context feature by a
    # positive constant must not change the output; without the norm it would.
    drafter, layout = make_drafter(), training_layout()
    with torch.no_grad():
        base = drafter(layout["block"], layout["context"], layout["positions"], layout["mask"])
        scaled = drafter(layout["block"], 7.0 * layout["context"], layout["positions"], layout["mask"])
    torch.testing.assert_close(scaled, base, atol=1e-4, rtol=1e-4)


def test_only_relative_positions_matter():
    # RoPE on queries and on both key sources: shifting every position by the same amount changes nothing,
    # moving the block relative to its context does.
    drafter, layout = make_drafter(), training_layout()
    positions, seq_len = layout["positions"], 14
    moved_block = positions.clone()
    moved_block[:, seq_len:] += 5
    with torch.no_grad():
        base = drafter(layout["block"], layout["context"], positions, layout["mask"])
        shifted = drafter(layout["block"], layout["context"], positions + 11, layout["mask"])
        moved = drafter(layout["block"], layout["context"], moved_block, layout["mask"])
    torch.testing.assert_close(shifted, base, atol=1e-4, rtol=1e-4)
    assert (moved - base).abs().max() > 1e-3


def test_cached_incremental_decoding_equals_one_uncached_pass():
    drafter = make_drafter()
    torch.manual_seed(2)
    context = torch.randn(1, 7, FEATURES * HIDDEN)  # 7 context positions, fed as 4 then 3
    first_block = torch.randn(1, BLOCK, HIDDEN)  # drafted after the first chunk, at positions 4..7
    second_block = torch.randn(1, BLOCK, HIDDEN)  # drafted after the second chunk, at positions 7..10
    with torch.no_grad():
        cache = DynamicCache()
        out1 = drafter(
            first_block, context[:, :4], torch.arange(0, 4 + BLOCK)[None], past_key_values=cache, use_cache=True
        )
        assert cache.get_seq_length() == 4 + BLOCK
        crop_cache(cache, 4)  # the block's K/V are dropped; the context's stay
        out2 = drafter(
            second_block, context[:, 4:], torch.arange(4, 7 + BLOCK)[None], past_key_values=cache, use_cache=True
        )
        crop_cache(cache, 7)
        assert cache.get_seq_length() == 7

        ref1 = drafter(first_block, context[:, :4], torch.arange(0, 4 + BLOCK)[None])
        ref2 = drafter(second_block, context, torch.arange(0, 7 + BLOCK)[None])
    torch.testing.assert_close(out1, ref1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2, ref2, atol=1e-5, rtol=1e-5)
    # Without the cache the second block would miss the first chunk: the cache really carries context.
    with torch.no_grad():
        no_cache = drafter(second_block, context[:, 4:], torch.arange(4, 7 + BLOCK)[None])
    assert (out2 - no_cache).abs().max() > 1e-3


def training_layout(context_includes_anchor=False):
    """Two packed documents, three blocks: positions, mask and inputs as the training step builds them."""
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])  # [1, S=14]
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7]])  # per document
    anchors = torch.tensor([[2, 3, 9]])  # adjacent blocks in doc 0, one in doc 1
    valid = torch.tensor([[True, True, True]])
    block_pos = (position_ids[0, anchors[0]].unsqueeze(-1) + torch.arange(BLOCK)).view(1, -1)  # anchor + j
    positions = torch.cat([position_ids, block_pos], dim=1)  # [1, S + A*B]
    mask = sdpa_mask(anchors, valid, doc_ids, BLOCK, context_includes_anchor)
    torch.manual_seed(3)
    block = torch.randn(1, 3 * BLOCK, HIDDEN)
    context = torch.randn(1, 14, FEATURES * HIDDEN)
    return dict(
        anchors=anchors, valid=valid, doc_ids=doc_ids, positions=positions, mask=mask, block=block, context=context
    )


def block_output_change(drafter, layout, perturb_block=None, perturb_context=None, mask=None):
    """Max change of each block's output when one block's tokens or one context position is perturbed."""
    mask = layout["mask"] if mask is None else mask
    with torch.no_grad():
        base = drafter(layout["block"], layout["context"], layout["positions"], mask)
        block, context = layout["block"].clone(), layout["context"].clone()
        if perturb_block is not None:
            block[:, perturb_block * BLOCK : (perturb_block + 1) * BLOCK] += 3.0
        if perturb_context is not None:
            context[:, perturb_context] += 3.0
        out = drafter(block, context, layout["positions"], mask)
    return [(out - base)[:, a * BLOCK : (a + 1) * BLOCK].abs().max().item() for a in range(3)]


def rope_by_hand(x, positions, theta):
    """x [T, d] at integer positions [T]: rotate pairs (i, i + d/2) by angle pos * theta^(-2i/d)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32) * 2 / x.shape[-1])  # [d/2]
    angle = positions.float()[:, None] * inv_freq  # [T, d/2]
    x1, x2 = x[:, :half], x[:, half:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], dim=-1)


def test_one_layer_matches_a_hand_written_dflash_layer():
    drafter, layout = make_drafter(num_layers=1), training_layout()
    layer, attn = drafter.layers[0], drafter.layers[0].self_attn
    block, features = layout["block"][0], layout["context"][0]  # [Q, H], [S, k*H]
    positions, mask = layout["positions"][0], layout["mask"][0, 0]  # [S+Q], [Q, S+Q]
    heads, kv_heads, head_dim = 4, 2, 8
    theta = drafter.config.rope_parameters["rope_theta"]
    with torch.no_grad():
        context = drafter.hidden_norm(drafter.fc(features))  # [S, H]: fc over all k layers, then the norm
        h = layer.input_layernorm(block)  # [Q, H]
        seq_len = context.shape[0]
        head_outputs = []
        for head in range(heads):
            kv_head = head // (heads // kv_heads)  # grouped-query attention
            rows = slice(head * head_dim, (head + 1) * head_dim)
            kv_rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
            q = attn.q_norm((h @ attn.q_proj.weight.T)[:, rows])
            # Context keys/values come from the SAME layer's k_proj/v_proj applied to the fused context.
            k = torch.cat([(context @ attn.k_proj.weight.T)[:, kv_rows], (h @ attn.k_proj.weight.T)[:, kv_rows]])
            v = torch.cat([(context @ attn.v_proj.weight.T)[:, kv_rows], (h @ attn.v_proj.weight.T)[:, kv_rows]])
            q = rope_by_hand(q, positions[seq_len:], theta)
            k = rope_by_hand(attn.k_norm(k), positions, theta)
            scores = (q @ k.T) / head_dim**0.5  # [Q, S+Q]
            scores = scores.masked_fill(~mask, float("-inf"))
            head_outputs.append(scores.softmax(dim=-1) @ v)
        x = block + torch.cat(head_outputs, dim=-1) @ attn.o_proj.weight.T
        expected = drafter.norm(x + layer.mlp(layer.post_attention_layernorm(x)))
        out = drafter(layout["block"], layout["context"], layout["positions"], layout["mask"])[0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_blocks_are_isolated_from_each_other():
    drafter, layout = make_drafter(), training_layout()
    change = block_output_change(drafter, layout, perturb_block=0)
    assert change[0] > 1e-3  # the perturbed block itself moves (the test can fail)
    assert change[1] == 0.0 and change[2] == 0.0  # its adjacent neighbour and the other document's do not


def test_context_visibility_through_the_real_mask():
    drafter, layout = make_drafter(), training_layout()
    # Position 2 is block 0's anchor: invisible to block 0, visible to block 1 (anchored at 3).
    change = block_output_change(drafter, layout, perturb_context=2)
    assert change[0] == 0.0 and change[1] > 1e-3 and change[2] == 0.0
    # Position 5 is after both doc-0 anchors; position 8 is before block 2's anchor but block 2 is doc 1.
    assert block_output_change(drafter, layout, perturb_context=5) == [0.0, 0.0, 0.0]
    change = block_output_change(drafter, layout, perturb_context=8)
    assert change[0] == 0.0 and change[1] == 0.0 and change[2] > 1e-3
    # Document 0 never reaches document 1's block.
    assert block_output_change(drafter, layout, perturb_context=0)[2] == 0.0
    # With the v6 bug the anchor's own position leaks into its block.
    v6 = training_layout(context_includes_anchor=True)
    assert block_output_change(drafter, v6, perturb_context=2)[0] > 1e-3


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_gives_the_sdpa_output():
    drafter, layout = make_drafter(), training_layout()
    block_mask = flex_block_mask(layout["anchors"], layout["valid"], layout["doc_ids"], BLOCK, False)
    with torch.no_grad():
        dense = drafter(layout["block"], layout["context"], layout["positions"], layout["mask"])
        flex = drafter(layout["block"], layout["context"], layout["positions"], block_mask)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_compute_dtype_follows_the_inputs():
    drafter = make_drafter().to(torch.bfloat16)
    layout = training_layout()
    with torch.no_grad():
        out = drafter(layout["block"].bfloat16(), layout["context"].bfloat16(), layout["positions"], layout["mask"])
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_drafter_trains_on_a_fixed_batch():
    drafter = make_drafter().train()
    layout = training_layout()
    torch.manual_seed(5)
    # A frozen stand-in for the target's embedding and lm_head.
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    target_logits = torch.randn(1, 3, BLOCK, VOCAB) * 3
    weights = torch.ones(1, 3, BLOCK) * decay_weights(BLOCK, 4.0)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        hidden = drafter(layout["block"], layout["context"], layout["positions"], layout["mask"])
        draft_logits = lm_head(hidden).view(1, 3, BLOCK, VOCAB)
        loss, _ = dflash_loss(draft_logits, target_logits, weights, "ce")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
