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


@dataclass
class CacheLayout:
    kind: str  # "speculators" | MANIFEST_FORMAT
    files: list[Path]
    token_key: str
    hf_indices: list[int] | None  # per stored entry: HF hidden_states index (0 = embeddings), raw (pre-norm)
    source: str  # where the layer ids came from
    target: str | None = None


def _hs_files(directory: Path) -> list[Path]:
    def index(path: Path) -> int:
        stem = path.stem[3:]
        return int(stem) if stem.isdigit() else 1 << 30

    return sorted((p for p in directory.glob("hs_*.safetensors") if p.is_file()), key=index)


def find_layout(cache: Path, config: dict[str, Any] | None) -> tuple[CacheLayout | None, str]:
    """The layout of `cache`, or (None, why not)."""
    manifest = read_json(cache / "manifest.json")
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


def recompute_states(target_dir: Path, token_ids: list[list[int]]) -> tuple[list[list[Any]], list[list[Any]]]:
    """Per sequence: the raw residual stream at every HF index 0..L (L = the last decoder layer's output
    before the final norm), and the same through the final norm (empty where the model has none).
    Imports torch/transformers here only."""
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
    try:
        with torch.no_grad():
            for ids in token_ids:
                captured.clear()
                out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
                raw = [out.hidden_states[0][0]] + [c[0] for c in captured]  # [T, H] each, HF index 0..L
                states.append(raw)
                norm = _final_norm(model)
                normed.append([norm(state) for state in raw] if norm is not None else [])
    finally:
        for hook in hooks:
            hook.remove()
    return states, normed


def _relative_error(a: Any, b: Any) -> float:
    return float((a - b).norm() / (b.norm() + 1e-12))


def _name(index: int) -> str:
    return "the embeddings (HF hidden_states[0])" if index == 0 else \
        f"decoder layer {index - 1}'s output (HF hidden_states[{index}])"


def check_hidden_state_capture(ctx: ContractContext) -> Finding:
    if ctx.hidden_states is None:
        return ctx.finding(ID, "unknown", reason="no offline hidden-state cache given (--hidden-states DIR); "
                           "a run that computes them online, as ours does, has nothing to check here")
    cache = ctx.hidden_states
    if not cache.is_dir():
        return ctx.finding(ID, "unknown", reason=f"--hidden-states {cache} is not a directory")
    layout, why = find_layout(cache, ctx.config)
    if layout is None:
        return ctx.finding(ID, "unknown", reason=why)
    target_dir, target_source = ctx.resolve_target_dir()
    if target_dir is None and layout.target and Path(layout.target).expanduser().is_dir():
        target_dir, target_source = Path(layout.target).expanduser(), "manifest.json target"
    if target_dir is None:
        return ctx.finding(ID, "unknown", reason=f"the target to recompute with is unknown: {target_source}")
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - safetensors is a dependency
        return ctx.finding(ID, "unknown", reason="safetensors is not installed")
    samples: list[tuple[Path, list[int], Any]] = []
    for path in layout.files[:SAMPLE_FILES]:
        try:
            with safe_open(str(path), framework="pt") as handle:
                ids = handle.get_tensor(layout.token_key)[:SAMPLE_TOKENS].tolist()
                states = handle.get_tensor("hidden_states")[:SAMPLE_TOKENS].float()  # [T, n, H]
        except Exception as exc:  # a torn or foreign file: say which and why
            return ctx.finding(ID, "unknown", reason=f"{path}: cannot read token ids and hidden_states ({exc})")
        if states.ndim != 3 or states.shape[0] != len(ids):
            return ctx.finding(ID, "unknown", reason=f"{path}: hidden_states {tuple(states.shape)} is not [T, n, H] "
                               f"for {len(ids)} tokens")
        samples.append((path, ids, states))
    if not samples:
        return ctx.finding(ID, "unknown", reason=f"{cache}: no hidden-state files")
    entries = samples[0][2].shape[1]
    indices = layout.hf_indices
    try:
        recomputed, recomputed_normed = recompute_states(target_dir, [ids for _, ids, _ in samples])
    except Exception as exc:  # an unloadable target is reported, not raised
        return ctx.finding(ID, "unknown", reason=f"cannot recompute with the target {target_dir}: {str(exc).splitlines()[0]}")
    num_layers = len(recomputed[0]) - 1
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

    wrong: list[str] = []
    worst = 0.0
    for entry, expected_index in enumerate(indices):
        errors: dict[tuple[str, int], float] = {}
        for (_, _, states), raw, normed in zip(samples, recomputed, recomputed_normed):
            stored = states[:, entry]  # [T, H]
            for kind, candidates in (("raw", raw), ("normed", normed)):
                for j, state in enumerate(candidates):
                    errors[(kind, j)] = max(errors.get((kind, j), 0.0), _relative_error(stored, state))
        error = errors[("raw", expected_index)]
        worst = max(worst, error)
        if error <= TOLERANCE:
            continue
        (kind, index), best = min(errors.items(), key=lambda item: item[1])
        if best > TOLERANCE:
            wrong.append(f"entry {entry} (expected {_name(expected_index)}) matches no layer of the target "
                         f"(relative error {error:.3f}; closest: {kind} HF index {index}, {best:.3f})")
        elif kind == "normed":
            wrong.append(f"entry {entry} holds final_norm({_name(index)}): a final norm applied where the raw "
                         f"residual stream belongs")
        else:
            wrong.append(f"entry {entry} holds {_name(index)} instead of {_name(expected_index)}: off by "
                         f"{index - expected_index:+d} layer")
    evidence = [Evidence(kind="checkpoint", location=str(p), value=f"{len(ids)} tokens x {states.shape[1]} states")
                for p, ids, states in samples]
    expected = f"entries = {', '.join(_name(i) for i in indices)} ({layout.source})"
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
        f"{worst:.2e} over {sum(len(ids) for _, ids, _ in samples)} tokens)", evidence=evidence, confidence=0.9,
        reason=f"recomputed {len(samples)} sample(s) with {target_dir} ({target_source})",
    )
