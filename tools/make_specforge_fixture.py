"""Make a real SpecForge DFlash output directory, with SpecForge's own trainer, on CPU, offline.

Run it with SpecForge's checkout on the path (its `specforge` package imports without sglang for an
offline run; only the capture server needs sglang) and three of SpecForge's own dependencies that our venv
lacks, installed beside it rather than into it (`specforge train` imports `accelerate.utils.set_seed`,
`psutil`, and `yunchang.globals` for its process groups):

    pip install --target /tmp/sf-extra --no-deps accelerate psutil yunchang
    PYTHONPATH=/path/to/SpecForge:/tmp/sf-extra .venv/bin/python tools/make_specforge_fixture.py OUT \
        [--verifier tests/fixtures/speculators/verifier]

Training runs on CPU through SpecForge's own switches, no source edit: `SPECFORGE_DEVICE=cpu` (its
`get_device_type`), `training.fsdp_sharding: NO_SHARD` (its DDP path; FSDP needs an accelerator),
`training.attention_backend: sdpa`, `data.dataloader_num_workers: 0`.

OUT receives:

    OUT/verifier/         the tiny Qwen3 target (copied from --verifier, else built as the speculators fixture does)
    OUT/draft-dflash.json the draft config, in SpecForge's `configs/*-dflash.json` shape (ids by its own
                          `build_target_layer_ids`, mask token, block size, `num_target_layers`)
    OUT/recipe.yaml       the run config (`specforge train --config`), SpecForge's typed schema
    OUT/outputs/sf-tiny/  what `specforge train` wrote: `sf-tiny-step{N}/training_state.pt` (+ per-rank
                          `training_state_rank0.pt`), `sf-tiny-latest`, `sf-tiny-best`, `sf-tiny.best_meta.json`,
                          `runs/` (tensorboard, `tracking.report_to: tensorboard`)
    OUT/export-hf/        SpecForge's own HF export of the best checkpoint (`specforge.export.to_hf`)

The offline features SpecForge trains on (`*.ckpt`, normally written by `scripts/prepare_hidden_states.py`
through an sglang capture server, which needs a GPU) are made here with the HF target instead, in the
record layout that script saves (`input_ids`, `loss_mask`, `hidden_states` = the selected layers
concatenated by SpecForge's own `extract_context_feature`, i.e. HF `hidden_states[id + 1]`); they are
inputs, removed from the committed copy with the per-rank optimizer state (`training_state_rank0.pt`).

The committed fixture `tests/fixtures/specforge/` was made with:

    cd tests/fixtures/specforge && PYTHONPATH=/tmp/up/src/specforge ../../../.venv/bin/python \
        ../../../tools/make_specforge_fixture.py . --verifier ../speculators/verifier

and a second run beside it, `outputs/sf-tiny-gamma7/` (`recipe-sf-tiny-gamma7.yaml`), with
`... make_specforge_fixture.py . --verifier ../speculators/verifier --run-id sf-tiny-gamma7 --gamma 7`

(relative paths in the recipe; SpecForge records the absolute target path in each checkpoint's
provenance, which sleuth resolves by its trailing components when the run has moved).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

RUN_ID = "sf-tiny"
DRAFT_LAYERS = 2
BLOCK_SIZE = 4
SAMPLES = 24
EVAL_SAMPLES = 6
SEQ_LEN = 40
STEPS = 12


def copy_or_build_verifier(out: Path, source: Path | None) -> Path:
    verifier = out / "verifier"
    if (verifier / "config.json").is_file():
        return verifier
    if source is not None:
        shutil.copytree(source, verifier)
        return verifier
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_speculators_fixture import build_verifier

    return build_verifier(out)


def write_draft_config(out: Path, verifier: Path) -> Path:
    """SpecForge's DFlash draft config shape (configs/qwen3-8b-dflash.json), sized to the tiny target."""
    from specforge.modeling.draft.dflash import build_target_layer_ids
    from transformers import AutoTokenizer

    target = json.loads((verifier / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(verifier)
    config = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": BLOCK_SIZE,
        "dflash_config": {
            # a spare embedding row past the tokenizer, as Qwen3's configs use 151669 past its specials
            "mask_token_id": len(tokenizer),
            "target_layer_ids": build_target_layer_ids(target["num_hidden_layers"], DRAFT_LAYERS),
        },
        "dtype": "float32",
        "head_dim": target.get("head_dim", target["hidden_size"] // target["num_attention_heads"]),
        "hidden_act": "silu",
        "hidden_size": target["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": target["intermediate_size"],
        "layer_types": ["full_attention"] * DRAFT_LAYERS,
        "max_position_embeddings": target["max_position_embeddings"],
        "max_window_layers": DRAFT_LAYERS,
        "model_type": "qwen3",
        "num_attention_heads": target["num_attention_heads"],
        "num_hidden_layers": DRAFT_LAYERS,
        "num_key_value_heads": target["num_key_value_heads"],
        "num_target_layers": target["num_hidden_layers"],
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_scaling": None,
        "rope_theta": target.get("rope_theta", (target.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": target["vocab_size"],
    }
    path = out / "draft-dflash.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def write_features(out: Path, verifier: Path, layer_ids: list[int]) -> tuple[Path, Path]:
    """Offline feature records (`{input_ids, loss_mask, hidden_states}` per `.ckpt`), from the HF target."""
    import torch
    from specforge.modeling.draft.dflash import extract_context_feature
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_speculators_fixture import _WORDS

    tokenizer = AutoTokenizer.from_pretrained(verifier)
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    train, evaluation = out / "features" / "train", out / "features" / "eval"
    for directory in (train, evaluation):
        directory.mkdir(parents=True, exist_ok=True)
    for index in range(SAMPLES + EVAL_SAMPLES):
        words = " ".join(_WORDS[(index * 5 + j * 3) % len(_WORDS)] for j in range(30))
        ids = tokenizer(words, return_tensors="pt").input_ids[:, :SEQ_LEN]
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states
        loss_mask = torch.ones(ids.shape[1], dtype=torch.long)
        loss_mask[:4] = 0  # the "prompt"
        record = {
            "input_ids": ids[0].clone(),
            "loss_mask": loss_mask,
            "hidden_states": extract_context_feature(list(hidden), layer_ids).clone(),  # [1, T, k*H]
        }
        directory = train if index < SAMPLES else evaluation
        torch.save(record, directory / f"data_{index}.ckpt")
    return train, evaluation


def write_recipe(out: Path, train: Path, evaluation: Path, gamma: float | None, run_id: str) -> Path:
    import yaml

    training = {
        "strategy": "dflash",
        "num_epochs": 2,
        "max_steps": STEPS,
        "batch_size": 2,
        # NO_SHARD is SpecForge's DDP path (backend.py): FSDP refuses a CPU-only machine, DDP does not
        "fsdp_sharding": "NO_SHARD",
        "learning_rate": 3.0e-3,
        "warmup_ratio": 0.04,
        "max_grad_norm": 1.0,
        "attention_backend": "sdpa",
        "num_anchors": 8,
        "save_interval": 4,
        "eval_interval": 4,
        "log_interval": 1,
        "seed": 0,
    }
    if gamma is not None:
        training["loss_decay_gamma"] = gamma
    recipe = {
        "model": {
            "target_model_path": "verifier",
            "draft_model_config": "draft-dflash.json",
            "target_backend": "sglang",
            "torch_dtype": "float32",
        },
        "data": {
            "hidden_states_path": str(train.relative_to(out)),
            "eval_hidden_states_path": str(evaluation.relative_to(out)),
            "max_length": SEQ_LEN,
            "chat_template": "qwen",
            "dataloader_num_workers": 0,
        },
        "training": training,
        "tracking": {"report_to": "tensorboard"},
        "run_id": run_id,
        "output_dir": f"outputs/{run_id}",
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }
    path = out / ("recipe.yaml" if run_id == RUN_ID else f"recipe-{run_id}.yaml")
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def train(out: Path, recipe: Path, run_id: str) -> Path:
    """`specforge train --config recipe.yaml`, SpecForge's one public training entry, in-process on CPU."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", SPECFORGE_DEVICE="cpu", WANDB_MODE="disabled")
    code = "import sys; from specforge.cli import main; sys.exit(main(['train', '--config', sys.argv[1]]))"
    subprocess.run([sys.executable, "-c", code, str(recipe.relative_to(out))], cwd=out, env=env, check=True)
    return out / "outputs" / run_id


def export(out: Path, output_dir: Path, draft_config: Path, verifier: Path) -> Path:
    from specforge.export.to_hf import export_to_hf

    target = out / "export-hf"
    export_to_hf(str(output_dir / f"{RUN_ID}-best"), str(draft_config), str(target), embedding_source=str(verifier))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--verifier", type=Path, default=None, help="a tiny target to copy (else one is built)")
    parser.add_argument("--gamma", type=float, default=None, help="training.loss_decay_gamma (SpecForge default: none)")
    parser.add_argument("--run-id", default=RUN_ID, help="a second run beside the first (its recipe: recipe-RUN_ID.yaml)")
    parser.add_argument("--keep-work", action="store_true", help="keep the offline features and per-rank state")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    verifier = copy_or_build_verifier(out, args.verifier.resolve() if args.verifier else None)
    draft_config = write_draft_config(out, verifier)
    layer_ids = json.loads(draft_config.read_text())["dflash_config"]["target_layer_ids"]
    train_dir, eval_dir = write_features(out, verifier, layer_ids)
    recipe = write_recipe(out, train_dir, eval_dir, args.gamma, args.run_id)
    output_dir = train(out, recipe, args.run_id)
    if args.run_id == RUN_ID:
        export(out, output_dir, draft_config, verifier)
    if not args.keep_work:
        shutil.rmtree(out / "features")
        for rank_file in output_dir.glob("*/training_state_rank*.pt"):
            rank_file.unlink()
    print(f"wrote {output_dir}")


if __name__ == "__main__":
    main()
