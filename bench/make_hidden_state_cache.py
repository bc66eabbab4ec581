"""Write a `dflash-hidden-states` v1 cache of a target (z-lab ids 1, 3, 5) for `sleuth diagnose
--hidden-states`: `hs_ok` as captured correctly, `hs_shift` with every layer one too deep (the off-by-one
between layer conventions). NOTES / BENCHMARKS: the dflash.hidden_state_capture measurement.

    python bench/make_hidden_state_cache.py OUT_DIR [--target DIR]   (default: the embedded target)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

LAYER_IDS = [1, 3, 5]  # z-lab convention: id i = output of decoder layer i = HF hidden_states[i + 1]
TEXTS = ["Count from 3 by 2: 3, 5, 7, 9, 11, 13, 15", "The capital of France is Paris. The capital of Spain is Madrid."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--target", type=Path, default=None)
    args = parser.parse_args()
    if args.target is None:
        from trainer.target.embedded import ensure_embedded_target

        args.target = ensure_embedded_target()
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    for name, shift in (("hs_ok", 0), ("hs_shift", 1)):
        out = args.out / name
        out.mkdir(parents=True, exist_ok=True)
        manifest = {"format": "dflash-hidden-states", "version": 1, "layer_ids": LAYER_IDS, "convention": "zlab",
                    "target": str(args.target)}
        (out / "manifest.json").write_text(json.dumps(manifest))
        for i, text in enumerate(TEXTS):
            ids = tokenizer(text)["input_ids"]
            with torch.no_grad():
                hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            stored = torch.stack([hidden[layer + 1 + shift][0] for layer in LAYER_IDS], dim=1).contiguous()  # [T, 3, H]
            save_file({"input_ids": torch.tensor(ids), "hidden_states": stored}, str(out / f"{i}.safetensors"))
        print(f"{out}: {len(TEXTS)} sequences, layer ids {LAYER_IDS} shifted by {shift}")


if __name__ == "__main__":
    main()
