"""The embedded target: a small Qwen3 causal LM with a real BPE tokenizer, built locally, never downloaded.

`build_embedded_target` trains a byte-level BPE tokenizer on the embedded corpus, trains a small
Qwen3ForCausalLM on the same corpus for a few hundred steps (seeded, deterministic on CPU), and saves
both with `save_pretrained` into the cache. `FrozenTarget.load` then reads it back through the same
`AutoModelForCausalLM.from_pretrained` path as any user model, so the embedded target exercises the
real loading code rather than a shortcut.

The target must be *trained*: the drafter learns to predict the target's argmax, and a random target's
argmax is noise that no drafter can predict from context.

A second built-in target, `embedded-qwen3_5`, is the same recipe on a tiny transformers `qwen3_5` text
model (the family of Qwen3.5 / Qwen3.6-27B): Gated DeltaNet linear-attention layers with a full-attention
layer every 4th, partial rotary 0.25 with interleaved mRoPE, theta 1e7, 6 / 1 heads: the published 27B
target's layout at 1/64 of its width (the `zlab-qwen3.6` preset trains its drafter on it).

Builds are atomic and idempotent: a build writes into a temporary directory next to the destination
and renames it into place only when complete (the completion marker is written last), under a file
lock; `ensure_embedded_target` reuses a complete build. A killed build leaves only a temporary
directory, which the next build removes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trainer import safe_io

EMBEDDED_NAME = "embedded-v1"
BUILD_MARKER = "dflash-embedded.json"  # written last: its presence means the directory is complete
CACHE_ENV = "DFLASH_CACHE_DIR"

EOS, PAD, IM_START, IM_END, MASK = "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [EOS, PAD, IM_START, IM_END, MASK]

# ChatML; {% generation %} marks assistant content (and its <|im_end|>) so that
# apply_chat_template(return_assistant_tokens_mask=True) can tell which tokens carry the loss.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else -%}"
    "{{ message['content'] + '<|im_end|>' }}"
    "{%- endif -%}"
    "{{ '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class BuildRecipe:
    """Everything that determines the built target; saved in the completion marker."""

    vocab_size: int  # BPE vocabulary including the special tokens
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    train_documents: int | None  # None: the whole train split
    seq_len: int
    batch_size: int
    lr: float
    warmup_steps: int
    seed: int = 0
    family: str = "qwen3"  # "qwen3" | "qwen3_5" (the hybrid linear-attention text model)


DEFAULT_STEPS = 160
SMALL_STEPS = 120
DEFAULT_RECIPE = BuildRecipe(
    vocab_size=1536, hidden_size=128, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=32,
    intermediate_size=384, train_documents=None, seq_len=256, batch_size=8, lr=3e-3, warmup_steps=20,
)
# For tests: same architecture family and depth (so layer-selection rules apply unchanged), narrower.
SMALL_RECIPE = BuildRecipe(
    vocab_size=512, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=192, train_documents=800, seq_len=128, batch_size=8, lr=5e-3, warmup_steps=10,
)


# Qwen3.6-27B's text model at 1/64 of its width (hidden 5120 -> 80, 24 / 4 heads of 256 -> 6 / 1 of 16,
# linear attention 16 QK / 48 V heads of 128 -> 2 / 6 of 16, MLP 17408 -> 272), 8 layers in its 3 x linear +
# 1 x full pattern; RoPE as published (partial 0.25, interleaved mRoPE, theta 1e7). Same corpus and tokenizer.
QWEN3_5_RECIPE = BuildRecipe(
    vocab_size=1536, hidden_size=80, num_layers=8, num_heads=6, num_kv_heads=1, head_dim=16,
    intermediate_size=272, train_documents=None, seq_len=256, batch_size=8, lr=3e-3, warmup_steps=20,
    family="qwen3_5",
)
# Built-in target names (TrainConfig.target) -> (cache directory name, recipe).
BUILT_IN_TARGETS: dict[str, tuple[str, BuildRecipe]] = {
    "embedded": (EMBEDDED_NAME, DEFAULT_RECIPE),
    "embedded-qwen3_5": ("embedded-qwen3_5-v1", QWEN3_5_RECIPE),
}


def cache_root() -> Path:
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("dflash-trainer"))


def embedded_target_dir() -> Path:
    """Where the embedded target lives: <cache root>/targets/embedded-v1 (env DFLASH_CACHE_DIR = root)."""
    return cache_root() / "targets" / EMBEDDED_NAME


def built_in_target_dir(name: str) -> Path:
    """Where built-in target `name` ('embedded', 'embedded-qwen3_5') lives: <cache root>/targets/<dir>."""
    return cache_root() / "targets" / BUILT_IN_TARGETS[name][0]


def is_complete_build(path: Path) -> bool:
    return (path / BUILD_MARKER).is_file()


def ensure_built_in_target(name: str, progress: bool = True) -> Path:
    """A built-in target's directory, built on first use and reused afterwards."""
    if name == "embedded":
        return ensure_embedded_target(progress)
    dest = built_in_target_dir(name)
    if is_complete_build(dest):
        return dest
    with _build_lock(dest):
        if is_complete_build(dest):
            return dest
        return _build_locked(dest, steps=DEFAULT_STEPS, progress=progress, small=False,
                             recipe=BUILT_IN_TARGETS[name][1])


def ensure_embedded_target(progress: bool = True) -> Path:
    """The embedded target's directory, built on first use and reused afterwards."""
    dest = embedded_target_dir()
    if is_complete_build(dest):
        return dest
    with _build_lock(dest):
        if is_complete_build(dest):  # another process finished it while we waited for the lock
            return dest
        return _build_locked(dest, steps=DEFAULT_STEPS, progress=progress, small=False)


def build_embedded_target(dest: Path | None = None, *, steps: int | None = None, progress: bool = True,
                          small: bool = False, name: str = "embedded") -> Path:
    """Build (or rebuild) built-in target `name` into `dest` (default: the cache) and return `dest`.

    `steps` defaults to DEFAULT_STEPS (SMALL_STEPS when `small`). `small=True` is a narrower model
    trained on part of the corpus, for tests: a few seconds instead of about a minute.
    """
    dest = Path(dest) if dest is not None else built_in_target_dir(name)
    if steps is None:
        steps = SMALL_STEPS if small else DEFAULT_STEPS
    recipe = None if name == "embedded" else BUILT_IN_TARGETS[name][1]
    with _build_lock(dest):
        return _build_locked(dest, steps=steps, progress=progress, small=small, recipe=recipe)


def build_embedded_tokenizer(small: bool = False) -> Any:
    """The embedded target's tokenizer (a transformers PreTrainedTokenizerFast), trained deterministically."""
    from trainer.data.corpus import embedded_documents

    recipe = SMALL_RECIPE if small else DEFAULT_RECIPE
    return _train_tokenizer(_train_texts(embedded_documents("train"), recipe), recipe.vocab_size)


# --- building ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _build_lock(dest: Path) -> Iterator[None]:
    lock_path = dest.parent / f".{dest.name}.lock"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a link planted under the lock's name is refused, never opened (and truncated) through
        handle = os.fdopen(os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644), "w")
    except OSError as exc:
        from trainer.target.errors import TargetError

        raise TargetError(
            f"cannot write the embedded target cache {dest.parent}: {exc.strerror}; "
            f"set {CACHE_ENV} to a writable directory"
        ) from None
    with handle:
        try:
            import fcntl
        except ImportError:  # Windows: no flock; the atomic rename alone still keeps builds whole
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_locked(dest: Path, *, steps: int, progress: bool, small: bool, recipe: BuildRecipe | None = None) -> Path:
    # Holding the lock, any leftover temporary directory belongs to a build that was killed.
    for pattern in (f".{dest.name}.building-*", f".{dest.name}.old-*"):
        for stale in dest.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)
    workdir = Path(tempfile.mkdtemp(prefix=f".{dest.name}.building-", dir=dest.parent))
    os.chmod(workdir, 0o755)  # mkdtemp makes it owner-only; the installed target is an ordinary directory
    try:
        recipe = recipe or (SMALL_RECIPE if small else DEFAULT_RECIPE)
        _build_into(workdir, steps=steps, progress=progress, recipe=recipe)
        _install(workdir, dest)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return dest


def _install(workdir: Path, dest: Path) -> None:
    """Put the complete build at `dest` with renames, so `dest` is never a half-written target."""
    if dest.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.replace(dest, trash / dest.name)
        os.replace(workdir, dest)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(workdir, dest)


def _train_texts(documents: list[str], recipe: BuildRecipe) -> list[str]:
    return documents if recipe.train_documents is None else documents[: recipe.train_documents]


def _train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Special-token strings in the chat documents are single tokens; keep them out of the merges.
    plain = [_strip_specials(t) for t in texts]
    bpe.train_from_iterator(plain, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
        additional_special_tokens=[IM_START, IM_END],  # v5 maps this to extra_special_tokens; 4.x needs it
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _strip_specials(text: str) -> str:
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "\n")
    return text


def _model_config(recipe: BuildRecipe, tokenizer: Any) -> Any:
    from transformers import Qwen3Config

    # Round the embedding table up like real checkpoints do; the spare rows are never a token.
    vocab = int(math.ceil(len(tokenizer) / 64) * 64)
    if recipe.family == "qwen3_5":
        return _qwen3_5_config(recipe, tokenizer, vocab)
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )


def _qwen3_5_config(recipe: BuildRecipe, tokenizer: Any, vocab: int) -> Any:
    from transformers import Qwen3_5TextConfig

    rotary_pairs = recipe.head_dim // 4 // 2  # partial rotary 0.25 rotates head_dim / 4 dims: that many pairs
    return Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,  # linear_attention x 3, full_attention (every 4th), as published
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=4096,
        # the published layout: a quarter of each head rotated, interleaved t/h/w sections, theta 1e7
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [rotary_pairs - rotary_pairs // 2, rotary_pairs // 2, 0],
                         "mrope_interleaved": True},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )


def causal_lm_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy over packed rows, never across a document boundary or into padding."""

    doc_ids = batch["doc_ids"]  # [N, S]
    mask = packed_attention_mask(doc_ids, model.config._attn_implementation, torch.float32)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   attention_mask=mask, use_cache=False).logits  # [N, S, V]
    valid = (doc_ids[:, 1:] == doc_ids[:, :-1]) & (doc_ids[:, 1:] >= 0)  # [N, S-1]: same document
    labels = batch["input_ids"][:, 1:].masked_fill(~valid, -100)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)


def _build_into(workdir: Path, *, steps: int, progress: bool, recipe: BuildRecipe) -> None:
    # One intra-op thread: CPU kernels may split reductions differently for another thread count, so
    # a fixed count makes the build bit-for-bit the same on every machine; and at this model size a
    # second thread gains little while oversubscription (a busy machine) makes it several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _train_and_save(workdir, steps=steps, progress=progress, recipe=recipe)
    finally:
        torch.set_num_threads(threads)


def _marker_name(recipe: BuildRecipe) -> str:
    """The built-in target a recipe builds (the small test recipe is the embedded one, narrower)."""
    return next((name for name, (_, built) in BUILT_IN_TARGETS.items() if built == recipe and name != "embedded"),
                EMBEDDED_NAME)


def _train_and_save(workdir: Path, *, steps: int, progress: bool, recipe: BuildRecipe) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    import transformers
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    from trainer.data.corpus import embedded_documents
    from trainer.data.datasets import batch_for_step, load_documents, pack_documents

    name = _marker_name(recipe)
    console = Console(stderr=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), console=console, transient=True,
                   disable=not (progress and console.is_terminal))
    with bar, torch.random.fork_rng(devices=[]):  # seeded locally: the caller's RNG state is untouched
        task = bar.add_task(f"{name} target: tokenizer", total=steps)
        tokenizer = _train_tokenizer(_train_texts(embedded_documents("train"), recipe), recipe.vocab_size)
        train_docs = load_documents("embedded", tokenizer, "train")
        if recipe.train_documents is not None:
            train_docs = train_docs[: recipe.train_documents]
        packed = pack_documents(train_docs, recipe.seq_len, tokenizer.pad_token_id)

        torch.manual_seed(recipe.seed)
        model_class = Qwen3_5ForCausalLM if recipe.family == "qwen3_5" else Qwen3ForCausalLM
        model = model_class(_model_config(recipe, tokenizer))
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
        bar.update(task, description=f"{name} target: training")
        loss = torch.tensor(float("nan"))
        for step in range(steps):
            lr = recipe.lr * _lr_factor(step, steps, recipe.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = causal_lm_loss(model, batch_for_step(packed, step, recipe.batch_size, recipe.seed))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            bar.update(task, advance=1, description=f"{name} target: training (loss {loss.item():.3f})")

        model.eval()
        transformers.utils.logging.disable_progress_bar()  # our own bar (or silence) is the only output
        model.save_pretrained(workdir)
        tokenizer.save_pretrained(workdir)
        marker = {"name": name, "steps": steps, "final_train_loss": round(float(loss.item()), 4),
                  "recipe": asdict(recipe), "train_rows": packed.num_rows, "data_fingerprint": packed.fingerprint}
        safe_io.write_json(workdir / BUILD_MARKER, marker, indent=2)


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def packed_attention_mask(doc_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """Block-diagonal causal mask for packed rows: [N, S] doc ids -> [N, 1, S, S].

    Query i sees key j when j <= i and both are in the same document. Padding (doc id -1) sees only
    itself, so no row of the softmax is empty (an all-masked row gives NaN in SDPA). SDPA takes a
    bool mask (True = attend); eager attention adds the mask to the scores, so it needs 0 / -inf-like.
    """
    n, s = doc_ids.shape
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # [N, S, S]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()  # [S, S]
    allowed = same_doc & causal & (doc_ids[:, None, :] >= 0)
    allowed |= torch.eye(s, dtype=torch.bool, device=doc_ids.device)
    allowed = allowed[:, None, :, :]  # [N, 1, S, S]
    if attn_implementation == "sdpa":
        return allowed
    additive = torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device)
    return additive.masked_fill(~allowed, torch.finfo(dtype).min)
