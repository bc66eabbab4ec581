"""A speculators 0.9.0 offline hidden-state directory for a trainer target and data, checked by speculators'
own readers. Run it in the speculators environment with the repo on the path:

    PYTHONPATH=. .venv-speculators/bin/python tools/make_speculators_hidden_states_fixture.py OUT \
        --target DIR [--data embedded|FILE] [--layer-ids 2 4 5] [--fp8]

OUT receives what `speculators prepare-data` + `speculators generate-offline-data` leave for `speculators
train --data-path OUT`:

    OUT/                       `speculators prepare-data` output (its own code): input_ids, loss_mask, seq_len
                               of each of the trainer's training documents (tokenised by the trainer, in order)
    OUT/hidden_states/hs_<i>.safetensors
                               `token_ids` [S] and `hidden_states` [S, k + 1, H]: the k `--layer-ids` (vLLM's
                               convention, HF hidden_states[i]) and the final layer, as launch_vllm.py appends it

The files are normally written by vLLM's hidden-states connector (`generate-offline-data` moves them into
place); vLLM needs a GPU and is not installed here, so the states come from the HF target, taken where vLLM
takes them: the residual stream `hidden_states + residual` entering layer i (HF hidden_states[i]) and, for
the final layer, the last decoder layer's output before the final norm (vLLM's `_maybe_add_hidden_state`
at id L; speculators' trainer applies `verifier_norm` to it). `--fp8` quantises them with hs_connectors'
own `quantize_tensor_to_fp8`, as its FP8HiddenStatesConnector writes them. Every file is then read back
through speculators' own code, and the tool fails unless it returns these states:
`find_corrupt_hidden_state_indices`, `check_hidden_states`, and `train.data.ArrowDataset` (the training
reader: aux layers flattened, the last entry as `verifier_last_hidden_states`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch


def tokenised_documents(target: Path, data: str) -> tuple[list[list[int]], list[list[int]]]:
    """The trainer's own training documents (its tokenizer, chat rendering and loss masks)."""
    from transformers import AutoTokenizer

    from trainer.data.datasets import load_documents

    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    documents = load_documents(data, tokenizer, split="train")
    return [list(d.input_ids) for d in documents], [list(d.loss_mask) for d in documents]


def prepare_data(out: Path, target: Path, ids: list[list[int]], masks: list[list[int]]) -> None:
    """Pre-tokenised rows through speculators' own `prepare-data`."""
    rows = out.parent / f".{out.name}.rows.jsonl"
    with rows.open("w") as handle:
        for row_ids, row_mask in zip(ids, masks):
            handle.write(json.dumps({"input_ids": row_ids, "loss_mask": row_mask}) + "\n")
    longest = max(len(r) for r in ids)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([str(Path(sys.executable).parent / "speculators"), "prepare-data", "--model", str(target),
                    "--data", str(rows), "--output", str(out), "--seq-length", str(longest),
                    "--num-preprocessing-workers", "1"], check=True, env=env)
    rows.unlink()


@torch.no_grad()
def vllm_states(model: torch.nn.Module, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[S, k + 1, H]: HF hidden_states[i] for each vLLM id i, then the last layer's pre-norm output."""
    from trainer.run.sharding import decoder_layers

    last: list[torch.Tensor] = []
    layers = decoder_layers(model, model.config.num_hidden_layers)
    hook = layers[-1].register_forward_hook(
        lambda module, inputs, output: last.append(output[0] if isinstance(output, tuple) else output))
    try:
        states = model(ids[None], output_hidden_states=True, use_cache=False).hidden_states
    finally:
        hook.remove()
    return torch.stack([*(states[i][0] for i in layer_ids), last[0][0]], dim=1).contiguous()


def write_hidden_states(out: Path, target: Path, layer_ids: list[int], fp8: bool) -> int:
    from datasets import load_from_disk
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from speculators.data_generation.offline import check_hidden_states

    hs_dir = out / "hidden_states"
    hs_dir.mkdir(exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, local_files_only=True).eval()
    dataset = load_from_disk(str(out))
    for index in range(len(dataset)):
        ids = torch.as_tensor(dataset[index]["input_ids"]).long()
        payload = {"token_ids": ids, "hidden_states": vllm_states(model, ids, layer_ids)}
        check_hidden_states(payload, ids.tolist())  # speculators' own validation of the format
        if fp8:
            from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

            quantised, scales = quantize_tensor_to_fp8(payload["hidden_states"])
            payload = {**payload, "hidden_states": quantised, SCALES_KEY: scales}
        save_file(payload, str(hs_dir / f"hs_{index}.safetensors"))
    return len(dataset)


def read_back(out: Path, target: Path, layer_ids: list[int], count: int, fp8: bool) -> None:
    """Every file through speculators' own readers must give the states computed here."""
    from hs_connectors.transfer import FileTransfer, FP8Transfer
    from transformers import AutoModelForCausalLM

    from speculators.data_generation.offline import find_corrupt_hidden_state_indices, get_existing_hidden_state_indices
    from speculators.train.data import ArrowDataset

    hs_dir = out / "hidden_states"
    indices = get_existing_hidden_state_indices(hs_dir)
    if indices != list(range(count)) or find_corrupt_hidden_state_indices(hs_dir, indices):
        raise SystemExit(f"speculators does not see hs_0..hs_{count - 1} as readable files in {hs_dir}")
    transfer = FP8Transfer(hs_dir, dequantize_dtype=torch.float32) if fp8 else FileTransfer(hs_dir)
    dataset = ArrowDataset(max_len=10**6, datapath=str(out), transfer=transfer, on_missing="raise",
                           hidden_states_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, local_files_only=True).eval()
    tolerance = 0.07 if fp8 else 0.0  # fp8 e4m3 keeps 3 mantissa bits
    for index in range(count):
        sample = dataset._get_raw_data(index)
        expected = vllm_states(model, sample["input_ids"].long(), layer_ids)
        aux = expected[:, :-1].flatten(1)
        for name, got, want in (("hidden_states", sample["hidden_states"], aux),
                                ("verifier_last_hidden_states", sample["verifier_last_hidden_states"], expected[:, -1])):
            scale = want.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6)
            error = float(((got.float() - want) / scale).abs().max())
            if error > tolerance:
                raise SystemExit(f"speculators' ArrowDataset reads {name} of sample {index} {error:.3g} off")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--target", type=Path, required=True, help="a HF causal-LM directory (the trainer's target)")
    parser.add_argument("--data", default="embedded", help="the trainer's `data` (its training split is used)")
    parser.add_argument("--layer-ids", type=int, nargs="*", default=None,
                        help="vLLM layer ids (speculators' --target-layer-ids); default [2, L//2, L-3]")
    parser.add_argument("--fp8", action="store_true", help="hs_connectors' fp8 files (hidden_states_scales)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from speculators.models.utils import resolve_target_layer_ids

    layer_ids = resolve_target_layer_ids(args.layer_ids, str(args.target))
    out: Path = args.out.resolve()
    ids, masks = tokenised_documents(args.target, args.data)
    prepare_data(out, args.target, ids, masks)
    count = write_hidden_states(out, args.target, layer_ids, args.fp8)
    read_back(out, args.target, layer_ids, count, args.fp8)
    print(json.dumps({"out": str(out), "samples": count, "vllm_layer_ids": layer_ids, "fp8": args.fp8}))


if __name__ == "__main__":
    main()
