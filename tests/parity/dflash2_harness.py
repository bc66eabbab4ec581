"""Our DFlash2 drafter and speculators' `DFlash2DraftModel` on identical weights (shared by
tests/parity/test_dflash2_parity.py and bench/train_step.py --drafter dflash2).

speculators' DFlash2 names its weights as ours do, so its model loads our drafter's state dict as is; the frozen
tensors (embedding, lm_heads, verifier norm) come from the parity inputs. speculators is imported only inside
build_speculators_model, so the benchmark can still time ours alone where speculators is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity_harness import ModelDims, ParityCase

from trainer.config import DFlash2Config
from trainer.model.dflash2 import DFlash2Drafter


@dataclass(frozen=True)
class Case:
    base: ParityCase
    settings: DFlash2Config
    layer_types: tuple[str, ...] | None = None  # sliding layers, non-causal in the block (DFlash2's default)
    window: int | None = None

    def shape(self) -> dict | None:
        if self.layer_types is None:
            return None
        return {"layer_types": list(self.layer_types), "sliding_window": self.window, "sliding_window_non_causal": True}


def case(name, block, anchors, docs, seq_len, gamma, kind, attn, seed, dims=ModelDims(), sliding=None,
         **settings) -> Case:
    layer_types, window = sliding or (None, None)
    return Case(ParityCase(name, block, anchors, docs, seq_len, gamma, kind, attn, seed=seed, dims=dims),
                DFlash2Config(**settings), layer_types, window)


def build_our_drafter(c: Case) -> DFlash2Drafter:
    """Every weight random: norm gains near 1, convolution taps far from identity, codebooks large enough that
    the selector reorders the unary top-K."""
    d, b = c.base.dims, c.base
    torch.manual_seed(b.seed + 1)
    drafter = DFlash2Drafter.from_target_config(
        d.target_config(), num_layers=d.draft_layers, num_features=d.num_features, block_size=b.block_size,
        mask_token_id=b.mask_token_id, shape=c.shape(), dflash2=c.settings,
    )
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("base_kernel"):
                param.copy_(0.5 * torch.randn_like(param))
                param[:, 0] += 1.0
            elif "codebook" in name:  # large enough to reorder the top-K, small enough to leave hits
                param.copy_(0.4 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * 0.1)
    return drafter.float().train()


def build_speculators_model(c: Case, drafter: DFlash2Drafter, inputs):
    from speculators.models.dflash2 import DFlash2SpeculatorConfig
    from speculators.models.dflash2.core import DFlash2DraftModel

    d, b, s = c.base.dims, c.base, c.settings
    layers = d.target_config(num_hidden_layers=d.draft_layers, attn=b.attn)
    if c.layer_types is not None:
        layers.use_sliding_window, layers.sliding_window, layers.layer_types = True, c.window, list(c.layer_types)
    config = DFlash2SpeculatorConfig(
        transformer_layer_config=layers, sliding_window_non_causal=True,
        draft_vocab_size=d.vocab, block_size=b.block_size, aux_hidden_state_layer_ids=list(range(1, d.num_features + 1)),
        mask_token_id=b.mask_token_id, conv_kernel_size=s.conv_kernel_size, conv_group_size=s.conv_group_size,
        selector_rank=s.selector_rank, selector_top_k=s.selector_top_k,
    )
    model = DFlash2DraftModel(config)
    state = {name: tensor.clone() for name, tensor in drafter.state_dict().items()}
    state["embed_tokens.weight"] = inputs.embed_weight.clone()
    state["lm_head.weight"] = inputs.lm_head_weight.clone()
    state["verifier_lm_head.weight"] = inputs.lm_head_weight.clone()
    state["verifier_norm.weight"] = inputs.verifier_norm_weight.clone()
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, f"weights speculators does not have: {result.unexpected_keys}"
    missing = [k for k in result.missing_keys if k not in ("t2d", "d2t")]
    assert not missing, f"speculators weights left unloaded: {missing}"
    return model.float().train()
