"""Make a real `speculators train` save directory, with speculators' own code, on CPU, offline.

Run it in the speculators environment (speculators 0.9.0):

    .venv-speculators/bin/python tools/make_speculators_fixture.py OUT [--epochs 2] [--keep-work]

OUT receives (everything written by speculators itself except the verifier and the hidden states):

    OUT/verifier/           a tiny Qwen3 verifier + tokenizer (transformers `save_pretrained`)
    OUT/specout/            `speculators train`'s save directory (OUT/specout-gamma7/: a second run, gamma 7): 0/, 1/, checkpoint_best, epochN_end,
                            run.yaml, train_command.txt; each checkpoint config.json, model.safetensors,
                            val_metrics.json, training_state.json
    OUT/data/               `speculators prepare-data` output (pre-tokenized input_ids + loss_mask)
    OUT/logs/<run name>/    the tensorboard event files of each run (`--logger tensorboard`)

The hidden-state cache that `speculators train` reads (`data/hidden_states/hs_{i}.safetensors`) is normally
written by a vLLM server (`speculators generate-offline-data`), which does not run on CPU. It is made here
with the HF verifier instead, in the layout speculators' own `check_hidden_states` validates: the aux layers
(HF `hidden_states[i]`, vLLM's convention) followed by the final layer, as `launch_vllm.py` appends it.

The committed fixture `tests/fixtures/speculators/` was made with:

    cd tests/fixtures/speculators && ../../../.venv-speculators/bin/python \
        ../../../tools/make_speculators_fixture.py .

(relative paths, so `speculators_config.verifier.name_or_path` reads `verifier`, which resolves beside the
save directory on any machine). Optimizer/scheduler state (`*.pt`) and the hidden-state cache are removed
from the committed copy to keep it small; nothing else is edited.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

NUM_VERIFIER_LAYERS = 8
HIDDEN = 32
TARGET_LAYER_IDS = [2, 4, 5]  # speculators' default [2, L//2, L-3] for L = 8, written out explicitly
SAMPLES = 24
SEQ_LEN = 48

_WORDS = (
    "the cat sat on a mat and the dog ran to the park while one two three four five six seven eight nine ten "
    "alpha beta gamma delta we count add multiply divide numbers letters words blocks tokens draft verify"
).split()


def build_verifier(out: Path, train_steps: int = 60) -> Path:
    """A tiny Qwen3 causal LM with a byte-level BPE tokenizer, saved with save_pretrained."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    verifier = out / "verifier"
    if (verifier / "config.json").is_file():
        return verifier
    corpus = [" ".join(_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(12)) for i in range(200)]
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny tensors: threads only add contention
    config = Qwen3Config(
        vocab_size=len(fast) + 4,  # spare rows: speculators adds <|MASK|> there
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=NUM_VERIFIER_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    # A few seconds of language modelling so the verifier's greedy predictions follow the corpus and a
    # drafter has something to learn (accuracies above zero in val_metrics.json).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.tensor([fast(text)["input_ids"][:24] for text in corpus if len(fast(text)["input_ids"]) >= 24][:32])
    for _ in range(train_steps):
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.to(torch.bfloat16).save_pretrained(verifier)
    fast.save_pretrained(verifier)
    return verifier


def prepare_data(out: Path, verifier: Path) -> Path:
    """Pre-tokenized rows through speculators' own `prepare-data` (no render endpoint needed for them)."""
    from transformers import AutoTokenizer

    data = out / "data"
    if (data / "dataset_info.json").is_file():
        return data
    tokenizer = AutoTokenizer.from_pretrained(verifier)
    rows = out / "rows.jsonl"
    with rows.open("w") as handle:
        for i in range(SAMPLES):
            prompt = " ".join(_WORDS[(i * 5 + j) % len(_WORDS)] for j in range(6))
            answer = " ".join(_WORDS[(i * 11 + j * 2) % len(_WORDS)] for j in range(30))
            prompt_ids = tokenizer(prompt)["input_ids"]
            answer_ids = tokenizer(" " + answer)["input_ids"] + [tokenizer.eos_token_id]
            ids = (prompt_ids + answer_ids)[:SEQ_LEN]
            mask = ([0] * len(prompt_ids) + [1] * len(answer_ids))[:SEQ_LEN]
            handle.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    _speculators("prepare-data", "--model", str(verifier), "--data", str(rows), "--output", str(data),
                 "--seq-length", str(SEQ_LEN), "--num-preprocessing-workers", "1")
    rows.unlink()
    return data


def cache_hidden_states(data: Path, verifier: Path) -> None:
    """What vLLM would write for each row: aux layers + final layer, in vLLM's layer convention."""
    import torch
    from datasets import load_from_disk
    from safetensors.torch import save_file
    from speculators.data_generation.offline import check_hidden_states
    from transformers import AutoModelForCausalLM

    hs_dir = data / "hidden_states"
    hs_dir.mkdir(exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    dataset = load_from_disk(str(data))
    for index in range(len(dataset)):
        ids = torch.as_tensor(dataset[index]["input_ids"]).long()
        with torch.no_grad():
            states = model(ids[None], output_hidden_states=True).hidden_states
        layers = [*TARGET_LAYER_IDS, NUM_VERIFIER_LAYERS]
        payload = {"token_ids": ids, "hidden_states": torch.stack([states[i][0] for i in layers], dim=1).contiguous()}
        check_hidden_states(payload, ids.tolist())  # speculators' own validation of the cache format
        save_file(payload, str(hs_dir / f"hs_{index}.safetensors"))


def train(out: Path, verifier: Path, data: Path, epochs: int, name: str, *extra: str) -> Path:
    save = out / name
    _speculators(
        "train", "--speculator-type", "dflash", "--verifier-name-or-path", str(verifier),
        "--data-path", str(data), "--save-path", str(save), "--epochs", str(epochs),
        "--num-layers", "1", "--block-size", "4", "--max-anchors", "8", "--total-seq-len", str(SEQ_LEN * 2),
        "--target-layer-ids", *map(str, TARGET_LAYER_IDS), "--draft-attn-impl", "sdpa",
        "--hidden-states-dtype", "float32", "--num-workers", "0", "--on-missing", "raise", "--seed", "0",
        "--optimizer", "adamw", "--lr", "1e-3", "--log-freq", "1", "--loss-implementation", "eager",
        "--logger", "tensorboard", "--log-dir", "logs", "--run-name", name, *extra,
    )
    return save


def _speculators(*args: str) -> None:
    if args[0] == "train":
        # speculators' trainer puts the model on `local_rank` (a CUDA index); see `_train_on_cpu`.
        command = [sys.executable, str(Path(__file__).resolve()), "--train-on-cpu", *args[1:]]
    else:
        command = [str(Path(sys.executable).parent / "speculators"), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(command, check=True, env=env, cwd=Path.cwd())


def slim(save: Path) -> None:
    """Drop what the fixture does not need: optimizer and scheduler state."""
    for path in save.rglob("*.pt"):
        path.unlink()


def _train_on_cpu(argv: list[str]) -> None:
    """`speculators train` unchanged, with its device choice pointed at the CPU.

    speculators 0.9.0 picks `torch.accelerator.current_accelerator()` (falling back to "cuda") and moves
    the model and batches to `get_local_rank()` (a device index), and pins batch memory. On a machine
    without an accelerator we answer those questions with the CPU; every line of its training code runs
    as written.
    """
    import torch
    import speculators.train.trainer as trainer_module
    from speculators.__main__ import app

    real_current = torch.accelerator.current_accelerator

    def current_accelerator(check_available: bool = False):
        found = real_current(check_available=check_available)
        return found if found is not None or check_available else torch.device("cpu")

    torch.accelerator.current_accelerator = current_accelerator
    torch.accelerator.synchronize = lambda *a, **k: None
    torch.accelerator.is_available = lambda: False  # its step timer then skips accelerator memory stats
    trainer_module.get_local_rank = lambda: "cpu"
    # Its DataLoader asks for pinned memory, which needs an accelerator; on CPU there is nothing to pin.
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    sys.argv = ["speculators", "train", *argv]
    app()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--train-on-cpu":
        _train_on_cpu(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--keep-work", action="store_true", help="keep optimizer state and the hidden-state cache")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # Relative paths from OUT so that the recorded verifier path travels with the fixture.
    os.chdir(out)
    here = Path(".")
    verifier = build_verifier(here)
    data = prepare_data(here, Path("verifier"))
    cache_hidden_states(data, verifier)
    saves = [
        train(here, Path("verifier"), Path("data"), args.epochs, "specout"),
        # A second run on the same verifier and data (comparable): fixed exponential decay, gamma 7 at block 4.
        train(here, Path("verifier"), Path("data"), args.epochs, "specout-gamma7",
              "--per-position-loss-weight", "fixed-exp-decay", "--dflash-decay-gamma", "7.0"),
    ]
    if not args.keep_work:
        for save in saves:
            slim(save)
        shutil.rmtree(data / "hidden_states")
    print(f"wrote {', '.join(str(out.resolve() / save) for save in saves)}")


if __name__ == "__main__":
    main()
