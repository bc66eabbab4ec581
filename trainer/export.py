"""Export a run's drafter for serving: z-lab's DFlash layout or the speculators (vLLM) layout.

Both layouts are a directory with `config.json` and `model.safetensors` holding the trained drafter body
under our own weight names (fc.weight [H, k*H], hidden_norm, layers.{i}.*, norm), which are the names
both z-lab's `DFlashDraftModel` and speculators' `DFlashDraftModel` use. Neither holds token embeddings
or an lm_head: the drafter borrows the target's at inference (z-lab reads them from the target model,
speculators reloads them from `speculators_config.verifier.name_or_path` in `from_pretrained`).

The two layouts number target layers differently (../shared/DFLASH.md, `dflash.target_layer_ids`):
  * z-lab: id i is the output of decoder layer i, HF `hidden_states[i + 1]` (ours too);
  * vLLM / speculators: id i is HF `hidden_states[i]`, so the same layer is z-lab id + 1.
A drafter served with the other convention's ids reads features one layer off and loses acceptance
silently (vLLM PR #40727, speculators #705), so the conversion lives in one pair of functions below.

Only the layers that feed fc are exported: a run whose fc reads a subset of its selected layers (the v5
bug) is exported with exactly those ids, so the ids and fc.weight's width always agree.

Exporting needs the run's config, its latest checkpoint and the target's config and tokenizer, never the
target's weights, so a drafter of a large target exports in seconds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel

import trainer
from trainer.config import ConfigError, TrainConfig, resolve_for_target
from trainer.model.drafter import DFlashDrafter, draft_config_from_target
from trainer.run.checkpoint import (
    DRAFTER_FILE,
    check_shapes,
    latest_checkpoint,
    read_safetensors,
    write_safetensors,
)
from trainer.run.rundir import RunDir, RunError

ExportFormat = Literal["zlab", "speculators"]
EXPORT_FORMATS: tuple[str, ...] = ("zlab", "speculators")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE)
# The speculators release whose DFlash config schema the speculators layout follows; its loader validates
# the fields, not this string.
SPECULATORS_SCHEMA_VERSION = "0.9.0"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Generic PretrainedConfig bookkeeping that says nothing about the draft architecture.
_UNINFORMATIVE_CONFIG_KEYS = frozenset(
    {
        "architectures", "id2label", "label2id", "problem_type", "return_dict", "output_hidden_states",
        "output_attentions", "chunk_size_feed_forward", "is_encoder_decoder", "_name_or_path", "dtype",
        "torch_dtype", "transformers_version", "dflash_config", "block_size", "num_target_layers",
    }
)


class ExportError(Exception):
    """The export cannot be made; the message is one line that says why and what to do."""


# --- the layer-id conventions -------------------------------------------------------------------------------


def zlab_to_vllm_layer_ids(ids: list[int]) -> list[int]:
    """z-lab ids (id i = HF hidden_states[i+1]) -> vLLM / speculators ids (id i = HF hidden_states[i])."""
    if any(i < 0 for i in ids):
        raise ValueError(f"z-lab layer ids are >= 0 (0 is the first decoder layer's output), got {ids}")
    return [i + 1 for i in ids]


def vllm_to_zlab_layer_ids(ids: list[int]) -> list[int]:
    """vLLM / speculators ids -> z-lab ids. vLLM id 0 is the embedding output, which z-lab cannot name."""
    if any(i < 1 for i in ids):
        raise ValueError(f"vLLM layer id 0 is the embedding output and has no z-lab id, got {ids}")
    return [i - 1 for i in ids]


# --- what an export describes --------------------------------------------------------------------------------


@dataclass
class DrafterSpec:
    """Everything a serving config needs about one trained drafter, independent of the layout."""

    draft_config: Qwen3Config  # the draft layers' Qwen3 config (target width, heads, RoPE; draft depth)
    target_layer_ids: list[int]  # z-lab convention, exactly the layers fc reads, in fc's order
    num_target_layers: int
    block_size: int
    mask_token_id: int
    target_path: str  # the verifier, for the speculators layout
    target_architectures: list[str]
    # Why speculators cannot serve this drafter on its target (None: it can); see speculators_refusal.
    speculators_refusal: str | None = None


@dataclass
class ExportResult:
    path: Path
    format: str
    run: str
    step: int
    config: dict[str, Any]  # the config.json written
    target_layer_ids: list[int]  # as written: z-lab ids for zlab, vLLM ids for speculators
    tensors: int
    other_files: list[str]  # entries of `out` this export did not write (kept as they were)


def zlab_config(spec: DrafterSpec, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for z-lab's DFlashDraftModel: a Qwen3 config plus `dflash_config` and the target depth.

    z-lab's model reads `dflash_config.target_layer_ids` (required), `.block_size` and `.mask_token_id`
    (falling back to top-level keys); block_size is written at the top level too because older z-lab
    checkpoints and speculators' converter read it there.
    """
    return {
        "architectures": ["DFlashDraftModel"],
        **_draft_fields(spec.draft_config, dtype),
        "block_size": spec.block_size,
        "num_target_layers": spec.num_target_layers,
        "dflash_config": {
            "target_layer_ids": list(spec.target_layer_ids),
            "block_size": spec.block_size,
            "mask_token_id": spec.mask_token_id,
        },
    }


def speculators_config(spec: DrafterSpec, dtype: torch.dtype, verifier: str | None = None) -> dict[str, Any]:
    """config.json for speculators' DFlashDraftModel (`speculators_model_type: dflash`), as vLLM serves it.

    Layer ids are in vLLM's convention. speculators reloads embed_tokens / lm_head / the verifier's final
    norm from `speculators_config.verifier.name_or_path` when it loads the directory, so that must name
    the target (a path or a hub id) wherever the export is served.
    """
    vllm_ids = zlab_to_vllm_layer_ids(spec.target_layer_ids)
    if spec.speculators_refusal is not None:
        raise ExportError(f"{spec.speculators_refusal}; export with --format zlab instead")
    if spec.num_target_layers in vllm_ids:
        # vLLM captures auxiliary hidden states at the input of decoder layers; the last layer's output is
        # only the (normed) final state, which speculators treats separately and drops from this list.
        raise ExportError(
            f"fc reads the target's last layer (z-lab id {spec.num_target_layers - 1}), which vLLM cannot capture "
            "as an auxiliary hidden state; export with --format zlab instead"
        )
    # The layer config as speculators writes it (transformers 5 keys only: it requires transformers 5).
    draft = {
        k: v
        for k, v in _draft_fields(spec.draft_config, dtype).items()
        if k not in ("rope_theta", "rope_scaling", "torch_dtype", "transformers_version")
    }
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_SCHEMA_VERSION,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    # slot 0 is the anchor (the bonus token), so a block proposes B-1 tokens
                    "speculative_tokens": spec.block_size - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier or spec.target_path,
                "architectures": list(spec.target_architectures),
            },
        },
        "transformer_layer_config": draft,
        "draft_vocab_size": spec.draft_config.vocab_size,
        "block_size": spec.block_size,
        "target_hidden_size": None,  # the drafter works at the target's width
        "aux_hidden_state_layer_ids": vllm_ids,
        # Not read by speculators (it keeps unknown keys): the target's depth makes the directory
        # self-describing, so a checker can tell which selection rule produced the ids.
        "num_target_layers": spec.num_target_layers,
        "mask_token_id": spec.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "tie_word_embeddings": False,
        "dtype": _dtype_name(dtype),
        "transformers_version": draft_transformers_version(),
    }


def _draft_fields(draft_config: Qwen3Config, dtype: torch.dtype) -> dict[str, Any]:
    """The draft layers' Qwen3 config as plain JSON, readable by transformers 4.x and 5.x alike."""
    fields = {k: v for k, v in draft_config.to_dict().items() if k not in _UNINFORMATIVE_CONFIG_KEYS}
    fields["model_type"] = "qwen3"
    rope = dict(fields.get("rope_parameters") or {})
    if rope:
        # transformers 5 reads rope_parameters; 4.x reads rope_theta (+ rope_scaling for non-default RoPE).
        fields["rope_theta"] = rope.get("rope_theta", 10000.0)
        fields["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    fields["dtype"] = fields["torch_dtype"] = _dtype_name(dtype)
    fields["transformers_version"] = draft_transformers_version()
    return fields


def draft_transformers_version() -> str:
    import transformers

    return transformers.__version__


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- reading a run -------------------------------------------------------------------------------------------


def _target_dir(config: TrainConfig, info: dict[str, Any]) -> Path:
    """The run's target directory: where run.json says it was, else the config's `target`."""
    recorded = (info.get("target") or {}).get("path")
    if recorded and (Path(recorded) / "config.json").is_file():
        return Path(recorded)
    if config.target == "embedded":
        from trainer.target.embedded import embedded_target_dir

        path = embedded_target_dir()
        hint = "; build it with `trainer target build`"
    else:
        path, hint = Path(config.target).expanduser(), ""
    if not (path / "config.json").is_file():
        raise ExportError(f"the run's target {path} is not available (no config.json){hint}")
    return path


def _mask_token_id(config: TrainConfig, target_dir: Path, vocab_size: int) -> int:
    """The mask token the run trained with: the config's, else FrozenTarget's rule on the tokenizer
    (the tokenizer's mask token, else the first embedding row no token maps to)."""
    if config.mask_token_id is not None:
        return config.mask_token_id
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    except Exception as exc:  # transformers raises many types here; all mean "no usable tokenizer"
        raise ExportError(f"cannot load the target's tokenizer in {target_dir}: {str(exc).splitlines()[0]}") from None
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    raise ExportError(f"cannot tell the run's mask token: target {target_dir} has none and no unused row")


def drafter_spec_for_run(run: RunDir) -> tuple[DrafterSpec, TrainConfig]:
    from transformers import AutoConfig

    try:
        config = run.load_config()
        info = run.read_info()
    except RunError as exc:
        raise ExportError(f"run {run.name!r}: {exc}") from None
    target_dir = _target_dir(config, info)
    try:
        target_config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    except Exception as exc:  # same: any failure means the directory is not a usable model config
        raise ExportError(f"cannot read the target's config in {target_dir}: {str(exc).splitlines()[0]}") from None
    text_config = target_config.get_text_config()
    num_target_layers = int(text_config.num_hidden_layers)
    try:
        config = resolve_for_target(config, num_target_layers)
    except ConfigError as exc:
        raise ExportError(f"run {run.name!r} does not fit its target {target_dir}: {exc}") from None
    draft_config = draft_config_from_target(target_config, config.draft_layers)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # serving stacks read them from the draft too
        setattr(draft_config, name, getattr(text_config, name, None))
    spec = DrafterSpec(
        draft_config=draft_config,
        target_layer_ids=config.fc_layer_ids(num_target_layers),
        num_target_layers=num_target_layers,
        block_size=config.block_size,
        mask_token_id=_mask_token_id(config, target_dir, int(text_config.vocab_size)),
        target_path=str(target_dir.resolve()),
        target_architectures=list(getattr(target_config, "architectures", None) or []),
        speculators_refusal=speculators_refusal(target_config),
    )
    return spec, config


# The weight names speculators 0.9.0 looks the verifier's embeddings up by (exact or as a suffix):
# src/speculators/utils/loading.py, _WEIGHT_ALIASES and _resolve_key.
SPECULATORS_EMBEDDING_NAMES = ("embed_tokens", "tok_embeddings", "llm.embed", "backbone.embeddings")


def speculators_refusal(target_config: Any) -> str | None:
    """Why speculators' DFlashDraftModel cannot give this drafter its training inputs, or None.

    speculators reloads embed_tokens from the verifier's weight files as a plain nn.Embedding table
    (model.py, _load_verifier_weights). That fails when the verifier names the table otherwise (GPT-2's
    transformer.wte), and silently changes the drafter's inputs when the target's embedding module does
    more than a lookup (Gemma's sqrt(H) scaling). The model is built on the meta device from the config
    alone (no weights, no memory), so this works for any size.
    """
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(target_config)
    except Exception:  # an architecture transformers cannot build here: nothing known against it
        return None
    embeddings = model.get_input_embeddings()
    architecture = type(model).__name__
    if type(embeddings) is not torch.nn.Embedding:
        return (
            f"{architecture} embeds tokens through {type(embeddings).__name__} (scaled), which the drafter "
            "trained on, but speculators' DFlashDraftModel reloads the verifier's embeddings as a plain table, "
            "so the served drafter would see other inputs"
        )
    name = next((n for n, module in model.named_modules() if module is embeddings), "")
    if not name.endswith(SPECULATORS_EMBEDDING_NAMES):
        return (
            f"{architecture} keeps its token embeddings as {name}.weight, and speculators' DFlashDraftModel "
            f"finds a verifier's embeddings only by the names {', '.join(SPECULATORS_EMBEDDING_NAMES)}"
        )
    return None


def _checked_weights(spec: DrafterSpec, weights_file: Path, run: RunDir) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, after checking they are exactly the drafter the spec describes."""
    with torch.device("meta"):  # shapes only: no memory, no init cost even for a large target's width
        expected = DFlashDrafter(
            spec.draft_config, len(spec.target_layer_ids), spec.block_size, spec.mask_token_id
        ).state_dict()
    try:
        weights, _ = read_safetensors(weights_file, run.path)
        check_shapes(weights_file, weights, expected, "the run's config")
    except RunError as exc:
        raise ExportError(str(exc)) from None
    return weights


# --- writing ---------------------------------------------------------------------------------------------------


def check_out_dir(out: Path, force: bool) -> list[str]:
    """Refuse a non-empty `out` unless force. Returns the entries there that an export does not write."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not force:
        raise ExportError(f"--out {out} is not empty; pass --force to overwrite the export in it")
    return [name for name in entries if name not in EXPORT_FILES]


def export_run(
    run_dir: Path,
    out: Path,
    export_format: ExportFormat = "zlab",
    *,
    force: bool = False,
    dtype: str = "auto",
    verifier: str | None = None,
) -> ExportResult:
    """Export the run's latest checkpoint to `out` in the given layout."""
    if export_format not in EXPORT_FORMATS:
        raise ExportError(f"unknown format {export_format!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    if dtype != "auto" and dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose auto or one of {', '.join(DTYPES)}")
    other_files = check_out_dir(out, force)  # before any work: a refused --out should fail at once
    run = RunDir(Path(run_dir))
    try:
        checkpoint = latest_checkpoint(run.checkpoints_dir)
    except RunError as exc:
        raise ExportError(str(exc)) from None
    if checkpoint is None:
        raise ExportError(f"run {run.name!r} has no checkpoint yet ({run.checkpoints_dir})")
    spec, run_config = drafter_spec_for_run(run)
    if run_config.draft_vocab_size:
        # The drafter is only half of such an export: its head is the target's lm_head restricted to the
        # draft vocabulary, with d2t/t2d beside it, and that layout is not written yet.
        raise ExportError(f"run {run.name!r} trains a draft vocabulary of {run_config.draft_vocab_size} tokens; "
                          "exporting it (reduced lm_head + d2t/t2d) is not implemented yet")
    weights = _checked_weights(spec, checkpoint.path / DRAFTER_FILE, run)
    out_dtype = DTYPES[dtype] if dtype != "auto" else weights["fc.weight"].dtype
    if export_format == "zlab":
        config = zlab_config(spec, out_dtype)
        written_ids = config["dflash_config"]["target_layer_ids"]
    else:
        config = speculators_config(spec, out_dtype, verifier)
        written_ids = config["aux_hidden_state_layer_ids"]

    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(out_dtype).contiguous() for name, t in weights.items()}
    metadata = {
        "format": "pt",  # transformers' from_pretrained expects it
        "layout": export_format,
        "exported_by": f"dflash-trainer {trainer.__version__}",
        "run": run.name,
        "step": str(checkpoint.step),
    }
    # Each file is staged and renamed into place, so a kill never leaves a torn file under its real name.
    staging = out / f".{WEIGHTS_FILE}.partial"
    write_safetensors(tensors, staging, metadata=metadata)
    _publish(staging, out / WEIGHTS_FILE)
    staging = out / f".{CONFIG_FILE}.partial"
    staging.write_text(json.dumps(config, indent=2) + "\n")
    _publish(staging, out / CONFIG_FILE)
    return ExportResult(
        path=out, format=export_format, run=run.name, step=checkpoint.step, config=config,
        target_layer_ids=list(written_ids), tensors=len(tensors), other_files=other_files,
    )


def _publish(staging: Path, final: Path) -> None:
    # An export is meant to be copied and served by other users and containers: plain umask permissions,
    # not the owner-only mode some writers create files with.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o666 & ~umask)
    os.replace(staging, final)


# --- reloading a z-lab export through transformers --------------------------------------------------------


class DFlashDrafterForExport(Qwen3PreTrainedModel):
    """Our drafter as a transformers model, so an exported z-lab directory loads with `from_pretrained`.

    Its submodules sit at the top level under the exported names (fc, hidden_norm, layers, norm), the
    shape of z-lab's DFlashDraftModel, and it computes with DFlashDrafter's own forward, so a reload that
    matches the original drafter proves the export carries everything the drafter needs.
    """

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = dict(getattr(config, "dflash_config", None) or {})
        if not dflash.get("target_layer_ids"):
            raise ExportError("config.json has no dflash_config.target_layer_ids: not a z-lab DFlash export")
        self.target_layer_ids: list[int] = list(dflash["target_layer_ids"])
        self.block_size = int(dflash.get("block_size", getattr(config, "block_size", 16)))
        self.mask_token_id = dflash.get("mask_token_id")
        self.num_features = len(self.target_layer_ids)
        built = DFlashDrafter(config, self.num_features, self.block_size, self.mask_token_id)
        self.fc = built.fc
        self.hidden_norm = built.hidden_norm
        self.layers = built.layers
        self.norm = built.norm
        self.rotary_emb = built.rotary_emb
        self.post_init()

    # The drafter's forward reads only the submodules adopted above, so it is shared, not copied.
    forward = DFlashDrafter.forward


def load_exported_drafter(path: Path, device: str | torch.device = "cpu") -> DFlashDrafterForExport:
    """An exported z-lab directory as a DFlashDrafterForExport (eval mode)."""
    path = Path(path)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path / CONFIG_FILE} is missing or unreadable: {exc}") from None
    if config.get("speculators_model_type"):
        raise ExportError(f"{path} is a speculators export; load it with speculators' DFlashDraftModel")
    model = DFlashDrafterForExport.from_pretrained(path, device_map=None)
    return model.to(device).eval()
