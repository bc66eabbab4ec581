"""`dflash.hidden_state_capture`: hidden states captured outside training are the layers they claim to be.

Offline pipelines (speculators' `generate_offline_data`, any trainer's hidden-state cache) store target
hidden states that training later reads as "layer i". An off-by-one between layer conventions (vLLM /
speculators index HF `hidden_states[i]`, z-lab means the output of decoder layer i = `hidden_states[i+1]`;
vLLM PR #40727, speculators #705) or a final norm applied to a state that should be raw trains the drafter
on features serving never gives it (speculators #613: good validation, poor acceptance, an extraction bug).

This check recomputes a sample in-process with the Hugging Face target and compares layer by layer. It
needs torch and transformers, imported only when it runs.

Cache layouts understood (`sleuth diagnose --hidden-states DIR`):
* speculators: `DIR/hs_<i>.safetensors` (or `DIR/hidden_states/hs_<i>.safetensors`), tensors `token_ids`
  [T] and `hidden_states` [T, n, H]; the n entries are the config's `aux_hidden_state_layer_ids` (HF
  `hidden_states[i]`, i.e. the output of decoder layer i-1) followed, when n is one more, by the last
  decoder layer's output before the final norm (speculators applies `verifier_norm` itself).
* dflash-hidden-states v1: `DIR/manifest.json` `{"format": "dflash-hidden-states", "version": 1,
  "layer_ids": [...], "convention": "zlab" | "hf", "target": optional path}` and `DIR/*.safetensors` with
  `input_ids` [T] and `hidden_states` [T, k, H]. `zlab`: id i = output of decoder layer i; `hf`: id i =
  HF `hidden_states[i]` (0 = the embeddings). Every stored state is the raw residual stream (no final norm).
* the trainer's offline cache (`trainer hidden-states generate`, docs/guides/targets.md "Offline hidden
  states"): `DIR/manifest.json` with `layers` (z-lab ids) and `target.path`, and `DIR/shard-NNNNN.safetensors`
  holding packed rows: `input_ids`, `position_ids` [n, S] (positions restart at 0 at every document) and
  `layer.<i>` [n, S, H] = HF `hidden_states[i + 1]` exactly as transformers returns it, i.e. raw for every
  layer but the last, which transformers hands out through the final norm. Read through the manifest and
  the tensor names only. Each sampled document is recomputed alone (its positions from 0), as the trainer's
  packed forward must reproduce it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sleuth.checks.context import ContractContext, int_list, read_json
from sleuth.findings import Evidence, Finding, Fix

ID = "dflash.hidden_state_capture"
MANIFEST_FORMAT = "dflash-hidden-states"
SAMPLE_FILES = 4
SAMPLE_TOKENS = 256
# Relative L2 error under which a stored state is the recomputed one (bf16 storage rounds at ~4e-3).
TOLERANCE = 2e-2


TRAINER_FORMAT = "trainer hidden-states"


@dataclass
class CacheLayout:
    kind: str  # "speculators" | MANIFEST_FORMAT | TRAINER_FORMAT
    files: list[Path]
    token_key: str
    hf_indices: list[int] | None  # per stored entry: HF hidden_states index (0 = embeddings)
    source: str  # where the layer ids came from
    target: str | None = None
    # "raw": the residual stream (pre-norm); "hf": as transformers' output_hidden_states returns it (the
    # last index through the final norm, every other one raw).
    state: str = "raw"
    entry_names: list[str] | None = None  # how the finding names each stored entry (default "entry k")


@dataclass
class Sample:
    location: str
    ids: list[int]
    states: Any  # [T, n, H] float32


def _trainer_layout(cache: Path, manifest: dict[str, Any]) -> tuple[CacheLayout | None, str]:
    """The trainer's cache, read through its manifest (`layers`, `target.path`) and tensor names."""
    layers = int_list(manifest.get("layers"))
    if not layers:
        return None, f"{cache / 'manifest.json'}: `layers` lists no layer ids"
    files = sorted(p for p in cache.glob("shard-*.safetensors") if p.is_file())
    target = manifest.get("target")
    target_path = target.get("path") if isinstance(target, dict) and isinstance(target.get("path"), str) else None
    return CacheLayout(TRAINER_FORMAT, files, "input_ids", [i + 1 for i in layers],
                       f"manifest.json layers {layers} (z-lab ids: layer i = HF hidden_states[i+1])", target_path,
                       state="hf", entry_names=[f"layer.{i}" for i in layers]), ""


def _hs_files(directory: Path) -> list[Path]:
    def index(path: Path) -> int:
        stem = path.stem[3:]
        return int(stem) if stem.isdigit() else 1 << 30

    return sorted((p for p in directory.glob("hs_*.safetensors") if p.is_file()), key=index)


def find_layout(cache: Path, config: dict[str, Any] | None) -> tuple[CacheLayout | None, str]:
    """The layout of `cache`, or (None, why not)."""
    manifest = read_json(cache / "manifest.json")
    if (manifest is not None and manifest.get("format") != MANIFEST_FORMAT and isinstance(manifest.get("layers"), list)
            and any(cache.glob("shard-*.safetensors"))):
        return _trainer_layout(cache, manifest)
    if manifest is not None and manifest.get("format") == MANIFEST_FORMAT:
        ids = int_list(manifest.get("layer_ids"))
        convention = manifest.get("convention")
        if not ids or convention not in ("zlab", "hf"):
            return None, f"{cache / 'manifest.json'}: needs layer_ids (a list) and convention 'zlab' or 'hf'"
        files = sorted(p for p in cache.glob("*.safetensors") if p.is_file())
        indices = [i + 1 for i in ids] if convention == "zlab" else ids
        target = manifest.get("target") if isinstance(manifest.get("target"), str) else None
        return CacheLayout(MANIFEST_FORMAT, files, "input_ids", indices,
                           f"manifest.json layer_ids {ids} ({convention} convention)", target), ""
    for directory in (cache, cache / "hidden_states"):
        files = _hs_files(directory) if directory.is_dir() else []
        if files:
            aux = int_list((config or {}).get("aux_hidden_state_layer_ids"))
            source = f"aux_hidden_state_layer_ids {aux} (vLLM convention) + the final layer" if aux else ""
            return CacheLayout("speculators", files, "token_ids", aux or None, source), ""
    return None, f"{cache} holds neither hs_*.safetensors (speculators) nor a {MANIFEST_FORMAT} manifest.json"


def _decoder_layers(model: Any, num_layers: int) -> Any:
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    return None


def _final_norm(model: Any) -> Any:
    base = getattr(model, "model", None) or getattr(model, "transformer", None) or model
    for name in ("norm", "final_layernorm", "ln_f", "final_norm"):
        if hasattr(base, name):
            return getattr(base, name)
    return None


def recompute_states(target_dir: Path, token_ids: list[list[int]]) -> dict[str, list[list[Any]]]:
    """Per sequence, {kind: states at every HF index 0..L}: "raw" the residual stream (L = the last decoder
    layer's output before the final norm), "normed" the same through the final norm (empty where the model
    has none), "hf" what transformers' output_hidden_states returns. Imports torch/transformers here only."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, local_files_only=True)
    model.eval()
    layers = _decoder_layers(model, int(text.num_hidden_layers))
    captured: list[Any] = []

    def keep(_module: Any, _inputs: Any, output: Any) -> None:
        captured.append((output[0] if isinstance(output, tuple) else output).detach())

    hooks = [layer.register_forward_hook(keep) for layer in layers] if layers is not None else []
    states: list[list[Any]] = []
    normed: list[list[Any]] = []
    returned: list[list[Any]] = []
    try:
        with torch.no_grad():
            for ids in token_ids:
                captured.clear()
                out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
                raw = [out.hidden_states[0][0]] + [c[0] for c in captured]  # [T, H] each, HF index 0..L
                states.append(raw)
                norm = _final_norm(model)
                normed.append([norm(state) for state in raw] if norm is not None else [])
                returned.append([h[0] for h in out.hidden_states])
    finally:
        for hook in hooks:
            hook.remove()
    return {"raw": states, "normed": normed, "hf": returned}


def _relative_error(a: Any, b: Any) -> float:
    return float((a - b).norm() / (b.norm() + 1e-12))


def _name(index: int) -> str:
    return "the embeddings (HF hidden_states[0])" if index == 0 else \
        f"decoder layer {index - 1}'s output (HF hidden_states[{index}])"


def _is_normed(kind: str, index: int, num_layers: int) -> bool:
    return kind == "normed" or (kind == "hf" and index == num_layers)


def _describe(kind: str, index: int, num_layers: int) -> str:
    if kind == "normed":
        return f"final_norm({_name(index)})"
    if kind == "hf" and index == num_layers:
        return (f"final_norm({_name(index)}), which is HF hidden_states[{index}] as transformers returns it")
    return _name(index)


def _read_samples(layout: CacheLayout) -> tuple[list[Sample], str]:
    """Up to SAMPLE_FILES sequences of up to SAMPLE_TOKENS tokens with their stored states, or ([], why)."""
    from safetensors import safe_open

    samples: list[Sample] = []
    for path in layout.files[:SAMPLE_FILES]:
        try:
            with safe_open(str(path), framework="pt") as handle:
                if layout.kind == TRAINER_FORMAT:
                    samples += _packed_row_samples(path, handle, layout)
                    continue
                ids = handle.get_tensor(layout.token_key)[:SAMPLE_TOKENS].tolist()
                states = handle.get_tensor("hidden_states")[:SAMPLE_TOKENS].float()  # [T, n, H]
        except Exception as exc:  # a torn or foreign file: say which and why
            return [], f"{path}: cannot read token ids and hidden states ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        if states.ndim != 3 or states.shape[0] != len(ids):
            return [], f"{path}: hidden_states {tuple(states.shape)} is not [T, n, H] for {len(ids)} tokens"
        samples.append(Sample(str(path), ids, states))
    return samples, ""


def _packed_row_samples(path: Path, handle: Any, layout: CacheLayout) -> list[Sample]:
    """The documents of a shard's first row, each alone: positions restart at 0 at every document; a run of
    single-token "documents" at position 0 is the row's padding, skipped with any one-token document."""
    import torch

    ids = handle.get_slice("input_ids")[0:1][0]  # [S]
    positions = handle.get_slice("position_ids")[0:1][0]  # [S]
    stored = torch.stack([handle.get_slice(name)[0:1][0].float() for name in layout.entry_names or []], dim=1)  # [S, n, H]
    starts = [i for i in range(len(positions)) if int(positions[i]) == 0] + [len(positions)]
    samples: list[Sample] = []
    budget = SAMPLE_TOKENS
    for start, end in zip(starts, starts[1:]):
        if end - start < 2 or budget <= 0:
            continue
        end = min(end, start + budget)
        budget -= end - start
        samples.append(Sample(f"{path} row 0 tokens {start}..{end - 1}", ids[start:end].tolist(), stored[start:end]))
    return samples


def check_hidden_state_capture(ctx: ContractContext) -> Finding:
    cache, given_as = ctx.hidden_states, "--hidden-states"
    recorded = (ctx.run.config or {}).get("hidden_states") if ctx.run is not None else None
    if cache is None and isinstance(recorded, str) and recorded:
        # A run trained from an offline cache names it in config.json (`hidden_states: DIR`).
        cache, given_as = Path(recorded).expanduser(), "config.json hidden_states"
    if cache is None:
        return ctx.finding(ID, "unknown", reason="no offline hidden-state cache given (--hidden-states DIR) or "
                           "recorded (config.json hidden_states); a run that computes them online has nothing to check here")
    if not cache.is_dir():
        return ctx.finding(ID, "unknown", reason=f"{given_as} {cache} is not a directory")
    layout, why = find_layout(cache, ctx.config)
    if layout is None:
        return ctx.finding(ID, "unknown", reason=why)
    target_dir, target_source = ctx.resolve_target_dir()
    if target_dir is None and layout.target and Path(layout.target).expanduser().is_dir():
        target_dir, target_source = Path(layout.target).expanduser(), "manifest.json target"
    if target_dir is None:
        return ctx.finding(ID, "unknown", reason=f"the target to recompute with is unknown: {target_source}")
    samples, why = _read_samples(layout)
    if why:
        return ctx.finding(ID, "unknown", reason=why)
    if not samples:
        return ctx.finding(ID, "unknown", reason=f"{cache}: no hidden-state files")
    entries = samples[0].states.shape[1]
    indices = layout.hf_indices
    try:
        recomputed = recompute_states(target_dir, [sample.ids for sample in samples])
    except Exception as exc:  # an unloadable target is reported, not raised
        return ctx.finding(ID, "unknown", reason=f"cannot recompute with the target {target_dir}: {str(exc).splitlines()[0]}")
    num_layers = len(recomputed["raw"][0]) - 1
    if layout.kind == "speculators":
        if indices is None:
            return ctx.finding(ID, "unknown", reason="speculators cache: the layer ids are not known (diagnose the "
                               "drafter's config.json with aux_hidden_state_layer_ids, or give --config)")
        if entries == len(indices) + 1:
            indices = indices + [num_layers]
    if indices is None or len(indices) != entries:
        return ctx.finding(ID, "unknown", reason=f"the cache stores {entries} states per token but {layout.source} "
                           f"names {len(indices or [])}")
    if any(not 0 <= i <= num_layers for i in indices):
        return ctx.finding(ID, "mismatch", expected=f"HF indices within 0..{num_layers}",
                           observed=f"{layout.source} resolves to HF indices {indices}", confidence=0.9,
                           reason="a layer id lies outside the target's layers")

    names = layout.entry_names or [f"entry {k}" for k in range(entries)]
    wrong: list[str] = []
    worst = 0.0
    for entry, expected_index in enumerate(indices):
        errors: dict[tuple[str, int], float] = {}
        for k, sample in enumerate(samples):
            stored = sample.states[:, entry]  # [T, H]
            for kind in ("raw", "normed", "hf"):
                for j, state in enumerate(recomputed[kind][k]):
                    errors[(kind, j)] = max(errors.get((kind, j), 0.0), _relative_error(stored, state))
        error = errors[(layout.state, expected_index)]
        worst = max(worst, error)
        if error <= TOLERANCE:
            continue
        (kind, index), best = min(errors.items(), key=lambda item: item[1])
        expected_text = _describe(layout.state, expected_index, num_layers)
        if best > TOLERANCE:
            wrong.append(f"{names[entry]} (expected {expected_text}) matches no layer of the target "
                         f"(relative error {error:.3f}; closest: {kind} HF index {index}, {best:.3f})")
            continue
        normed, expected_normed = _is_normed(kind, index, num_layers), _is_normed(layout.state, expected_index, num_layers)
        if index == expected_index and normed:
            wrong.append(f"{names[entry]} holds final_norm({_name(index)}): a final norm applied where the raw "
                         f"residual stream belongs")
        elif index == expected_index:
            wrong.append(f"{names[entry]} holds the raw {_name(index)} where {expected_text} belongs")
        else:
            norm_note = "" if normed == expected_normed else (
                " (and through the final norm)" if normed else " (and without the final norm)")
            wrong.append(f"{names[entry]} holds {_name(index)} instead of {_name(expected_index)}: off by "
                         f"{index - expected_index:+d} layer{norm_note}")
    evidence = [Evidence(kind="checkpoint", location=sample.location,
                         value=f"{len(sample.ids)} tokens x {sample.states.shape[1]} states") for sample in samples]
    expected = (f"{', '.join(f'{n} = {_describe(layout.state, i, num_layers)}' for n, i in zip(names, indices))} "
                f"({layout.source})")
    if wrong:
        return ctx.finding(
            ID, "mismatch", expected=expected, observed="; ".join(wrong), evidence=evidence, confidence=0.95,
            reason=f"recomputed {len(samples)} sample(s) with {target_dir} ({target_source}) and compared layer by layer",
            fix=Fix(code_hint="Fix the capture's layer indexing (z-lab id i = HF hidden_states[i+1]; vLLM / "
                    "speculators id i = HF hidden_states[i]) and store raw states, then regenerate the cache.",
                    applicability="unsafe"),
        )
    return ctx.finding(
        ID, "match", expected=expected, observed=f"every entry equals its recomputed layer (max relative error "
        f"{worst:.2e} over {sum(len(sample.ids) for sample in samples)} tokens)", evidence=evidence, confidence=0.9,
        reason=f"recomputed {len(samples)} sample(s) with {target_dir} ({target_source})",
    )
