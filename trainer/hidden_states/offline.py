"""The target a run trains from when its hidden states come from a cache: the target's embeddings,
final norm and lm_head are real; its decoder layers are never loaded (they stay on the meta device).

`forward_packed` returns what FrozenTarget.forward_packed would have computed: the stored layers, and the
teacher logits recomputed from the stored final layer with the target's own lm_head (generation checked
that this equals the model's logits). Speculative-decoding eval needs the whole target: it is loaded the
first time an eval runs (set `eval_every: null` to train without ever loading it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from trainer.hidden_states.cache import MANIFEST, HiddenStateCache, HiddenStateError
from trainer.hidden_states.speculators_format import SpeculatorsHiddenStates, speculators_dir
from trainer.hidden_states.generate import head_logits
from trainer.target.frozen import FrozenTarget, TargetError, _find_final_norm


class OfflineTarget:
    def __init__(self, head: FrozenTarget, cache: HiddenStateCache, full_loader: Any) -> None:
        self.head = head
        self.cache = cache
        self._full_loader = full_loader
        self._full: FrozenTarget | None = None

    def __getattr__(self, name: str) -> Any:  # tokenizer, sizes, mask token, embed, logits, ... of the head
        return getattr(self.__dict__["head"], name)

    @classmethod
    def load(cls, cache_dir: str, target: str, device: torch.device, dtype: torch.dtype,
             mask_token_id: int | None = None, speculators_layer_ids: list[int] | None = None) -> OfflineTarget:
        """Our own cache (manifest.json), or a directory of speculators' hs_<i>.safetensors files."""
        directory = Path(cache_dir).expanduser()
        head = load_head_only(target, device, dtype, mask_token_id)
        cache: HiddenStateCache | SpeculatorsHiddenStates
        if not (directory / MANIFEST).exists() and speculators_dir(directory) is not None:
            cache = SpeculatorsHiddenStates.open(directory, vllm_layer_ids=speculators_layer_ids,
                                                 num_layers=head.num_layers, hidden_size=head.hidden_size)
        else:
            cache = HiddenStateCache.open(directory)
        return cls(head, cache, lambda: FrozenTarget.load(target, device, dtype, mask_token_id=mask_token_id))

    def full_target(self) -> FrozenTarget:
        if self._full is None:
            self._full = self._full_loader()
        return self._full

    @torch.no_grad()
    def forward_packed(self, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor,
                       feature_layer_ids: list[int], logits_source: str | int) -> tuple[Tensor, Tensor]:
        final = self.head.num_layers - 1
        wanted = sorted(set(feature_layer_ids) | {final} | ({logits_source} if isinstance(logits_source, int) else set()))
        stored = self.cache.gather(input_ids, position_ids, wanted, doc_ids=doc_ids)
        stored = {layer: value.to(device=self.head.device, dtype=self.head.dtype) for layer, value in stored.items()}
        if not getattr(self.cache, "final_normed", True):  # speculators/vLLM store the final layer before the norm
            if self.head.final_norm is None:
                raise TargetError("cannot find the target's final norm for the stored final layer")
            stored[final] = self.head.final_norm(stored[final])
        features = torch.cat([stored[i] for i in feature_layer_ids], dim=-1)  # [N, S, k*H]
        if logits_source == "final" or logits_source == final:
            logits = head_logits(self.head, stored[final])
        else:  # an intermediate layer through the final norm, as FrozenTarget does it
            if self.head.final_norm is None:
                raise TargetError("cannot find the target's final norm for intermediate logits")
            logits = self.head.lm_head(self.head.final_norm(stored[logits_source]))
        return features, logits


def load_head_only(target: str, device: torch.device, dtype: torch.dtype, mask_token_id: int | None) -> FrozenTarget:
    """The target with only embeddings, final norm and lm_head materialised from its weight files."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from trainer.target.embedded import BUILT_IN_TARGETS, ensure_built_in_target

    if target in BUILT_IN_TARGETS:
        path = ensure_built_in_target(target)
    else:
        path = Path(target).expanduser()
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many types; all mean "not a usable model directory"
        raise TargetError(f"cannot load the config or tokenizer of {path}: {str(exc).splitlines()[0]}") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    modules = [model.get_input_embeddings(), model.get_output_embeddings(), _find_final_norm(model)]
    qualified = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    wanted = {f"{qualified[id(module)]}.{local}": (module, local) for module in modules if module is not None
              for local, _ in module.named_parameters()}
    tensors = _read_tensors(path, set(wanted))
    tied = getattr(config, "tie_word_embeddings", False)
    for module in {id(m): m for m in modules if m is not None}.values():
        module.to_empty(device=device)
    for name, (module, local) in wanted.items():
        value = tensors.get(name)
        if value is None and tied and "lm_head" in name:
            continue  # tied: it is the embedding matrix, loaded under its own name
        if value is None:
            raise HiddenStateError(f"{path}'s weight files have no tensor {name!r}; offline training needs the "
                                   "target's embeddings, final norm and lm_head under their module names")
        getattr(module, local).data.copy_(value.to(dtype))
    if tied:
        model.tie_weights()
    model.eval()
    model.requires_grad_(False)
    from trainer.target.frozen import fingerprint_model_dir

    return FrozenTarget(model, tokenizer, path, fingerprint_model_dir(path), mask_token_id)


def _read_tensors(path: Path, names: set[str]) -> dict[str, Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {weight_map[n] for n in names if n in weight_map}
    else:
        files = {p.name for p in path.glob("*.safetensors")}
    out: dict[str, Tensor] = {}
    for file in sorted(files):
        with safe_open(str(path / file), framework="pt") as handle:
            for name in names & set(handle.keys()):
                out[name] = handle.get_tensor(name)
    return out


__all__ = ["OfflineTarget", "load_head_only"]
