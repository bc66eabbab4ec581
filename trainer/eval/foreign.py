"""DFlash drafters trained elsewhere, loaded for `trainer eval DIR --target TARGET`.

Three layouts, all carrying the same tensors (fc, hidden_norm, layers.{i}.*, norm: the drafter body;
embeddings and lm_head are the target's):

- a z-lab directory (and our own `trainer export --format zlab`): a Qwen3 `config.json` with
  `dflash_config.{target_layer_ids, block_size, mask_token_id}`, ids in z-lab's numbering
  (id i = HF `hidden_states[i+1]`);
- a speculators checkpoint (and `trainer export --format speculators`): `speculators_model_type: dflash`,
  `transformer_layer_config` (the draft layers), `aux_hidden_state_layer_ids` in vLLM's numbering
  (id i = HF `hidden_states[i]`, so z-lab id = i - 1), `block_size`, `mask_token_id`;
- a `speculators train` save directory: its `checkpoint_best`, else its highest epoch;
- a SpecForge checkpoint (`{run_id}-step{N}/training_state.pt`) or `specforge train` output directory (its
  `{run_id}-best`, else `{run_id}-latest`, else its highest step): `draft_state_dict` holds the body, the
  resume contract the settings training resolved (`dflash_target_layer_ids` in z-lab's numbering, as
  SpecForge's `extract_context_feature` reads `hidden_states[i + 1]`; `dflash_block_size`,
  `dflash_mask_token_id`), and the draft config JSON whose path the checkpoint's provenance records the layer
  shapes (a moved run: found by the path's trailing components beside or above the checkpoint). Read with
  `torch.load(weights_only=True)`: no code in the file runs.

The drafter is rebuilt as our `DFlashDrafter` (the parity suite shows it computes what speculators'
`DFlashDraftModel` computes with the same weights) and decoded with the same speculative loop as our runs.
A speculators drafter with a reduced draft vocabulary (`d2t` / `t2d`, `draft_vocab_size` < the target's)
drafts among those target ids, placed as vLLM's d2t mapping places them, so tau is in the target vocabulary.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from trainer.safe_io import JsonTooDeep, UnsafeFileError, loads_json, read_limited

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# What checkpoints carry beside the drafter body and we do not need: the target's own tensors (we use the
# target's), and vocabulary maps that are identities for a full-vocabulary drafter.
_IGNORED_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


class ForeignDrafterError(ValueError):
    """The directory is not a DFlash drafter we can load; the message is one line."""


@dataclass
class ForeignDrafter:
    name: str
    layout: str  # "zlab" | "speculators" | "specforge"
    weights: Path
    drafter: Any  # trainer.model.drafter.DFlashDrafter
    feature_layer_ids: list[int]  # z-lab numbering: HF hidden_states[i + 1], as the eval loop expects
    block_size: int
    mask_token_id: int | None
    verifier: str | None
    draft_token_ids: torch.Tensor | None = None  # a draft vocabulary: target id of each draft index (d2t)
    draft_head: torch.Tensor | None = None  # its lm_head.weight [Vd, H] when the checkpoint holds one


def is_foreign_drafter_dir(path: Path) -> bool:
    """A directory this module loads (not one of our run directories)."""
    if (path / "run.json").is_file():
        return False
    if _specforge_checkpoint(path) is not None:
        return True
    try:
        return _drafter_dir(path) is not None
    except ForeignDrafterError:
        return True


def load_foreign_drafter(path: Path, *, hidden_size: int, num_target_layers: int,
                         device: torch.device, dtype: torch.dtype = torch.float32) -> ForeignDrafter:
    """The drafter in `path`, checked against the target's width and depth, ready for `evaluate`."""
    from transformers import Qwen3Config

    from trainer.model.drafter import DFlashDrafter

    checkpoint = _specforge_checkpoint(path)
    if checkpoint is not None:
        return _load_specforge(path, checkpoint, hidden_size=hidden_size, num_target_layers=num_target_layers,
                               device=device, dtype=dtype)
    directory = _drafter_dir(path)
    if directory is None:
        raise ForeignDrafterError(
            f"{path} is not a DFlash drafter directory (no config.json with dflash_config or "
            "speculators_model_type, and no speculators checkpoint under it)"
        )
    config = _read_json(directory / CONFIG_FILE)
    dspark = None
    if config.get("speculators_model_type"):
        layout = "speculators"
        if config.get("speculators_model_type") not in ("dflash", "dflash2", "dspark"):
            raise ForeignDrafterError(
                f"{directory}: speculators_model_type {config['speculators_model_type']!r}; only dflash, dflash2 "
                "and dspark are supported"
            )
        dflash2_fields = config if config["speculators_model_type"] == "dflash2" else None
        if config["speculators_model_type"] == "dspark":
            dspark = _dspark_settings(config, directory)
        elif config.get("sample_from_anchor"):
            raise ForeignDrafterError(f"{directory}: sample_from_anchor true (DSpark) is not supported by the eval loop")
        layer_config = dict(config.get("transformer_layer_config") or {})
        vllm_ids = config.get("aux_hidden_state_layer_ids")
        ids = _int_list(vllm_ids, directory, "aux_hidden_state_layer_ids")
        if any(i < 1 for i in ids):
            raise ForeignDrafterError(f"{directory}: aux_hidden_state_layer_ids {vllm_ids} includes 0 (the embeddings)")
        zlab_ids = [i - 1 for i in ids]
        block = config.get("block_size")
        mask = config.get("mask_token_id")
        verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    else:
        layout = "zlab"
        dflash = dict(config.get("dflash_config") or {})
        layer_config = {k: v for k, v in config.items() if k != "dflash_config"}
        zlab_ids = _int_list(dflash.get("target_layer_ids"), directory, "dflash_config.target_layer_ids")
        block = dflash.get("block_size", config.get("block_size"))
        mask = dflash.get("mask_token_id", config.get("mask_token_id"))
        verifier = None
        dflash2_fields = dflash if "DFlash2DraftModel" in (config.get("architectures") or []) else None
    if not isinstance(block, int) or block < 2:
        raise ForeignDrafterError(f"{directory}: block_size {block!r} is not an integer >= 2")
    if any(i < 0 or i >= num_target_layers for i in zlab_ids):
        raise ForeignDrafterError(
            f"{directory}: layer ids {zlab_ids} (z-lab numbering) fall outside the target's {num_target_layers} layers"
        )
    layer_config.pop("architectures", None)
    try:
        draft_config = Qwen3Config(**{k: v for k, v in layer_config.items() if k not in ("model_type", "auto_map")})
    except Exception as exc:  # transformers raises what a field's check meets (AttributeError for a dtype name)
        raise ForeignDrafterError(f"{directory}: draft layer config does not build a Qwen3 config: {exc}") from None
    if layout == "speculators":  # speculators keeps the block causality of its sliding layers at the top level
        draft_config.sliding_window_non_causal = bool(config.get("sliding_window_non_causal", False))
    elif config.get("is_causal") is False and "sliding_attention" in (draft_config.layer_types or []):
        draft_config.sliding_window_non_causal = True  # z-lab: is_causal false, every layer bidirectional in the block
    if draft_config.hidden_size != hidden_size:
        raise ForeignDrafterError(
            f"{directory}: the drafter's hidden size {draft_config.hidden_size} differs from the target's {hidden_size}"
        )
    if dspark is not None:
        from trainer.model.dspark import DSparkDrafter

        drafter = DSparkDrafter(draft_config, num_features=len(zlab_ids), block_size=block,
                                mask_token_id=mask if isinstance(mask, int) else -1, dspark=dspark)
    else:
        drafter_class: type[DFlashDrafter] = DFlashDrafter
        if dflash2_fields is not None:
            drafter_class = _with_dflash2_shape(draft_config, dflash2_fields, block, directory)
        drafter = drafter_class(draft_config, num_features=len(zlab_ids), block_size=block,
                                mask_token_id=mask if isinstance(mask, int) else -1)
    draft_token_ids, draft_head = _load_weights(drafter, directory / WEIGHTS_FILE)
    if dspark is not None and draft_token_ids is not None:
        raise ForeignDrafterError(f"{directory}: a DSpark drafter with a draft vocabulary is not supported")
    declared = config.get("draft_vocab_size") if layout == "speculators" else None
    if isinstance(declared, int) and declared < draft_config.vocab_size and draft_token_ids is None:
        raise ForeignDrafterError(f"{directory}: draft_vocab_size {declared} < vocab_size {draft_config.vocab_size} "
                                  "but the weights hold no d2t / t2d maps")
    if draft_token_ids is not None and isinstance(declared, int) and declared != draft_token_ids.numel():
        raise ForeignDrafterError(f"{directory}: draft_vocab_size {declared} but d2t maps {draft_token_ids.numel()} tokens")
    drafter.to(device=device, dtype=dtype).eval()
    return ForeignDrafter(
        name=_display_name(path, directory), layout=layout, weights=directory / WEIGHTS_FILE, drafter=drafter,
        feature_layer_ids=zlab_ids, block_size=block, mask_token_id=mask if isinstance(mask, int) else None,
        verifier=verifier if isinstance(verifier, str) else None, draft_token_ids=draft_token_ids,
        draft_head=draft_head,
    )


# --- private ---------------------------------------------------------------------------------------------


def _with_dflash2_shape(draft_config: Any, fields: dict[str, Any], block: int, directory: Path) -> type:
    """DFlash2's convolution and selector shape from the export's fields (speculators' flat ones, or z-lab's
    dflash_config) onto `draft_config`; returns the drafter class that builds it."""
    from pydantic import ValidationError

    from trainer.config import ConfigError, DFlash2Config
    from trainer.model.dflash2 import SETTINGS_ON_CONFIG, DFlash2Drafter, with_dflash2_settings

    missing = [name for name in SETTINGS_ON_CONFIG if not isinstance(fields.get(name), int)]
    if missing:
        raise ForeignDrafterError(f"{directory}: a DFlash2 config without integer {', '.join(missing)}")
    try:
        with_dflash2_settings(draft_config, DFlash2Config(**{name: fields[name] for name in SETTINGS_ON_CONFIG}), block)
    except (ValidationError, ConfigError) as exc:
        first = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        raise ForeignDrafterError(f"{directory}: its DFlash2 shape does not build: {first}") from None
    return DFlash2Drafter


# speculators 0.9.0 DSparkSpeculatorConfig's defaults (models/dspark/config.py), for fields a config leaves out
_SPECULATORS_DSPARK_DEFAULTS = {"sample_from_anchor": True, "markov_rank": 256, "markov_head_type": "vanilla",
                                "enable_confidence_head": True, "confidence_head_with_markov": True}


def _dspark_settings(config: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The DSpark heads a speculators `dspark` config describes, read as speculators reads them."""
    settings = {key: config.get(key, default) for key, default in _SPECULATORS_DSPARK_DEFAULTS.items()}
    rank, kind = settings["markov_rank"], settings["markov_head_type"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ForeignDrafterError(f"{directory}: markov_rank {rank!r} is not a non-negative integer")
    if kind not in ("vanilla", "gated", "rnn"):
        raise ForeignDrafterError(f"{directory}: markov_head_type {kind!r} is not vanilla, gated or rnn")
    if settings["enable_confidence_head"] and settings["confidence_head_with_markov"] and rank == 0:
        raise ForeignDrafterError(f"{directory}: confidence_head_with_markov needs markov_rank > 0")
    return settings


def _drafter_dir(path: Path) -> Path | None:
    """`path` itself when it holds a drafter; a speculators save directory's best (else last) epoch."""
    if not path.is_dir():
        return None
    config = _read_json_or_none(path / CONFIG_FILE)
    if config is not None and ("dflash_config" in config or config.get("speculators_model_type")):
        if not (path / WEIGHTS_FILE).is_file():
            raise ForeignDrafterError(f"{path} has a drafter config.json but no {WEIGHTS_FILE}")
        return path
    best = path / "checkpoint_best"
    if best.is_dir() and (best / CONFIG_FILE).is_file():
        return best
    epochs = sorted((c for c in path.iterdir() if c.name.isdigit() and (c / CONFIG_FILE).is_file()), key=lambda c: int(c.name))
    return epochs[-1] if epochs else None


def _named_verifier(path: Path) -> str | None:
    checkpoint = _specforge_checkpoint(path)
    if checkpoint is not None:
        try:
            return _recorded_path(_read_specforge_state(checkpoint), "target_model")
        except ForeignDrafterError:
            return None
    try:
        directory = _drafter_dir(path)
    except ForeignDrafterError:
        return None
    config = _read_json_or_none(directory / CONFIG_FILE) if directory is not None else None
    name = (((config or {}).get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return name if isinstance(name, str) else None


def _display_name(path: Path, directory: Path) -> str:
    if directory == path:
        # An epoch directory ("0", "1") says little alone: name its save directory too.
        return f"{path.parent.name}/{path.name}" if path.name.isdigit() else path.name
    resolved = directory.resolve().name
    return f"{path.name}/{directory.name}" + (f" -> {resolved}" if resolved != directory.name else "")


def _load_weights(drafter: Any, weights: Path) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Loads the drafter body; returns the draft vocabulary's target ids and its lm_head (None, None: full)."""
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise ForeignDrafterError(f"{weights} cannot be read: {exc}") from None
    return _load_tensors(drafter, tensors, weights)


def _load_tensors(drafter: Any, tensors: dict[str, torch.Tensor],
                  weights: Path) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The drafter body from tensors already read (a safetensors file, a SpecForge training state); returns
    the draft vocabulary's target ids and its lm_head (None, None: the full vocabulary)."""
    draft_token_ids = _draft_token_ids(tensors, weights)
    draft_head = None
    if draft_token_ids is not None and "lm_head.weight" in tensors:
        draft_head = tensors["lm_head.weight"]
        if draft_head.shape[0] != draft_token_ids.numel():
            raise ForeignDrafterError(f"{weights}: lm_head.weight has {draft_head.shape[0]} rows for a draft "
                                      f"vocabulary of {draft_token_ids.numel()} tokens")
    expected = drafter.state_dict()
    body = {k: v for k, v in tensors.items() if k not in _IGNORED_TENSORS and k not in ("d2t", "t2d")}
    missing = sorted(set(expected) - set(body))
    unexpected = sorted(set(body) - set(expected))
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise ForeignDrafterError(f"{weights}: tensors do not fit a DFlash drafter of this config ({detail})")
    for name, tensor in body.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ForeignDrafterError(
                f"{weights}: {name} has shape {list(tensor.shape)}, the config implies {list(expected[name].shape)}"
            )
    drafter.load_state_dict({k: v.to(expected[k].dtype) for k, v in body.items()})
    return draft_token_ids, draft_head


def _draft_token_ids(tensors: dict[str, torch.Tensor], weights: Path) -> torch.Tensor | None:
    """speculators' maps -> the target id of each draft index (d2t[i] = target id - i; t2d marks the same ids).
    Maps as long as the vocabulary are identities (speculators ignores them too): None."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None and t2d is None:
        return None
    if d2t is None or t2d is None:
        raise ForeignDrafterError(f"{weights}: has {'d2t' if t2d is None else 't2d'} without "
                                  f"{'t2d' if t2d is None else 'd2t'}; a draft vocabulary needs both maps")
    if d2t.numel() == t2d.numel():
        return None
    ids = torch.arange(d2t.numel()) + d2t.long()
    if not torch.equal(t2d.bool().nonzero()[:, 0], ids):
        raise ForeignDrafterError(f"{weights}: d2t and t2d name different target ids")
    return ids


def _int_list(value: Any, directory: Path, key: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ForeignDrafterError(f"{directory}: {key} is {json.dumps(value)}, not a list of layer ids")
    return list(value)


def _read_json(path: Path) -> dict[str, Any]:
    config = _read_json_or_none(path)
    if config is None:
        raise ForeignDrafterError(f"{path} is missing or not a JSON object")
    return config


# A drafter's config.json is a few kB; one past this is not a config, and reading it would only cost memory.
MAX_CONFIG_BYTES = 16 * 2**20


def _read_json_or_none(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when the file is missing or is not a JSON object. A file that cannot
    be what it claims (a FIFO or device, too large, nested deeper than any config) is one error naming it,
    never a read that blocks or a RecursionError."""
    try:
        data = loads_json(read_limited(path, MAX_CONFIG_BYTES))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except PermissionError:
        raise ForeignDrafterError(f"permission denied: {path}") from None
    except UnsafeFileError as exc:
        raise ForeignDrafterError(str(exc)) from None
    except JsonTooDeep as exc:
        raise ForeignDrafterError(f"{path} {exc}; it is not a drafter config") from None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# --- SpecForge: training_state.pt + the draft config JSON it records --------------------------------------

SPECFORGE_STATE = "training_state.pt"
_SPECFORGE_STEP = re.compile(r"^(?P<run_id>.+)-step(?P<step>\d+)$")


def _specforge_checkpoint(path: Path) -> Path | None:
    """`path` when it is a SpecForge checkpoint; an output directory's best, else latest, else highest step."""
    if not path.is_dir():
        return None
    if (path / SPECFORGE_STATE).is_file():
        return path
    try:
        children = list(path.iterdir())
    except OSError:
        return None
    for suffix in ("-best", "-latest"):
        for child in sorted(children):
            if child.name.endswith(suffix) and child.is_symlink() and (child / SPECFORGE_STATE).is_file():
                return child
    steps = [(int(m.group("step")), c) for c in children
             if (m := _SPECFORGE_STEP.match(c.name)) and c.is_dir() and (c / SPECFORGE_STATE).is_file()]
    return max(steps)[1] if steps else None


def _read_specforge_state(checkpoint: Path) -> dict[str, Any]:
    state_file = checkpoint / SPECFORGE_STATE
    try:
        # weights_only: tensors and plain containers, which is all SpecForge writes; no code runs
        state = torch.load(state_file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # a torn file or a pickle with code in it
        raise ForeignDrafterError(f"{state_file} cannot be read: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if not isinstance(state, dict) or not isinstance(state.get("draft_state_dict"), dict):
        raise ForeignDrafterError(f"{state_file} holds no draft_state_dict (not a SpecForge training state)")
    return state


def _recorded_path(state: dict[str, Any], key: str) -> str | None:
    """A model source's path from `specforge_model_provenance`: ((key, (kind, path, ...)), ...)."""
    for pair in state.get("specforge_model_provenance") or ():
        if isinstance(pair, (tuple, list)) and len(pair) == 2 and pair[0] == key:
            identity = pair[1]
            if isinstance(identity, (tuple, list)) and len(identity) >= 2 and isinstance(identity[1], str):
                return identity[1]
    return None


def _relocated(recorded: str, near: Path, max_up: int = 4, max_tail: int = 3) -> list[Path]:
    """The recorded absolute path, then its trailing components beside `near` and above it (a moved run)."""
    given = Path(recorded)
    candidates = [given]
    if not given.is_absolute():
        return candidates + [near / given, Path.cwd() / given]
    bases, base = [], near.resolve()
    for _ in range(max_up + 1):
        bases.append(base)
        if base.parent == base:
            break
        base = base.parent
    bases.append(Path.cwd())
    parts = given.parts[1:]
    for length in range(1, min(max_tail, len(parts)) + 1):
        candidates += [b / Path(*parts[-length:]) for b in bases]
    return candidates


def _load_specforge(path: Path, checkpoint: Path, *, hidden_size: int, num_target_layers: int,
                    device: torch.device, dtype: torch.dtype) -> ForeignDrafter:
    from transformers import Qwen3Config

    from trainer.model.drafter import DFlashDrafter

    state = _read_specforge_state(checkpoint)
    if state.get("strategy") not in ("dflash", None):
        raise ForeignDrafterError(f"{checkpoint}: strategy {state.get('strategy')!r}; only dflash is supported")
    recorded = _recorded_path(state, "draft_config")
    if recorded is None:
        raise ForeignDrafterError(f"{checkpoint}: the training state records no draft config path")
    config_file = next((c / CONFIG_FILE if c.is_dir() else c for c in _relocated(recorded, checkpoint)
                        if (c / CONFIG_FILE if c.is_dir() else c).is_file()), None)
    if config_file is None:
        raise ForeignDrafterError(
            f"{checkpoint}: its draft config {recorded} is not here (nor by its name beside or above the checkpoint)"
        )
    config = _read_json(config_file)
    dflash = dict(config.get("dflash_config") or {})
    # What training resolved (the resume contract) wins over the JSON: the weights were trained with it.
    ids = _int_list(list(state.get("dflash_target_layer_ids") or dflash.get("target_layer_ids") or []),
                    checkpoint, "dflash_target_layer_ids")
    block = state.get("dflash_block_size", config.get("block_size"))
    mask = state.get("dflash_mask_token_id", dflash.get("mask_token_id"))
    if not isinstance(block, int) or block < 2:
        raise ForeignDrafterError(f"{checkpoint}: block_size {block!r} is not an integer >= 2")
    if any(i < 0 or i >= num_target_layers for i in ids):
        raise ForeignDrafterError(
            f"{checkpoint}: layer ids {ids} (SpecForge / z-lab numbering) fall outside the target's "
            f"{num_target_layers} layers"
        )
    layer_config = {k: v for k, v in config.items()
                    if k not in ("dflash_config", "architectures", "model_type", "auto_map")}
    try:
        draft_config = Qwen3Config(**layer_config)
    except (TypeError, ValueError) as exc:
        raise ForeignDrafterError(f"{config_file}: draft layer config does not build a Qwen3 config: {exc}") from None
    if draft_config.hidden_size != hidden_size:
        raise ForeignDrafterError(
            f"{config_file}: the drafter's hidden size {draft_config.hidden_size} differs from the target's {hidden_size}"
        )
    drafter = DFlashDrafter(draft_config, num_features=len(ids), block_size=block,
                            mask_token_id=mask if isinstance(mask, int) else -1)
    _load_tensors(drafter, dict(state["draft_state_dict"]), checkpoint / SPECFORGE_STATE)
    drafter.to(device=device, dtype=dtype).eval()
    name = path.name if checkpoint == path else f"{path.name}/{checkpoint.name}"
    if checkpoint.is_symlink():
        name += f" -> {checkpoint.resolve().name}"
    return ForeignDrafter(
        name=name, layout="specforge", weights=checkpoint / SPECFORGE_STATE, drafter=drafter, feature_layer_ids=ids,
        block_size=block, mask_token_id=mask if isinstance(mask, int) else None,
        verifier=_recorded_path(state, "target_model"),
    )


# --- evaluation: one or two drafters on one target --------------------------------------------------------


def evaluate_drafters(dirs: list[Path], target_spec: str, *, prompts: int, max_new_tokens: int,
                      block_size: int | None, temperature: float, data: str, seed: int, device: str,
                      progress: Any = None, served_as: str | None = None) -> list[dict[str, Any]]:
    """Decode the same held-out prompts with each drafter on one target; one result dict per drafter.

    A directory may be one of our run directories (its latest checkpoint, with its own layer ids), an
    export, a z-lab directory, or a speculators checkpoint / save directory.
    """
    from trainer.data.datasets import heldout_prompts
    from trainer.eval.speculative import evaluate
    from trainer.run.loop import resolve_device
    from trainer.target.frozen import FrozenTarget

    torch_device = resolve_device(device)
    target = FrozenTarget.load(target_spec, torch_device, torch.float32)
    prompt_ids = heldout_prompts(data, target.tokenizer, prompts)
    results = []
    for directory in dirs:
        drafter, feature_ids, own_block, mask, name, layout = _drafter_for(directory, target, torch_device)
        report = evaluate(
            drafter, target, prompt_ids, feature_layer_ids=feature_ids, block_size=block_size or own_block,
            max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, mask_token_id=mask,
            progress=(lambda done, total, name=name: progress(name, done, total)) if progress else None,
            served_as=served_as,
        )
        results.append({"drafter": name, "layout": layout, "path": str(directory), "target": str(target.path),
                        **report.model_dump()})
    return results


def _drafter_for(directory: Path, target: Any, device: torch.device) -> tuple[Any, list[int], int, int | None, str, str]:
    if (directory / "run.json").is_file():
        return _our_run_drafter(directory, target, device)
    foreign = load_foreign_drafter(directory, hidden_size=target.hidden_size, num_target_layers=target.num_layers,
                                   device=device, dtype=target.dtype)
    # A drafter that recorded no mask token drafts with the target's (the tokenizer's mask token).
    mask = foreign.mask_token_id if foreign.mask_token_id is not None else target.mask_token_id
    foreign.drafter.mask_token_id = mask
    drafter: Any = foreign.drafter
    if foreign.draft_token_ids is not None:
        drafter = _draft_vocabulary_proposer(foreign, target)
    elif hasattr(foreign.drafter, "markov_head"):  # a DSpark drafter drafts through its Markov head
        from trainer.eval.speculative import proposer_for

        drafter = proposer_for(foreign.drafter, target)
    return drafter, foreign.feature_layer_ids, foreign.block_size, mask, foreign.name, foreign.layout


def _draft_vocabulary_proposer(foreign: ForeignDrafter, target: Any) -> Any:
    """The drafter proposing among its draft vocabulary's target ids through the target's lm_head rows,
    which must be the head the checkpoint holds (speculators freezes it to those rows)."""
    from trainer.eval.speculative import proposer_for

    ids = foreign.draft_token_ids
    assert ids is not None
    if int(ids.max()) >= target.vocab_size:
        raise ForeignDrafterError(f"{foreign.weights}: the draft vocabulary names token {int(ids.max())}, past the "
                                  f"target's vocabulary of {target.vocab_size}")
    if foreign.draft_head is not None:
        rows = target.lm_head.weight.detach()[ids.to(target.lm_head.weight.device)].cpu()
        head = foreign.draft_head
        if head.shape != rows.shape or not torch.equal(head, rows.to(head.dtype)):
            raise ForeignDrafterError(f"{foreign.weights}: lm_head.weight is not the target's lm_head on the draft "
                                      "vocabulary (a trained or foreign head is not supported)")
    return proposer_for(foreign.drafter, target, ids)


def _our_run_drafter(directory: Path, target: Any, device: torch.device) -> tuple[Any, list[int], int, int | None, str, str]:
    from trainer.run.loop import load_run

    loaded = load_run(directory, device)
    if loaded.target.num_layers != target.num_layers or loaded.target.hidden_size != target.hidden_size:
        raise ForeignDrafterError(
            f"run {directory.name} was trained on a {loaded.target.num_layers}-layer target of width "
            f"{loaded.target.hidden_size}; --target has {target.num_layers} layers of width {target.hidden_size}"
        )
    # mask None: the loop takes the drafter's own, exactly as `trainer eval RUN` and the run's eval.json do.
    # A draft-vocabulary run drafts among its vocabulary's target ids, as `trainer eval RUN` does.
    # A DSpark run drafts through its Markov head, which only its proposer applies.
    plain = loaded.draft_token_ids is None and loaded.config.drafter_kind == "dflash"
    drafter = loaded.drafter if plain else loaded.proposer()
    return (drafter, list(loaded.feature_layer_ids), loaded.config.block_size, None,
            f"{directory.name}@{loaded.step}", "run")


# --- the command behind `trainer eval DIR [--against DIR2] --target TARGET` ----------------------------------

_SIDE_BY_SIDE_ROWS = (
    ("tau", "tau", ".3f"),
    ("tokens / target forward", "tokens_per_target_forward", ".3f"),
    ("speedup", "speedup", ".2f"),
    ("lossless", "lossless", ""),
    ("prompts", "prompts", ""),
    ("block size", "block_size", ""),
)


def run_foreign_eval(run: str, against: Path | None, target: str | None, runs_dir: Path, prompts: int | None,
                     max_new_tokens: int | None, block_size: int | None, temperature: float, data: str | None,
                     seed: int | None, device: str, as_json: bool, stderr: Any, is_user_error: Any,
                     print_summary: Any, served_as: str | None = None) -> None:
    import math
    import sys

    import typer
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    def fail(message: str) -> None:
        # the one error writer: plain text, one line, a config value's control and bidi characters escaped
        from trainer.errors import print_error

        print_error(message)
        raise typer.Exit(2)

    dirs = [runs_dir / run if "/" not in run and (runs_dir / run).is_dir() else Path(run)] + ([against] if against is not None else [])
    for directory in dirs:
        if not directory.is_dir():
            fail(f"{directory} is not a directory")
    if target is None:
        named = _named_verifier(dirs[0])
        fail(f"{dirs[0]} was not trained by this trainer: give --target (the model it drafts for: 'embedded' or a "
             "Hugging Face model directory" + (f"; its config names the verifier {named!r})" if named else ")"))
    for name, value in (("--prompts", prompts), ("--max-new-tokens", max_new_tokens), ("--block-size", block_size)):
        if value is not None and value < 1:
            fail(f"{name} must be at least 1, got {value}")
    if not (temperature >= 0 and math.isfinite(temperature)):
        fail(f"--temperature must be a finite number >= 0, got {temperature}")
    from trainer.config import TrainConfig

    defaults = TrainConfig()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=stderr, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(f"decoding {name}", total=total)
            bar.update(tasks[name], completed=done)

        try:
            results = evaluate_drafters(
                dirs, target, prompts=prompts or defaults.eval_prompts,
                max_new_tokens=max_new_tokens or defaults.eval_max_new_tokens, block_size=block_size,
                temperature=temperature, data=data or "embedded", seed=defaults.seed if seed is None else seed,
                device=device, progress=progress, served_as=served_as,
            )
        except ForeignDrafterError as exc:
            fail(str(exc))
        except Exception as exc:
            if not is_user_error(exc):
                raise
            fail(str(exc))
    if as_json:
        payload = results[0] if len(results) == 1 else {"drafters": results}
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    out = Console()
    if len(results) == 1:
        # The summary's "step" names where the drafter came from: foreign directories carry no step of ours.
        print_summary({"run": results[0]["drafter"], "step": f"n/a, {results[0]['layout']} layout", **results[0]}, out)
        return
    out.print(side_by_side(results))


def side_by_side(results: list[dict[str, Any]]) -> Any:
    """One column per drafter: the headline numbers, then acceptance per slot."""
    from rich.table import Table

    table = Table("", *(f"{r['drafter']} ({r['layout']})" for r in results), title=f"on {results[0]['target']}",
                  title_justify="left")
    for label, key, spec in _SIDE_BY_SIDE_ROWS:
        table.add_row(label, *(_cell(r.get(key), spec) for r in results))
    slots = max(len(r["per_position_acceptance"]) for r in results)
    for k in range(slots):
        table.add_row(f"slot {k + 1} accepted", *(
            _cell(r["per_position_acceptance"][k], ".3f") if k < len(r["per_position_acceptance"]) else "" for r in results
        ))
    return table


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec) if spec else str(value)
