"""Export a run's drafter for serving: z-lab's DFlash layout or the speculators (vLLM) layout.

Both layouts are a directory with `config.json` and `model.safetensors` holding the trained drafter body
under our own weight names (fc.weight [H, k*H], hidden_norm, layers.{i}.*, norm), which are the names
both z-lab's `DFlashDraftModel` and speculators' `DFlashDraftModel` use. Usually neither holds token
embeddings or an lm_head: the drafter borrows the target's at inference (z-lab reads them from the target
model, speculators reloads them from `speculators_config.verifier.name_or_path` in `from_pretrained`).

Two cases add tensors to the speculators layout (speculators 0.9.0, models/dflash/core.py and model.py):
  * a target whose embeddings speculators cannot reload as the drafter saw them: speculators always
    overwrites `embed_tokens` with the verifier's raw table, found by name (`_resolve_key`), and takes
    `lm_head` from the verifier (falling back to that table when it finds no lm_head). Gemma scales the
    table by sqrt(H) inside its embedding module; GPT-2 / GPT-NeoX name the tables so speculators does
    not find them. The export then carries the effective tables itself (`embed_tokens.weight` = the target's
    embedding module applied to every id, `lm_head.weight`) and names no verifier path
    (`verifier.name_or_path: null`), the one case in which speculators keeps a checkpoint's tables;
  * a draft vocabulary: `draft_vocab_size` < the target's, `d2t` / `t2d` maps and the reduced
    `lm_head.weight` (the target's rows of the draft vocabulary), which speculators keeps from the
    checkpoint and vLLM needs.

The two layouts number target layers differently (../shared/DFLASH.md, `dflash.target_layer_ids`):
  * z-lab: id i is the output of decoder layer i, HF `hidden_states[i + 1]` (ours too);
  * vLLM / speculators: id i is HF `hidden_states[i]`, so the same layer is z-lab id + 1.
A drafter served with the other convention's ids reads features one layer off and loses acceptance
silently (vLLM PR #40727, speculators #705), so the conversion lives in one pair of functions below.

Only the layers that feed fc are exported: a run whose fc reads a subset of its selected layers (the v5
bug) is exported with exactly those ids, so the ids and fc.weight's width always agree.

Exporting needs the run's config, its latest checkpoint and the target's config and tokenizer; the target's
weights only for the two cases above (its embedding table and lm_head, loaded once on the CPU).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel

import trainer
from trainer import safe_io
from trainer.config import ConfigError, DFlash2Config, TrainConfig, resolve_for_target
from trainer.data.draft_vocab import VOCAB_FILE, load_vocab, vocab_maps
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
    # Why speculators cannot serve this drafter on its target (None: it can); see speculators_compatibility.
    speculators_refusal: str | None = None
    # Why speculators cannot reload the target's embeddings / lm_head as the drafter saw them (None: it can);
    # the speculators export then carries those tables and names no verifier path to reload them from.
    speculators_tables: str | None = None
    # Why z-lab's own decoding loop cannot reach this target's embeddings / lm_head (None: it can); a note.
    zlab_note: str | None = None
    draft_vocab_size: int | None = None  # a reduced draft vocabulary (the run's `draft_vocab_size`)
    dflash2: DFlash2Config | None = None  # a DFlash2 drafter's convolutions and selector (drafter_kind dflash2)
    dspark: dict[str, Any] | None = None  # the run's DSpark settings (drafter_kind dspark), else None


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
    notes: list[str] = field(default_factory=list)  # one line each, for stderr: what a server must know


def zlab_config(spec: DrafterSpec, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for z-lab's DFlashDraftModel: a Qwen3 config plus `dflash_config` and the target depth.

    z-lab's model reads `dflash_config.target_layer_ids` (required), `.block_size` and `.mask_token_id`
    (falling back to top-level keys); block_size is written at the top level too because older z-lab
    checkpoints and speculators' converter read it there.
    """
    config = {
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
    if spec.dflash2 is not None:
        # z-lab / vLLM #52816 / SGLang #35371 read DFlash2 from the nested dflash_config (an absent conv or
        # selector field reads as 0, i.e. that module off) and dispatch on the architecture name; the
        # bidirectional block of the sliding layers is the top-level is_causal false.
        config["architectures"] = ["DFlash2DraftModel"]
        # The selector's codebooks keep speculators' bare names (candidate_selector.*_codebook): z-lab's
        # DFlash2DraftModel.from_pretrained maps exactly those onto its Embeddings' `.weight` (dflash 0.1.0
        # model.py, key_mapping); a `.weight` name would be mapped twice.
        config["dflash_config"].update({name: getattr(spec.dflash2, name) for name in DFLASH2_SHAPE_FIELDS})
        if getattr(spec.draft_config, "sliding_window_non_causal", False):
            # z-lab reads a missing is_causal as "sliding layers causal"; false makes every layer bidirectional
            # in the block, the non-causal sliding layers this drafter trained with (full layers always are).
            config["is_causal"] = False
    return config


# DFlash2's shape as every serving config names it (speculators' flat fields, z-lab's dflash_config keys).
DFLASH2_SHAPE_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def speculators_config(spec: DrafterSpec, dtype: torch.dtype, verifier: str | None = None) -> dict[str, Any]:
    """config.json for speculators' DFlashDraftModel (`speculators_model_type: dflash`), as vLLM serves it.

    Layer ids are in vLLM's convention. speculators reloads embed_tokens / lm_head / the verifier's final
    norm from `speculators_config.verifier.name_or_path` when it loads the directory, so that must name
    the target (a path or a hub id) wherever the export is served.
    """
    vllm_ids = zlab_to_vllm_layer_ids(spec.target_layer_ids)
    if spec.speculators_refusal is not None:
        raise ExportError(f"{spec.speculators_refusal}; export with --format zlab instead")
    if spec.speculators_tables is not None and verifier is not None:
        raise ExportError(
            f"--verifier {verifier}: this export carries the target's embeddings and lm_head itself "
            f"({spec.speculators_tables}), and speculators would overwrite them from any verifier it names"
        )
    if spec.num_target_layers in vllm_ids:
        # vLLM captures auxiliary hidden states at the input of decoder layers; the last layer's output is
        # only the (normed) final state, which speculators treats separately and drops from this list.
        raise ExportError(
            f"fc reads the target's last layer (z-lab id {spec.num_target_layers - 1}), which vLLM cannot capture "
            "as an auxiliary hidden state; export with --format zlab instead"
        )
    # The layer config as speculators writes it (transformers 5 keys only: it requires transformers 5).
    # sliding_window_non_causal is speculators' top-level field, not the layer config's.
    draft = {
        k: v
        for k, v in _draft_fields(spec.draft_config, dtype).items()
        if k not in ("rope_theta", "rope_scaling", "torch_dtype", "transformers_version", "sliding_window_non_causal")
    }
    algorithm = "dspark" if spec.dspark is not None else "dflash2" if spec.dflash2 is not None else "dflash"
    # slot 0 is the anchor (the bonus token), so a block proposes B-1 tokens; a DSpark block that samples from
    # its anchor trains slot 0 too and proposes B (speculators #737: its converter wrote B-1 for DSpark)
    sample_from_anchor = bool(spec.dspark["sample_from_anchor"]) if spec.dspark is not None else False
    config = {
        "architectures": [{"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel",
                           "dspark": "DSparkDraftModel"}[algorithm]],
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_SCHEMA_VERSION,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": spec.block_size if sample_from_anchor else spec.block_size - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                # null: speculators keeps the checkpoint's embed_tokens / lm_head instead of reloading them
                "name_or_path": None if spec.speculators_tables is not None else verifier or spec.target_path,
                "architectures": list(spec.target_architectures),
            },
        },
        "transformer_layer_config": draft,
        # < vocab_size: a draft vocabulary, whose d2t / t2d maps and reduced lm_head are in the weights
        "draft_vocab_size": spec.draft_vocab_size or spec.draft_config.vocab_size,
        "block_size": spec.block_size,
        "target_hidden_size": None,  # the drafter works at the target's width
        "aux_hidden_state_layer_ids": vllm_ids,
        # Not read by speculators (it keeps unknown keys): the target's depth makes the directory
        # self-describing, so a checker can tell which selection rule produced the ids.
        "num_target_layers": spec.num_target_layers,
        **({"verifier_tables_in_checkpoint": spec.speculators_tables} if spec.speculators_tables else {}),
        "mask_token_id": spec.mask_token_id,
        # speculators' own flag: its sliding layers attend causally within a block unless it is true
        "sliding_window_non_causal": bool(getattr(spec.draft_config, "sliding_window_non_causal", False)),
        # always written: servers disagree on its default when it is absent (llama.cpp #26275, vLLM #48639)
        "sample_from_anchor": sample_from_anchor,
        "tie_word_embeddings": False,
        "dtype": _dtype_name(dtype),
        "transformers_version": draft_transformers_version(),
    }
    if spec.dflash2 is not None:  # speculators 0.9.0 DFlash2SpeculatorConfig's flat fields
        config.update({name: getattr(spec.dflash2, name) for name in DFLASH2_SHAPE_FIELDS})
    if spec.dspark is not None:  # speculators' DSparkSpeculatorConfig fields (models/dspark/config.py)
        config.update({key: spec.dspark[key] for key in DSPARK_SERVED_FIELDS})
    return config


# The DSpark settings a server builds the heads from; confidence_head_alpha is training-only.
DSPARK_SERVED_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


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
    from trainer.target.embedded import BUILT_IN_TARGETS, built_in_target_dir

    if config.target in BUILT_IN_TARGETS:
        path = built_in_target_dir(config.target)
        hint = "; build it with `trainer target build`" if config.target == "embedded" else "; any run on it builds it"
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
    try:
        draft_config = draft_config_from_target(target_config, config.draft_layers, config.draft_config.as_shape())
    except ConfigError as exc:
        raise ExportError(f"run {run.name!r}: {exc}") from None
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
        draft_vocab_size=config.draft_vocab_size,
        dflash2=config.dflash2 if config.drafter_kind == "dflash2" else None,
        dspark=config.dspark.model_dump() if config.drafter_kind == "dspark" and config.dspark is not None else None,
    )
    if spec.dflash2 is not None:
        from trainer.model.dflash2 import with_dflash2_settings

        try:
            with_dflash2_settings(draft_config, spec.dflash2, config.block_size)
        except ConfigError as exc:
            raise ExportError(f"run {run.name!r}: {exc}") from None
    spec.speculators_refusal, spec.speculators_tables, spec.zlab_note = target_compatibility(target_config, target_dir)
    return spec, config


# How speculators 0.9.0 finds a verifier's tensors by name (src/speculators/utils/loading.py, _WEIGHT_ALIASES
# and _resolve_key: exact name, else the shortest key ending with it, else the aliases the same way).
SPECULATORS_WEIGHT_ALIASES = {
    "embed_tokens.weight": ("tok_embeddings.weight", "llm.embed.weight", "backbone.embeddings.weight"),
    "lm_head.weight": ("output.weight", "llm.unembed.weight"),
}


def speculators_resolve_key(name: str, keys: set[str]) -> str | None:
    """The verifier tensor speculators loads for `name` ("embed_tokens.weight" / "lm_head.weight"), or None."""
    for candidate in (name, *SPECULATORS_WEIGHT_ALIASES.get(name, ())):
        if candidate in keys:
            return candidate
        matches = [k for k in keys if k.endswith(candidate)]
        if matches:
            return min(matches, key=len)
    return None


def target_compatibility(target_config: Any, target_dir: Path | None = None) -> tuple[str | None, str | None, str | None]:
    """(speculators refusal, speculators tables, z-lab note) for a target; each None when nothing is wrong.

    * refusal: speculators' DFlashDraftModel cannot compute the drafter's logits at all (its lm_head is a
      bias-free Linear);
    * tables: speculators cannot reload the embeddings / lm_head as the drafter saw them. It overwrites
      `embed_tokens` with the verifier's raw table found by name and reads `lm_head` by name, falling back
      to that table (speculators 0.9.0 model.py, _load_verifier_weights). Wrong when the embedding module
      does more than a lookup (Gemma's sqrt(H) scaling) or the names resolve to other tensors (GPT-2's
      transformer.wte, GPT-NeoX's gpt_neox.embed_in). The export then carries the tables (see the module docstring);
    * z-lab note: z-lab's dflash_generate embeds with `target.model.embed_tokens` and drafts with
      `target.lm_head`; a model without those attributes cannot run that loop (the export itself is fine).
    The model is built on the meta device from the config alone (no weights, no memory); the weight names
    are read from the target's safetensors headers when there are any.
    """
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(target_config)
    except Exception:  # an architecture transformers cannot build here: nothing known against it
        return None, None, None
    architecture = type(model).__name__
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or not isinstance(head, torch.nn.Linear):
        return (f"{architecture} has no Linear lm_head (get_output_embeddings() is {type(head).__name__}), and "
                "speculators' DFlashDraftModel drafts through one"), None, None
    if head.bias is not None:
        return (f"{architecture}'s lm_head has a bias, and speculators' DFlashDraftModel's lm_head is a Linear "
                "without one"), None, None
    names = {id(module): name for name, module in model.named_modules()}
    embed_key, head_key = f"{names.get(id(embeddings), '')}.weight", f"{names.get(id(head), '')}.weight"
    keys = _weight_keys(target_dir) or set(model.state_dict())
    tied = head.weight is embeddings.weight
    tables = None
    if type(embeddings) is not torch.nn.Embedding:
        tables = (f"{architecture} embeds tokens through {type(embeddings).__name__}, which scales the table, and "
                  "speculators reloads the verifier's raw table")
    else:
        found_embed = speculators_resolve_key("embed_tokens.weight", keys)
        found_head = speculators_resolve_key("lm_head.weight", keys) or found_embed
        if found_embed != embed_key:
            tables = (f"speculators looks the verifier's embeddings up as embed_tokens.weight and finds "
                      f"{found_embed or 'nothing'} in {architecture}, whose table is {embed_key}")
        elif found_head != (embed_key if tied and head_key not in keys else head_key):
            tables = (f"speculators looks the verifier's lm_head up as lm_head.weight and takes {found_head} in "
                      f"{architecture}, whose lm_head is {head_key}")
    zlab_embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    zlab_note = None
    if zlab_embed is not embeddings or getattr(model, "lm_head", None) is not head:
        zlab_note = (f"z-lab's dflash_generate calls target.model.embed_tokens and target.lm_head, which "
                     f"{architecture} names {embed_key.removesuffix('.weight')} and {head_key.removesuffix('.weight')}: "
                     "serve this export with `trainer eval --target` or a server that maps them")
    return None, tables, zlab_note


def _weight_keys(target_dir: Path | None) -> set[str]:
    """Tensor names in the target's safetensors files (headers only), empty when it has none."""
    if target_dir is None:
        return set()
    index = target_dir / "model.safetensors.index.json"
    try:
        if index.is_file():
            return set(safe_io.loads_json(safe_io.read_limited(index, 64 * 2**20))["weight_map"])
        from safetensors import safe_open

        keys: set[str] = set()
        for path in target_dir.glob("*.safetensors"):
            with safe_open(str(path), framework="pt") as handle:
                keys.update(handle.keys())
        return keys
    except (OSError, KeyError, ValueError):
        return set()


def _target_tables(spec: DrafterSpec, dtype: torch.dtype, vocab_ids: torch.Tensor | None,
                   embeddings: bool) -> dict[str, torch.Tensor]:
    """The tensors a speculators export carries from the target: `embed_tokens.weight` (the target's
    embedding module applied to every id: what the drafter's block tokens went through, scale included)
    when `embeddings`, and `lm_head.weight` (the rows of the draft vocabulary, if any), computed in the
    dtype the run trained in (its checkpoint's), as training computed them."""
    from trainer.target.frozen import FrozenTarget, TargetError

    try:
        target = FrozenTarget.load(spec.target_path, torch.device("cpu"), dtype)
    except TargetError as exc:
        raise ExportError(f"cannot load the target's embeddings and lm_head: {exc}") from None
    tables: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if embeddings:
            rows = target.model.get_input_embeddings().weight.shape[0]
            tables["embed_tokens.weight"] = target.embed(torch.arange(rows))  # [V, H]
        head = target.lm_head.weight  # [V, H]
        tables["lm_head.weight"] = head if vocab_ids is None else head[vocab_ids]  # [V or Vd, H]
    return {name: t.detach().clone() for name, t in tables.items()}


def _checked_weights(spec: DrafterSpec, weights_file: Path, run: RunDir) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, after checking they are exactly the drafter the spec describes."""
    drafter_class: type[DFlashDrafter] = DFlashDrafter
    if spec.dflash2 is not None:
        from trainer.model.dflash2 import DFlash2Drafter

        drafter_class = DFlash2Drafter
    with torch.device("meta"):  # shapes only: no memory, no init cost even for a large target's width
        if spec.dspark is not None:
            from trainer.model.dspark import DSparkDrafter

            expected = DSparkDrafter(spec.draft_config, len(spec.target_layer_ids), spec.block_size,
                                     spec.mask_token_id, dspark=spec.dspark).state_dict()
        else:
            expected = drafter_class(
                spec.draft_config, len(spec.target_layer_ids), spec.block_size, spec.mask_token_id
            ).state_dict()
    try:
        weights, _ = read_safetensors(weights_file, run.path)
        check_shapes(weights_file, weights, expected, "the run's config")
    except RunError as exc:
        raise ExportError(str(exc)) from None
    return weights


# --- writing ---------------------------------------------------------------------------------------------------


# Every export's model.safetensors carries this in its metadata (`exported_by`): the mark `--force` looks for.
EXPORT_MARK = "dflash-trainer"


def check_out_dir(out: Path, force: bool) -> list[str]:
    """Refuse a non-empty `out` unless force; with force, refuse anything but an export of ours (a run, a
    Hugging Face model, another tool's files). Returns the entries there that an export does not write."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not force:
        raise ExportError(f"--out {out} is not empty; pass --force to overwrite the export in it")
    if entries:
        problem = _not_an_export(out, entries)
        if problem is not None:
            raise ExportError(f"--out {out} {problem}; --force only replaces an earlier `trainer export` output")
    return [name for name in entries if name not in EXPORT_FILES and not _is_staging(name)]


def _is_staging(name: str) -> bool:
    """A temporary entry an export writes before its rename (trainer.safe_io's `.<file>.<random>.tmp`, or the
    `.<file>.partial` of earlier versions): what a killed export leaves behind."""
    return any(name == f".{file}.partial" or _STAGING_TMP.fullmatch(name) and name.startswith(f".{file}.")
               for file in EXPORT_FILES)


_STAGING_TMP = re.compile(r"\.[^/]+\.[0-9a-f]{16}\.tmp")


def _not_an_export(out: Path, entries: list[str]) -> str | None:
    """Why `out` is not a directory `trainer export` wrote (None when it is): its model.safetensors must
    carry our mark. A run directory (config.json, checkpoints/), a model directory or another run's files
    are never replaced, so `--out <the run itself> --force` cannot overwrite a run's config.json."""
    if any(marker in entries for marker in ("run.json", "checkpoints", "metrics.jsonl", "code")):
        return "is a run directory"
    if all(_is_staging(name) for name in entries):
        return None  # only what a killed export left behind
    weights = out / WEIGHTS_FILE
    if WEIGHTS_FILE not in entries or weights.is_symlink() or not weights.is_file():
        return f"holds no {WEIGHTS_FILE} written by trainer export"
    try:
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as handle:
            exported_by = (handle.metadata() or {}).get("exported_by", "")
    except Exception:  # safetensors raises several types for a damaged file: not ours to replace either way
        return f"holds a {WEIGHTS_FILE} that is not readable as an export of ours"
    if not exported_by.startswith(EXPORT_MARK):
        return f"holds a {WEIGHTS_FILE} that trainer export did not write (a model of its own, another tool's)"
    return None


def _served_by_engine(run: Any, step: int) -> dict[str, Any] | None:
    """eval.json `served_by_engine` of the run's final eval (tau and verify steps per serving engine), when the
    export is of that same step; None otherwise."""
    try:
        report = json.loads((run.path / "eval.json").read_text())
    except (OSError, ValueError):
        return None
    engines = report.get("served_by_engine") if isinstance(report, dict) else None
    if not isinstance(engines, dict) or report.get("step") != step:
        return None
    keep = ("tau", "verify_steps", "lossless", "serves_as_trained", "same_semantics_as")
    return {name: {k: row.get(k) for k in keep} for name, row in engines.items() if isinstance(row, dict)}


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
    vocab_ids = _draft_vocabulary(run, run_config)
    if vocab_ids is not None and export_format == "zlab":
        raise ExportError(
            f"run {run.name!r} trains a draft vocabulary of {run_config.draft_vocab_size} tokens, and z-lab's "
            "DFlashDraftModel drafts through the target's whole lm_head with no draft-to-target map (d2t); "
            "export with --format speculators"
        )
    if spec.dspark is not None and export_format != "speculators":
        raise ExportError(f"run {run.name!r} trains a DSpark drafter, which z-lab's DFlashDraftModel cannot load "
                          "(no Markov or confidence head); export with --format speculators")
    weights = _checked_weights(spec, checkpoint.path / DRAFTER_FILE, run)
    out_dtype = DTYPES[dtype] if dtype != "auto" else weights["fc.weight"].dtype
    notes: list[str] = []
    if export_format == "zlab":
        config = zlab_config(spec, out_dtype)
        written_ids = config["dflash_config"]["target_layer_ids"]
        if spec.zlab_note:
            notes.append(spec.zlab_note)
    else:
        config = speculators_config(spec, out_dtype, verifier)
        written_ids = config["aux_hidden_state_layer_ids"]
        if spec.speculators_tables is not None or vocab_ids is not None:
            carry_embeddings = spec.speculators_tables is not None
            weights = {**weights, **_target_tables(spec, weights["fc.weight"].dtype, vocab_ids, carry_embeddings)}
        if spec.speculators_tables is not None:
            notes.append(f"the export carries the target's embeddings and lm_head and names no verifier path: "
                         f"{spec.speculators_tables}")

    # How the drafter trained, as the run recorded it off its modules (run.json `drafter`): sleuth compares
    # it with what a server builds from the rest of this config (rope, sliding windows). Loaders ignore it.
    config["dflash_training"] = {"exported_by": f"dflash-trainer {trainer.__version__}", "run": run.name,
                                 "step": checkpoint.step, "drafter": _trained_record(run)}
    served = _served_by_engine(run, checkpoint.step)
    if served:  # what each engine's decoding measured at the run's end, for sleuth to quote about the export
        config["dflash_training"]["served_by_engine"] = served

    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(out_dtype).contiguous() for name, t in weights.items()}
    if vocab_ids is not None and export_format == "speculators":
        # speculators' buffers: d2t[i] = target id - i (long), t2d[v] = v is drafted (bool); never cast
        tensors["d2t"], tensors["t2d"] = vocab_maps(vocab_ids, spec.draft_config.vocab_size)
    metadata = {
        "format": "pt",  # transformers' from_pretrained expects it
        "layout": export_format,
        "exported_by": f"{EXPORT_MARK} {trainer.__version__}",  # the mark `--force` requires to replace it
        "run": run.name,
        "step": str(checkpoint.step),
    }
    # Each file is written through a temporary file of this process's own and renamed into place
    # (trainer.safe_io): a kill never leaves a torn file under its real name, and a link planted in --out
    # is refused, never written through. An export is meant to be copied and served by other users and
    # containers: plain umask permissions, not an owner-only mode.
    write_safetensors(tensors, out / WEIGHTS_FILE, metadata=metadata)
    safe_io.write_json(out / CONFIG_FILE, config, indent=2)
    return ExportResult(
        path=out, format=export_format, run=run.name, step=checkpoint.step, config=config,
        target_layer_ids=list(written_ids), tensors=len(tensors), other_files=other_files, notes=notes,
    )


def _trained_record(run: RunDir) -> dict[str, Any] | None:
    """run.json `drafter` (None for a run that does not record it)."""
    try:
        record = run.read_info().get("drafter")
    except RunError:
        return None
    return record if isinstance(record, dict) and record else None


def _draft_vocabulary(run: RunDir, run_config: TrainConfig) -> torch.Tensor | None:
    """The run's draft vocabulary (sorted target ids), None for a full-vocabulary run."""
    if not run_config.draft_vocab_size:
        return None
    from safetensors import SafetensorError

    path = run.path / VOCAB_FILE
    try:
        return load_vocab(path)
    except (OSError, KeyError, SafetensorError) as exc:
        raise ExportError(f"run {run.name!r} has a draft vocabulary but {path} is unreadable: {exc}") from None


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
        self.attention = built.attention  # per-layer type and window, read from this config as the loaders do
        self.post_init()

    # The drafter's forward reads only the submodules adopted above, so it is shared, not copied.
    forward = DFlashDrafter.forward
    _decode_masks = DFlashDrafter._decode_masks


def load_exported_drafter(path: Path, device: str | torch.device = "cpu") -> DFlashDrafterForExport:
    """An exported z-lab directory as a DFlashDrafterForExport (eval mode)."""
    path = Path(path)
    try:
        config = safe_io.loads_json(safe_io.read_limited(path / CONFIG_FILE, 16 * 2**20))
    except (OSError, ValueError, safe_io.UnsafeFileError) as exc:
        raise ExportError(f"{path / CONFIG_FILE} is missing or unreadable: {exc}") from None
    if config.get("speculators_model_type"):
        raise ExportError(f"{path} is a speculators export; load it with speculators' DFlashDraftModel")
    if "DFlash2DraftModel" in (config.get("architectures") or []):
        # DFlashDrafterForExport has no convolutions or selector: it would load and draft as plain DFlash
        raise ExportError(f"{path} is a DFlash2 export; this loader reads DFlash exports only")
    model = DFlashDrafterForExport.from_pretrained(path, device_map=None)
    return model.to(device).eval()
