"""The probe protocol over vllm-project/speculators' DFlash model (`speculators.models.dflash`).

The worker has put the diagnosed copy's import root first on sys.path; this adapter refuses to run if
`speculators` came from anywhere else. It drives speculators the way `speculators train` does, through its
own code at every step that decides an invariant:
  * the run's configuration: `TrainConfig.from_sources` over the run's `run.yaml` (`--config`), or over
    nothing (speculators' own defaults for `--speculator-type dflash`: block 16, D-PACE, CE, Muon ...);
    `describe()["configured"]` says where each value came from;
  * the drafter: `train.cli.build_draft_model` against a synthetic verifier written to disk
    (`adapters/synthetic.py`): speculators' `resolve_target_layer_ids` picks the layer ids for that
    verifier's depth, `resolve_mask_token_id` the mask token from its tokenizer, `load_verifier_weights`
    the embeddings / lm_head / final norm;
  * the step: `model(...)` with `DFlashDraftModel.get_trainer_kwargs(**flat config)`, and
    `train.optimizers.build_optimizers` for the optimizer step.
Replaced, and said so: the anchor sampler during the experiments (by the probe's anchors; the sampler
itself is probed through `sample_anchors`, the forward's own call site), and flex attention by SDPA on
CPU (the same mask_mod evaluated densely). Layer *extraction* is not speculators' code: its hidden states
arrive selected by vLLM (id i = hidden_states[i]), so the adapter selects them and only the id rule is probed.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from sleuth.probes.adapters.synthetic import write_target_dir

DEFAULT_TARGET_LAYERS = 8
# Keys of the run config whose value decides an invariant, by speculators' flat name.
_DEFAULT_WHERE = "speculators default (train/config/schema.py TrainConfig for --speculator-type dflash)"


# Without a run config, the probes also take speculators' other paths: fixed-exponential weighting (with the
# default gamma), the KL loss, a full-attention layer beside non-causal sliding layers, and one beside causal
# sliding layers (the defaults are D-PACE, CE, sliding layers only, causal within the block): which mask a
# layer is given only shows where the two kinds of layer differ in what they let through.
# Settings other than the defaults, so a value that never reaches the code shows (gamma 7, alpha 0.3, explicit
# layer ids).
VARIANTS = {
    "speculators' fixed-exp-decay weighting with gamma 7, KL loss, explicit layer ids, a full-attention layer "
    "and non-causal sliding layers": {"train": {
        "draft": {"full_attention_indices": [0], "sliding_window_non_causal": True, "target_layer_ids": [1, 3, 6]},
        "loss": {"loss_fn": "kl_div"},
        "dflash": {"per_position_loss_weight": "fixed-exp-decay", "dflash_decay_gamma": 7.0}}},
    "speculators' D-PACE with alpha 0.3 and a full-attention layer beside causal sliding layers": {"train": {
        "draft": {"full_attention_indices": [0]}, "dflash": {"dpace_alpha": 0.3}}},
}


class SpeculatorsSubject:
    def __init__(self, package_dir: str, context: dict[str, Any], origin: str | None = None) -> None:
        import speculators
        from speculators.models.dflash import core
        from speculators.models.dflash.core import DFlashDraftModel

        where = Path(speculators.__file__).resolve().parent
        if where != Path(package_dir).resolve():
            raise ImportError(f"speculators was imported from {where}, not from the diagnosed {package_dir}")
        self.core, self.model_class = core, DFlashDraftModel
        self.scratch = Path(tempfile.mkdtemp(prefix="sleuth-speculators-"))
        self.verifier = self.scratch / "verifier"
        self.package_dir, self.has_run_config = package_dir, bool(context.get("config"))
        self.flat, self.sources = _resolve_train_config(context.get("config") or {}, self.verifier, self.scratch)
        if origin is not None:  # a variant's settings are the probe's choice, not the run's
            self.sources = {k: f"probe choice ({origin})" for k in self.sources}
        self.block_size = int(self.flat["block_size"])
        ids = self.flat.get("target_layer_ids")
        self.num_target_layers = max(DEFAULT_TARGET_LAYERS, max(ids) + 3) if ids else DEFAULT_TARGET_LAYERS
        self.call_kwargs, _ = DFlashDraftModel.get_trainer_kwargs(
            **{**self.flat, "loss_implementation": "eager"})  # the fused kernels need Triton (a GPU)

    def variants(self) -> dict[str, Any]:
        """The code's other paths: its defaults (when a run config chose others) and the settings above."""
        found = {label: SpeculatorsSubject(self.package_dir, {"config": config}, origin=label)
                 for label, config in VARIANTS.items()}
        if self.has_run_config:
            found = {"speculators' defaults": SpeculatorsSubject(self.package_dir, {}, origin="speculators' defaults"),
                     **found}
        return found

    def _source(self, dest: str) -> str:
        return self.sources.get(dest, _DEFAULT_WHERE)

    def describe(self) -> dict[str, Any]:
        kwargs, flat = self.call_kwargs, self.flat
        weighting = {"dpace": "dpace", "fixed-exp-decay": "fixed-exp"}.get(kwargs["per_position_loss_weight"],
                                                                       kwargs["per_position_loss_weight"])
        configured: dict[str, dict[str, Any]] = {
            "weighting": {"value": weighting, "source": self._source("per_position_loss_weight")},
            "gamma": {"value": kwargs["gamma"], "source": self._source("dflash_decay_gamma")},
            "dpace_alpha": {"value": kwargs["dpace_alpha"], "source": self._source("dpace_alpha")},
            "loss": {"value": flat["loss_fn"], "source": self._source("loss_fn")},
            "block_size": {"value": self.block_size, "source": self._source("block_size")},
        }
        if flat.get("target_layer_ids"):
            configured["target_layer_ids"] = {"value": flat["target_layer_ids"], "source": self._source("target_layer_ids")}
        info = {
            "name": "speculators DFlashDraftModel",
            "protocol": 1,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "layer_id_convention": "external",
            "max_rows": 1,  # its forward takes one packed row of documents
            "configured": configured,
            "anchor_exclusions": ["last B positions"],  # models/dflash/utils.py select_anchors
            "anchor_sampler_source": "speculators select_anchors, called where _build_attention_mask calls it",
            "layer_ids_source": ("the run config's target_layer_ids" if flat.get("target_layer_ids") else
                                 "speculators resolve_target_layer_ids for the verifier's depth (models/utils.py)"),
            "mask_token_source": "speculators resolve_mask_token_id from the verifier's tokenizer (train/utils.py)",
            "features_source": "speculators ArrowDataset (the cached hidden states read) and CollateFn (packing)",
            "notes": [f"trainer call kwargs: loss {flat['loss_fn']} (eager), weighting {kwargs['per_position_loss_weight']}, "
                      f"gamma {kwargs['gamma']}, block {self.block_size}; attention SDPA over speculators' mask_mod "
                      "(flex attention needs compilation); optimizer " + str(flat.get("optimizer"))],
        }
        if hasattr(self, "model"):
            info["layer_ids"] = list(self.model.target_layer_ids)
            sliding = self.model.sliding_window_indices
            info["layer_types"] = ["sliding_attention" if i in sliding else "full_attention"
                                   for i in range(len(self.model.layers))]
            # DFLASH.md dflash.block_bidirectional: [S] sliding-window layers are causal within the block
            # unless sliding_window_non_causal (off by default for DFlash)
            info["sliding_causal_within_block"] = not self.model.sliding_window_non_causal
        return info

    def build(self, target: Any) -> None:
        from speculators.train.cli import build_draft_model

        self.target = target
        write_target_dir(target, self.verifier)
        args = argparse.Namespace(**{**self.flat, "verifier_name_or_path": str(self.verifier),
                                     "draft_attn_impl": "sdpa", "from_pretrained": None, "draft_config": None})
        self.model = build_draft_model(args, self.model_class, None, None, target.vocab_size).float()
        self.layer_ids = list(self.model.target_layer_ids)
        self._masks: dict[tuple, Any] = {}

    def feature_projection(self) -> nn.Module:
        return self.model.fc

    def layer_ids_for(self, num_target_layers: int, count: int | None = None) -> list[int]:
        """speculators' own rule for a verifier of that depth (a config.json is all it reads; it always
        picks three, whatever `count`)."""
        from speculators.models.utils import resolve_target_layer_ids

        where = self.scratch / f"verifier-{num_target_layers}"
        if not (where / "config.json").is_file():
            write_target_dir(self.target, where, num_layers=num_target_layers)
        return list(resolve_target_layer_ids(self.flat.get("target_layer_ids"), str(where)))

    def parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())

    def draft_layers(self) -> list[nn.Module]:
        return list(self.model.layers)

    def rotary(self) -> nn.Module | None:
        return self.model.rotary_emb

    @contextlib.contextmanager
    def _wired(self, batch: Any, hooks: Any) -> Iterator[list[Tensor]]:
        anchors, valid = batch.anchors[0].clone(), batch.anchor_valid[0].clone()

        def given_anchors(loss_mask: Tensor, num_anchors: int, block_size: int) -> tuple[Tensor, Tensor]:
            return anchors.clone(), valid.clone()

        drafted: list[Tensor] = []

        def on_logits(_module: nn.Module, _args: Any, output: Tensor) -> Tensor:
            out = hooks.draft_logits(output)
            drafted.append(out)
            return out

        handles = [self.model.embed_tokens.register_forward_hook(lambda _m, _a, out: hooks.block_embeddings(out)),
                   self.model.lm_head.register_forward_hook(on_logits)]
        original = self.core.select_anchors
        self.core.select_anchors = given_anchors
        self.model._create_attention_mask = self._memoized_mask
        try:
            yield drafted
        finally:
            self.core.select_anchors = original
            del self.model._create_attention_mask
            for handle in handles:
                handle.remove()

    def _memoized_mask(self, document_ids: Tensor, total_seq_len: int, anchor_positions: Tensor, device: Any,
                       sliding_window: int | None = None, sliding_window_non_causal: bool = False) -> Any:
        """speculators' own mask, computed once per distinct arguments: the experiments rerun the forward with
        the same anchors and documents dozens of times, and evaluating the mask_mod densely is the slow part."""
        key = (document_ids.cpu().numpy().tobytes(), total_seq_len, anchor_positions.cpu().numpy().tobytes(),
               sliding_window, sliding_window_non_causal)
        if key not in self._masks:
            self._masks[key] = type(self.model)._create_attention_mask(
                self.model, document_ids, total_seq_len, anchor_positions, device, sliding_window=sliding_window,
                sliding_window_non_causal=sliding_window_non_causal)
        return self._masks[key]

    def _through_data_path(self, batch: Any) -> dict[str, Tensor]:
        """The row as speculators' training gets it: each document stored as vLLM hands it over (the selected
        layers, id i = hidden_states[i], then the final layer before its norm: [seq, k+1, H]), read by its
        dataset (`ArrowDataset._get_raw_data`, `BaseDataset.__getitem__`) and packed by its `CollateFn`
        (document ids, positions restarting per document)."""
        from speculators.train.data import ArrowDataset, CollateFn

        stack = torch.stack([batch.hidden_states[i][0] for i in self.layer_ids] + [batch.last_hidden[0]], dim=1)
        docs = batch.doc_ids[0]
        spans, start = [], 0
        for p in range(1, docs.numel() + 1):
            if p == docs.numel() or docs[p] != docs[start]:
                if docs[start] >= 0:
                    spans.append((start, p))
                start = p
        stored = [{"hidden_states": stack[a:b], "token_ids": batch.input_ids[0, a:b]} for a, b in spans]
        dataset = ArrowDataset.__new__(ArrowDataset)  # the reading, without the files it would read from
        dataset.transfer = SimpleNamespace(get_cached=lambda index: stored[index])
        dataset.data = [{"input_ids": batch.input_ids[0, a:b], "loss_mask": batch.loss_mask[0, a:b]} for a, b in spans]
        dataset._map_to_file_idx = lambda index: index
        dataset.on_missing = "raise"
        collate = CollateFn(max_len=batch.input_ids.shape[1], hidden_size=stack.shape[-1],
                            num_target_layers=len(self.layer_ids), dtype=stack.dtype)
        return collate([dataset[i] for i in range(len(spans))])

    def _forward(self, batch: Any, hooks: Any) -> tuple[Tensor, list[Tensor]]:
        if batch.input_ids.shape[0] != 1:
            raise ValueError("speculators' DFlash forward takes one packed row")
        kwargs = {**self.call_kwargs, "max_anchors": int(batch.anchors.shape[1])}
        fed = self._through_data_path(batch)
        with self._wired(batch, hooks) as drafted:
            _, loss, _metrics = self.model(
                hidden_states=fed["hidden_states"],
                input_ids=fed["input_ids"],
                loss_mask=fed["loss_mask"],
                verifier_last_hidden_states=fed["verifier_last_hidden_states"],
                document_ids=fed["document_ids"],
                position_ids=fed["position_ids"],
                **kwargs,
            )
        return loss, drafted

    def draft_logits(self, batch: Any, hooks: Any) -> Tensor:
        self.model.eval()
        _loss, drafted = self._forward(batch, hooks)
        return drafted[0].reshape(1, batch.anchors.shape[1], self.block_size, -1)

    def loss(self, batch: Any, hooks: Any) -> Tensor:
        self.model.train()
        loss, _drafted = self._forward(batch, hooks)
        return loss

    def sample_anchors(self, batch: Any, num_anchors: int) -> tuple[Tensor, Tensor]:
        """speculators' sampler where its forward calls it (`_build_attention_mask`), on the batch's mask."""
        fed = self._through_data_path(batch)
        _full, _sliding, anchors, valid = self.model._build_attention_mask(
            fed["loss_mask"], num_anchors, fed["document_ids"], batch.loss_mask.device)
        return anchors.reshape(1, -1), valid.reshape(1, -1)

    def train_step(self, batch: Any) -> None:
        from speculators.train.optimizers import build_optimizers

        keys = ("optimizer", "lr", "weight_decay", "muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns_steps",
                "muon_adjust_lr_fn")
        optimizers = build_optimizers(self.model, SimpleNamespace(**{k: self.flat.get(k) for k in keys}))
        identity = SimpleNamespace(block_embeddings=lambda x: x, draft_logits=lambda x: x)
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.loss(batch, identity).backward()
        for optimizer in optimizers:
            optimizer.step()


def _resolve_train_config(config: dict[str, Any], verifier: Path, scratch: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """speculators' flat training config for the run (its own resolution), and where each run value came from."""
    import yaml
    from speculators.train.config.schema import CONFIG_DESTS, TrainConfig

    cli: dict[str, Any] = {"speculator_type": "dflash", "verifier_name_or_path": str(verifier),
                           "data_path": str(scratch / "data")}
    config_path = None
    given: dict[str, str] = {}
    stage = config.get("train") if isinstance(config.get("train"), dict) else None
    if stage is not None:  # a run.yaml: the `train:` stage with its groups
        config_path = scratch / "run.yaml"
        config_path.write_text(yaml.safe_dump({"train": stage}))
        for group, values in stage.items():
            for dest in values if isinstance(values, dict) else {group: values}:
                given[dest] = f"run config train.{group}.{dest}" if isinstance(values, dict) else f"run config train.{dest}"
    else:  # flat keys, as `vars(args)` names them
        for dest, value in config.items():
            if dest in CONFIG_DESTS and dest not in cli:
                cli[dest] = value
                given[dest] = f"run config {dest}"
    cfg = TrainConfig.from_sources(cli=cli, config_path=str(config_path) if config_path else None, argv=[])
    if cfg.speculator_type != "dflash":
        raise ValueError(f"the run config trains {cfg.speculator_type!r}; the speculators adapter probes dflash")
    flat = cfg.flatten()
    sources = {dest: given[dest] for dest, layer in cfg.provenance.items() if layer != "default" and dest in given}
    return flat, sources
