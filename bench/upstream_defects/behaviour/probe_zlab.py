"""z-lab/dflash's inference loop on a tiny random target: the drafter's outputs step by step and the tokens
generated. A random drafter is rarely accepted, so most defects show in the draft outputs; verification
defects show in the generated tokens too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

H, V, L, B = 32, 64, 8, 4


def _config(layers: int, **extra: Any) -> Qwen3Config:
    config = Qwen3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, num_hidden_layers=layers, vocab_size=V, max_position_embeddings=256, **extra)
    config._attn_implementation = "sdpa"
    return config


def probe(package: Path) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location(f"zlab_model_{id(package)}", package / "model.py")
    model_module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = model_module
    spec.loader.exec_module(model_module)
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(_config(L)).eval()
    draft = model_module.DFlashDraftModel(_config(2, num_target_layers=L, block_size=B,
                                                  dflash_config={"mask_token_id": V - 1})).eval()
    with torch.no_grad():
        for module in draft.modules():
            if hasattr(module, "weight") and getattr(module, "weight", None) is not None and module.weight.dim() == 1:
                module.weight.copy_(torch.rand_like(module.weight) + 0.5)
    drafts: list[torch.Tensor] = []
    draft.register_forward_hook(lambda mod, inputs, output: drafts.append(output.detach().clone()))
    prompt = torch.randint(0, V - 1, (1, 10), generator=torch.Generator().manual_seed(1))
    generated = model_module.dflash_generate(draft, target, prompt, max_new_tokens=24, stop_token_ids=None,
                                             temperature=0.0)
    return {"layer_ids": list(draft.target_layer_ids), "generated": generated[0].tolist(),
            "draft_outputs": [round(float(d.double().abs().sum()), 4) for d in drafts]}
