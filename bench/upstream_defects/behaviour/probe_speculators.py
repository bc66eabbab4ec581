"""speculators on tiny tensors: the numbers a planted defect should move.

Imported afresh for every copy (the runner drops `speculators.*` from sys.modules first), so every name is
looked up inside `probe()`. The fused losses need Triton, so the loss runs with the eager CE; the fused CE
wrapper is checked by the kernel it dispatches to.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

H, V, B = 32, 64, 4


def _config(layers: int) -> Qwen3Config:
    config = Qwen3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, num_hidden_layers=layers, vocab_size=V, max_position_embeddings=256,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def probe() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="probe-speculators-") as scratch:
        return _probe(Path(scratch))


def _probe(scratch: Path) -> dict[str, Any]:
    from torch.nn.attention.flex_attention import create_mask

    from speculators.losses import eager
    from speculators.losses import utils as loss_utils
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.models.dflash.attention import create_anchor_block_mask_mod
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.models.dflash.utils import select_anchors
    from speculators.models.utils import resolve_target_layer_ids, uses_gemma_style_final_norm

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    config = DFlashSpeculatorConfig(transformer_layer_config=_config(2), draft_vocab_size=V, block_size=B,
                                    aux_hidden_state_layer_ids=[1, 2, 3], mask_token_id=V - 1)
    model = DFlashDraftModel(config).float().train()
    with torch.no_grad():  # random, non-trivial weights everywhere a defect could swap one tensor for another
        for weight in (model.embed_tokens.weight, model.lm_head.weight, model.verifier_lm_head.weight):
            weight.copy_(torch.randn_like(weight))
        for module in model.modules():
            if hasattr(module, "weight") and getattr(module, "weight", None) is not None and module.weight.dim() == 1:
                module.weight.copy_(torch.rand_like(module.weight) + 0.5)
    ce = {"ce": (eager.ce_loss, 1.0)}
    for seq_len in (32, 16):  # 4 anchors * B = 16: the gathered-targets branch, then the full-sequence branch
        g = torch.Generator().manual_seed(1)
        hidden = torch.randn(1, seq_len, 3 * H, generator=g)
        last = torch.randn(1, seq_len, H, generator=g)
        ids = torch.randint(0, V - 1, (1, seq_len), generator=g)
        loss_mask, docs = torch.ones(1, seq_len), torch.zeros(1, seq_len, dtype=torch.long)
        for weighting in ("fixed-exp-decay", "dpace"):
            torch.manual_seed(2)
            _, loss, _ = model(hidden, ids, loss_mask, last, docs, loss_config=ce, gamma=4.0, max_anchors=4,
                               per_position_loss_weight=weighting)
            out[f"loss_T{seq_len}_{weighting}"] = round(float(loss), 6)
    seq_len, docs = 16, torch.zeros(16, dtype=torch.long)
    for window in (None, seq_len):
        mask_mod, q_len, kv_len = create_anchor_block_mask_mod(docs, seq_len, torch.tensor([2, 7, 11]), B,
                                                               sliding_window=window)
        dense = create_mask(mask_mod, None, None, q_len, kv_len, device="cpu")
        out[f"mask_window_{window}"] = dense.int().flatten().tolist()
    torch.manual_seed(3)
    out["anchors"] = select_anchors(torch.ones(1, 40), 5, B)[0].tolist()

    verifier = str(scratch / "verifier")
    Qwen3ForCausalLM(_config(4)).save_pretrained(verifier)
    deep = str(scratch / "deep-verifier-config")  # a 36-layer config: the default ids need depth
    deep_config = _config(36)
    deep_config.architectures = ["Qwen3ForCausalLM"]
    deep_config.save_pretrained(deep)
    out["default_layer_ids"] = resolve_target_layer_ids(None, deep)
    named = SimpleNamespace(speculators_config=SimpleNamespace(verifier=SimpleNamespace(name_or_path=deep)))
    out["gemma_style_final_norm"] = uses_gemma_style_final_norm(named)
    layer_config = Qwen3Config(**{**_config(4).to_dict(), "num_hidden_layers": 1, "layer_types": None})
    layer_config._attn_implementation = "sdpa"
    kwargs = DFlashDraftModel._build_base_config_kwargs("dflash", layer_config, verifier_name_or_path=verifier,
                                                        draft_vocab_size=V, target_layer_ids=[1, 2],
                                                        mask_token_id=V - 1)
    out["sample_from_anchor_default"] = kwargs["sample_from_anchor"]
    built = DFlashDraftModel(DFlashSpeculatorConfig(**kwargs))
    built.load_verifier_weights()  # what from_training_args does last
    out["trainable_verifier_tensors"] = sorted(n for n, p in built.named_parameters()
                                               if p.requires_grad and ("lm_head" in n or "embed" in n))
    # the dataset's split of a cached sample into aux layers and the verifier's last layer (no Arrow file:
    # only the attributes _get_raw_data reads)
    from speculators.train.data import ArrowDataset

    dataset = ArrowDataset.__new__(ArrowDataset)
    g = torch.Generator().manual_seed(4)
    sample = {"hidden_states": torch.randn(6, 4, H, generator=g), "token_ids": torch.arange(6)}
    dataset._map_to_file_idx = lambda index: index
    dataset.transfer = SimpleNamespace(get_cached=lambda index: sample)
    dataset.data = [{"input_ids": torch.arange(6), "loss_mask": torch.ones(6)}]
    dataset.on_missing = "raise"
    item = dataset._get_raw_data(0)
    by_position = torch.arange(1, 7, dtype=torch.float64)[:, None]  # a checksum that sees order along the sequence
    out["dataset_aux"] = round(float((item["hidden_states"].double() * by_position).sum()), 4)
    out["dataset_last"] = round(float((item["verifier_last_hidden_states"].double() * by_position).sum()), 4)
    kernels: list[str] = []
    loss_utils._fused_kernel = lambda name: (kernels.append(name), lambda *a, **k: torch.zeros(1))[1]
    loss_utils.ce_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))
    out["ce_kernel"] = kernels[-1]
    return out
