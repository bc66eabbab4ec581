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


# --- the drafter's own shape and sliding-window layers ------------------------------------------------------

SLIDING = ["sliding_attention", "full_attention"]


def make_sliding_drafter(window=3, non_causal=False, seed=0):
    torch.manual_seed(seed)
    target_config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    )
    shape = {"layer_types": SLIDING, "sliding_window": window, "sliding_window_non_causal": non_causal,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 4}
    drafter = DFlashDrafter.from_target_config(target_config, 2, FEATURES, BLOCK, mask_token_id=VOCAB - 1, shape=shape)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return drafter.eval()


def sliding_masks(layout, window, non_causal=False):
    return {"full_attention": layout["mask"],
            "sliding_attention": sdpa_mask(layout["anchors"], layout["valid"], layout["doc_ids"], BLOCK, False,
                                           window, non_causal)}


def test_draft_shape_overrides_the_target_and_the_window_gates_are_written():
    drafter = make_sliding_drafter()
    config = drafter.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 4)
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (8 * 4, HIDDEN)
    assert drafter.layers[0].self_attn.k_proj.weight.shape == (2 * 4, HIDDEN)
    # Qwen3Config drops sliding_window unless use_sliding_window is set: both are, so a reload keeps the window
    assert config.layer_types == SLIDING and config.sliding_window == 3 and config.use_sliding_window
    reloaded = Qwen3Config.from_dict(config.to_dict())
    assert reloaded.sliding_window == 3 and reloaded.layer_types == SLIDING
    assert [layer.self_attn.sliding_window for layer in drafter.layers] == [3, None]


def test_a_sliding_drafter_refuses_a_single_mask():
    drafter, layout = make_sliding_drafter(), training_layout()
    with pytest.raises(ValueError, match="one mask per layer type"):
        drafter(layout["block"], layout["context"], layout["positions"], layout["mask"])


def test_the_window_hides_old_context_from_the_sliding_layer_only():
    # Block 1 is anchored at 3 (document 0): with window 2 it sees context 1..2 in its sliding layer, 0..2 in
    # its full layer. Perturbing position 0 still reaches it (through the full layer); a drafter whose every
    # layer slides does not see it at all.
    layout = training_layout()
    drafter = make_sliding_drafter(window=2)
    masks = sliding_masks(layout, 2)
    assert block_output_change(drafter, layout, perturb_context=0, mask=masks)[1] > 1e-3
    everywhere = {"full_attention": masks["sliding_attention"], "sliding_attention": masks["sliding_attention"]}
    assert block_output_change(drafter, layout, perturb_context=0, mask=everywhere)[1] == 0.0
    assert block_output_change(drafter, layout, perturb_context=1, mask=everywhere)[1] > 1e-3


def test_sliding_layer_is_causal_within_the_block():
    # Every layer slides with a window covering the whole context: perturbing block slot 2 must not change
    # slots 0..1 (causal), and does with sliding_window_non_causal.
    layout = training_layout()
    for non_causal in (False, True):
        drafter = make_sliding_drafter(window=16, non_causal=non_causal)
        window_mask = sliding_masks(layout, 16, non_causal)["sliding_attention"]
        masks = {"full_attention": window_mask, "sliding_attention": window_mask}
        with torch.no_grad():
            base = drafter(layout["block"], layout["context"], layout["positions"], masks)
            block = layout["block"].clone()
            block[:, 2] += 3.0  # block 0, slot 2
            out = drafter(block, layout["context"], layout["positions"], masks)
        earlier = (out - base)[:, :2].abs().max().item()
        assert (earlier > 1e-3) == non_causal


@pytest.mark.parametrize("non_causal", [False, True])
def test_inference_with_a_cache_applies_the_window_as_training_does(non_causal):
    # One block anchored at 11 of a 15-token document: the training mask (per layer type) and the inference
    # pass over a cache fed in two chunks (7 then 4 context positions) give the same block output.
    window, anchor, S = 4, 11, 15
    drafter = make_sliding_drafter(window=window, non_causal=non_causal)
    torch.manual_seed(7)
    features = torch.randn(1, S, FEATURES * HIDDEN)
    block = torch.randn(1, BLOCK, HIDDEN)
    anchors, valid, doc_ids = torch.tensor([[anchor]]), torch.tensor([[True]]), torch.zeros(1, S, dtype=torch.long)
    masks = {"full_attention": sdpa_mask(anchors, valid, doc_ids, BLOCK, False),
             "sliding_attention": sdpa_mask(anchors, valid, doc_ids, BLOCK, False, window, non_causal)}
    positions = torch.cat([torch.arange(S), anchor + torch.arange(BLOCK)])[None]
    with torch.no_grad():
        trained = drafter(block, features, positions, masks)
        cache = DynamicCache()
        drafter(torch.randn(1, BLOCK, HIDDEN), features[:, :7], torch.arange(0, 7 + BLOCK)[None],
                past_key_values=cache, use_cache=True)
        crop_cache(cache, 7)
        served = drafter(block, features[:, 7:anchor], torch.arange(7, anchor + BLOCK)[None],
                         past_key_values=cache, use_cache=True)
        uncached = drafter(block, features[:, :anchor], torch.arange(0, anchor + BLOCK)[None])
    torch.testing.assert_close(served, trained, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(uncached, trained, atol=1e-5, rtol=1e-5)
    # Served as full attention (no window), the same block drafts something else: the test can fail.
    full = make_sliding_drafter(window=window, non_causal=non_causal)
    full.load_state_dict(drafter.state_dict())
    full.attention = type(full.attention)(("full_attention",) * 2)
    for layer in full.layers:
        layer.self_attn.layer_type = "full_attention"
    with torch.no_grad():
        as_full = full(block, features[:, :anchor], torch.arange(0, anchor + BLOCK)[None])
    assert (as_full - trained).abs().max() > 1e-3


def test_inference_needs_the_cache_contiguous_from_position_zero():
    drafter = make_sliding_drafter()
    cache = DynamicCache()
    with torch.no_grad():
        drafter(torch.randn(1, BLOCK, HIDDEN), torch.randn(1, 5, FEATURES * HIDDEN), torch.arange(0, 5 + BLOCK)[None],
                past_key_values=cache, use_cache=True)
        crop_cache(cache, 5)
        with pytest.raises(ValueError, match="contiguous from 0"):
            drafter(torch.randn(1, BLOCK, HIDDEN), torch.randn(1, 2, FEATURES * HIDDEN),
                    torch.arange(9, 11 + BLOCK)[None], past_key_values=cache, use_cache=True)


def test_draft_shape_errors_are_one_line():
    from trainer.config import ConfigError
    from trainer.model.drafter import draft_config_from_target

    target = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8)
    with pytest.raises(ConfigError, match="not divisible by num_key_value_heads 3"):
        draft_config_from_target(target, 2, {"num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="names 3 layers but the drafter has 2"):
        draft_config_from_target(target, 2, {"layer_types": ["full_attention"] * 3})
    # heads alone: head_dim = hidden // heads and as many kv heads (the target's belong to its own heads)
    alone = draft_config_from_target(target, 2, {"num_attention_heads": 2})
    assert (alone.num_attention_heads, alone.num_key_value_heads, alone.head_dim) == (2, 2, 16)


def test_target_only_rope_keys_stay_out_of_the_drafter():
    from transformers import Qwen3_5TextConfig

    from trainer.model.drafter import draft_config_from_target

    target = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                      "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    rope = draft_config_from_target(target, 1).rope_parameters
    assert rope == {"rope_type": "default", "rope_theta": 1e7}  # full rotary, 1-D: as the drafter rotates
