"""SpecForge on tiny tensors. The flex mask_mod is evaluated element-wise (create_mask in place of
create_block_mask) and handed to SDPA as a dense boolean mask, so the default `flex_attention` backend's
mask is what the loss sees, on CPU."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_mask
from transformers import Qwen3Config, Qwen3ForCausalLM

H, V, L, B = 32, 64, 8, 4


def _config(layers: int, **extra: Any) -> Qwen3Config:
    config = Qwen3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, num_hidden_layers=layers, vocab_size=V, max_position_embeddings=256, **extra)
    config._attn_implementation = "sdpa"
    return config


def probe() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="probe-specforge-") as scratch:
        return _probe(Path(scratch))


def _probe(scratch: Path) -> dict[str, Any]:
    import specforge.algorithms.common.dflash_family_model as family
    from specforge.config.schema import TrainingConfig
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead

    family.create_block_mask = lambda mod, B, H, Q_LEN, KV_LEN, device: create_mask(mod, B, H, Q_LEN, KV_LEN,
                                                                                     device=device)
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    draft = DFlashDraftModel(_config(2, num_target_layers=L, block_size=B, layer_types=["full_attention"] * 2,
                                     dflash_config={"mask_token_id": V - 1})).float()
    out["layer_ids"] = list(draft.target_layer_ids)
    with torch.no_grad():
        for module in draft.modules():
            if hasattr(module, "weight") and getattr(module, "weight", None) is not None and module.weight.dim() == 1:
                module.weight.copy_(torch.rand_like(module.weight) + 0.5)
    head, embed = nn.Linear(H, V, bias=False), nn.Embedding(V, H)
    seq_len = 24
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V - 1, (1, seq_len), generator=g)
    hidden = torch.randn(1, seq_len, len(draft.target_layer_ids) * H, generator=g)
    loss_mask = torch.ones(1, seq_len)
    loss_mask[0, :3] = 0  # a prompt, and one unsupervised token inside the answer
    loss_mask[0, 12] = 0
    for loss_type, gamma in (("dflash", None), ("dflash", 7.0), ("dpace", None)):
        model = family.OnlineDFlashModel(draft, head, embed, mask_token_id=V - 1, block_size=B, num_anchors=6,
                                         loss_decay_gamma=gamma, loss_type=loss_type,
                                         attention_backend="flex_attention")
        torch.manual_seed(2)
        loss, _, _ = model(ids, hidden, loss_mask)
        out[f"loss_{loss_type}_{gamma}"] = round(float(loss), 6)
    mask = family.create_dflash_block_mask(torch.tensor([[2, 7, 11]]), torch.tensor([[True, True, True]]), 16, B,
                                           "cpu")
    out["flex_mask"] = mask.int().flatten().tolist()
    torch.manual_seed(3)
    out["anchors"] = model._sample_anchor_positions(seq_len, loss_mask, "cpu")[0].tolist()
    target_dir = str(scratch / "target")
    Qwen3ForCausalLM(_config(2)).save_pretrained(target_dir)
    parts = TargetEmbeddingsAndHead.from_pretrained(target_dir, device="cpu", dtype=torch.float32)
    out["trainable_target_tensors"] = sorted(n for n, p in parts.named_parameters() if p.requires_grad)
    out["num_anchors_default"] = TrainingConfig.model_fields["num_anchors"].default
    return out
