"""The probe protocol over sgl-project/SpecForge's DFlash draft model and its training wrapper.

Builds the drafter the way SpecForge's composition root does, through its own code at every step that
decides an invariant:
  * the run's configuration: SpecForge's `Config` over the run's recipe (`--config`, SpecForge's recipe
    YAML: `training.loss_decay_gamma`, `training.loss_type`, `model.draft_model_config`, ...), or over
    nothing (SpecForge's own defaults for `training.strategy: dflash`); `describe()["configured"]` says
    where each value came from;
  * the draft config: the recipe's draft config, shrunk to the probe's sizes (block size, layers, layer
    types and target layer ids kept), or, without one, SpecForge's `resolve_draft_config`, which generates
    it from the target (`build_target_layer_ids` for the target's depth);
  * the drafter and the training model: the dflash registration's `build_draft` and
    `build_training_model` (`OnlineDFlashModel`, `TargetEmbeddingsAndHead` loaded from a synthetic target
    directory, `resolve_mask_token_id` over its tokenizer);
  * the optimizer step: AdamW over the parameters that require grad (SpecForge's BF16Optimizer).
Replaced, and said so: the anchor sampler during the experiments (the probe's anchors; the sampler itself
is probed through `sample_anchors`), flex attention by SDPA on CPU, chunked objective evaluation by one
piece (recomputation would call lm_head again behind the probe's hook). That the run's chunked objective
(`training.objective_chunk_blocks`, checkpointed slices) gives the same loss and gradients as the one piece
is checked on its own, without hooks (`path_checks`), as is that the layers SpecForge captures for offline
and server training (`resolve_capture_layers`) are the layers the drafter reads.
SpecForge's forward takes no document ids or positions (its collator pads one sample per row), so the
probe runs it on one document per row, and the verdicts that depend on packing say so.
When no recipe gamma is given, SpecForge's default is no decay: the probe then also sets a gamma of its
own, so the decay path is exercised, and says that the run's value is the config's.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from sleuth.probes.adapters.synthetic import owned_scratch, write_target_dir
from sleuth.probes.verdict import Verdict, guarded

DEFAULT_TARGET_LAYERS = 8
PROBE_GAMMA = 4.0  # set when the run gives none, so SpecForge's decay path runs (its default is no decay)
# Fields of a run's draft config that decide DFlash behaviour; the sizes come from the probe's target.
_DRAFT_KEEP = ("architectures", "model_type", "auto_map", "block_size", "num_hidden_layers", "layer_types",
               "num_target_layers", "sliding_window", "use_sliding_window", "max_window_layers")


# Without a recipe, the probes also take SpecForge's other paths: the D-PACE loss, and a drafter of three
# layers, whose target layer ids its override path computes with build_target_layer_ids (the default
# generated drafter has one layer, which reads [L // 2]).
VARIANT = ("SpecForge's D-PACE loss (alpha 0.3), a 3-layer drafter (model.draft_num_hidden_layers) and the SDPA "
           "mask builder", {"model": {"draft_num_hidden_layers": 3},
                            "training": {"loss_type": "dpace", "dpace_alpha": 0.3, "attention_backend": "sdpa"}})
# The exported-draft check's drafter: a block size other than the default 16 (DFlash2 recipes use 8) and a YaRN
# rope (long-context drafters), so a value read from the wrong place or dropped on export shows.
EXPORT_BLOCK = 8
EXPORT_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
TAIL = 5  # positions each stored sample has beyond max_len, so the offline normaliser's truncation runs
# The chunked objective against the one piece: chunk sizes tried besides the run's own (several chunks on the
# probe's batch), and the agreement asked for (float32 sums in another order differ at rounding level only).
CHUNK_SIZES = (1, 2)
CHUNK_LOSS_RTOL, CHUNK_GRAD_RTOL = 1e-5, 1e-4
DOMINO_HEAD = 16  # the reported-acceptance check's Domino GRU head widths (its logits are replaced by designed ones)
DOMINO_CHUNK = 2  # blocks per objective chunk there
SCHEDULE_STEPS = 400  # steps the optimizer's schedule is built for and read over (warmup 6 at the default ratio)


@contextlib.contextmanager
def _flex_masks_dense() -> Iterator[None]:
    """SpecForge's flex mask builder, its mask_mod evaluated on every (query, key) pair instead of compiled into
    a BlockMask (flex attention needs compilation; the dense mask is what SDPA takes on CPU)."""
    from torch.nn.attention.flex_attention import create_mask

    from specforge.algorithms.common import dflash_family_model as family

    original = family.create_block_mask
    family.create_block_mask = lambda mod, B, H, Q_LEN, KV_LEN, device: create_mask(mod, B, H, Q_LEN, KV_LEN, device)
    try:
        yield
    finally:
        family.create_block_mask = original


class SpecForgeSubject:
    def __init__(self, package_dir: str, context: dict[str, Any], origin: str | None = None) -> None:
        import specforge

        where = Path(specforge.__file__).resolve().parent
        if where != Path(package_dir).resolve():
            raise ImportError(f"specforge was imported from {where}, not from the diagnosed {package_dir}")
        self.scratch = owned_scratch(self, "sleuth-specforge-")
        self.target_dir = self.scratch / "target"
        config = context.get("config") or {}
        self.recipe = config if isinstance(config.get("training"), dict) or isinstance(config.get("model"), dict) else {}
        self.notes: list[str] = []
        if config and not self.recipe:
            self.notes.append("the run config is not a SpecForge recipe (no `training:` / `model:`): SpecForge's "
                              "defaults were probed")
        self.config_path = Path(context["config_path"]) if context.get("config_path") else None
        self.handed = context  # sleuth reads the files the recipe names and hands them over (runner._recipe_files)
        self.package_dir, self.origin, self.has_run_config = package_dir, origin, bool(config)
        self.run_draft = self._run_draft_config()
        self.cfg_training = self._training_config()
        self.num_target_layers = int(self.run_draft.get("num_target_layers") or DEFAULT_TARGET_LAYERS) \
            if self.run_draft else DEFAULT_TARGET_LAYERS
        self.block_size = int((self.recipe.get("model") or {}).get("draft_block_size")
                              or (self.run_draft or {}).get("block_size") or 16)

    # --- the run's configuration ---------------------------------------------------------------------------

    def _run_draft_config(self) -> dict[str, Any] | None:
        name = (self.recipe.get("model") or {}).get("draft_model_config")
        if not name:
            return None
        if isinstance(self.handed.get("draft_config"), dict):
            return dict(self.handed["draft_config"])
        if self.handed.get("draft_config_problem"):
            raise FileNotFoundError(str(self.handed["draft_config_problem"]))
        candidates = [Path(name)]
        if self.config_path is not None:
            candidates.insert(0, self.config_path.parent / name)
        for path in candidates:
            if path.is_file():
                return json.loads(path.read_text())
        raise FileNotFoundError(f"the recipe's model.draft_model_config {name} was not found next to the recipe "
                                f"({self.config_path or 'its location was not given'})")

    def _training_config(self) -> Any:
        from specforge.config.schema import TrainingConfig

        training = {**(self.recipe.get("training") or {}), "strategy": "dflash"}
        return TrainingConfig.model_validate(training)

    def variants(self) -> dict[str, Any]:
        """The code's other paths: its defaults (when a recipe chose others) and the settings above."""
        label, config = VARIANT
        found = {label: SpecForgeSubject(self.package_dir, {"config": config}, origin=label)}
        if self.has_run_config and not self.origin:
            found = {"SpecForge's defaults": SpecForgeSubject(self.package_dir, {}, origin="SpecForge's defaults"),
                     **found}
        return found

    def _source(self, key: str) -> str:
        if key in (self.recipe.get("training") or {}):
            return f"probe choice ({self.origin})" if self.origin else f"run config training.{key}"
        if self.origin and key in (self.recipe.get("model") or {}):
            return f"probe choice ({self.origin})"
        return f"SpecForge default (config/schema.py TrainingConfig.{key})"

    def describe(self) -> dict[str, Any]:
        training = self.cfg_training
        gamma = training.loss_decay_gamma
        configured: dict[str, dict[str, Any]] = {"loss": {"value": "ce", "source": "SpecForge's objective (CE on data tokens)"}}
        if training.loss_type == "dflash":
            if gamma is not None and gamma > 0:
                configured["weighting"] = {"value": "fixed-exp", "source": self._source("loss_decay_gamma")}
                configured["gamma"] = {"value": float(gamma), "source": self._source("loss_decay_gamma")}
            else:
                configured["weighting"] = {"value": "fixed-exp", "source": "probe choice: SpecForge's default is no decay"}
                configured["gamma"] = {"value": PROBE_GAMMA, "source": "probe choice: SpecForge's default is no decay"}
                configured["default_weighting"] = {"value": "no decay (loss_decay_gamma None)",
                                                   "source": self._source("loss_decay_gamma")}
        elif training.loss_type == "dpace":
            configured["weighting"] = {"value": "dpace", "source": self._source("loss_type")}
            configured["dpace_alpha"] = {"value": training.dpace_alpha, "source": self._source("dpace_alpha")}
        else:
            configured["weighting"] = {"value": training.loss_type, "source": self._source("loss_type")}
        ids_from = "SpecForge build_target_layer_ids for the target's depth (generated draft config)"
        if self.run_draft and (self.run_draft.get("dflash_config") or {}).get("target_layer_ids"):
            ids = list(self.run_draft["dflash_config"]["target_layer_ids"])
            where = self.handed.get("draft_config_from") or "the recipe's draft config"
            configured["target_layer_ids"] = {"value": ids, "source": f"run config (draft config {where})"}
            ids_from = f"the recipe's draft config dflash_config.target_layer_ids ({where})"
        info = {
            "name": "SpecForge OnlineDFlashModel",
            "protocol": 1,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "layer_id_convention": "zlab",
            "documents_per_row": 1,
            # loss_type dflash: dflash_family_model.py returns loss_terms (sum of weighted NLL, sum of the weights),
            # its trainer normalises the gradients by the denominators' total, and SpecForge's tests check the loss
            # against a naive weighted mean (gamma None and 7). Its D-PACE loss divides by the batch size instead.
            "loss_reduction": {"dflash": "weighted_mean", "dpace": "batch_mean"}.get(training.loss_type),
            "configured": configured,
            "anchor_exclusions": ["next token unsupervised"],  # dflash_family_model.py _sample_anchor_positions
            "anchor_sampler_source": "SpecForge OnlineDFlashModel._sample_anchor_positions",
            "layer_ids_source": ids_from,
            "mask_token_source": "SpecForge resolve_mask_token_id over the target's tokenizer (training/model_utils.py)",
            "features_source": "SpecForge extract_context_feature, normalize_offline_sample and its collator",
            "attention_backend": f"{training.attention_backend} mask builder, SDPA attention (flex mask_mod "
                                 "evaluated densely)",
            "notes": [*self.notes, f"loss_type {training.loss_type}, loss_decay_gamma {gamma}, block {self.block_size}; "
                      "attention SDPA (flex attention needs compilation)"],
        }
        if hasattr(self, "model"):
            info["layer_ids"] = list(self.model.draft_model.target_layer_ids)
            info["layer_types"] = list(self.model.draft_model.layer_types)
            # dflash_family_model.py: sliding layers see the earlier slots of their block only
            info["sliding_causal_within_block"] = True
        return info

    def _specforge_config(self) -> Any:
        from specforge.config import Config

        recipe = copy.deepcopy(self.recipe)
        model = dict(recipe.get("model") or {})
        model.update(target_model_path=str(self.target_dir), draft_checkpoint_path=None, torch_dtype="float32",
                     draft_model_config=str(self.scratch / "draft.json") if self.run_draft else None)
        model.pop("mask_token_id", None)  # the run's mask id belongs to its real vocabulary; the probe's has its own
        training = dict(recipe.get("training") or {})
        training.update(strategy="dflash", attention_backend="sdpa", objective_chunk_blocks=0)
        if self.cfg_training.loss_type == "dflash" and not (self.cfg_training.loss_decay_gamma or 0) > 0:
            training["loss_decay_gamma"] = PROBE_GAMMA
        recipe.update(model=model, training=training)
        recipe.setdefault("data", {"hidden_states_path": str(self.scratch / "features")})
        return Config.model_validate(recipe)

    def _write_draft_config(self, target: Any) -> None:
        assert self.run_draft is not None
        payload = {k: v for k, v in self.run_draft.items() if k in _DRAFT_KEEP}
        payload.update(target.config_kwargs(int(self.run_draft.get("num_hidden_layers") or 1)))
        payload["dflash_config"] = {k: v for k, v in (self.run_draft.get("dflash_config") or {}).items()
                                    if k != "mask_token_id"}
        payload.setdefault("layer_types", ["full_attention"] * payload["num_hidden_layers"])
        (self.scratch / "draft.json").write_text(json.dumps(payload))

    # --- building ------------------------------------------------------------------------------------------

    def build(self, target: Any) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from specforge.algorithms.builtin import builtin_algorithm_registry
        from specforge.training.model_loading import resolve_draft_config

        self.target = target
        # The recipe's embedding_key / lm_head_key name tensors of its real target (a Qwen3.6 target keeps its
        # embedding under model.language_model.): the probe's target holds them under those names too, so
        # SpecForge loads them by the recipe's keys, as the run does.
        model = self.recipe.get("model") or {}
        keys = tuple(k for k in (model.get("embedding_key"), model.get("lm_head_key")) if isinstance(k, str) and k)
        write_target_dir(target, self.target_dir, checkpoint_keys=keys)
        renamed = [k for k in keys if k not in ("model.embed_tokens.weight", "lm_head.weight")]
        if renamed:
            self.notes.append(f"the probe's target checkpoint also holds its tensors under the recipe's keys {renamed}")
        if self.run_draft is not None:
            self._write_draft_config(target)
        cfg = self._specforge_config()
        providers = builtin_algorithm_registry().resolve("dflash").providers.model
        draft_config = resolve_draft_config(cfg, provider=providers.draft_config)
        draft = providers.build_draft(cfg, draft_config).float()
        tokenizer = AutoTokenizer.from_pretrained(str(self.target_dir))
        parts = providers.build_training_model(cfg, draft, draft_config, AutoConfig.from_pretrained(str(self.target_dir)),
                                               tokenizer)
        self.model = parts.model.float()
        self.block_size = int(self.model.block_size)
        # kept for path_checks: the capture-layer rule is called with what the run's composition root passes
        self.cfg, self.draft_config, self.providers = cfg, draft_config, providers
        self.target_config = AutoConfig.from_pretrained(str(self.target_dir))
        # The run's mask builder (flex_attention by default) with SDPA attention: its flex mask_mod is evaluated
        # densely (create_mask, as speculators' SDPA path does), since flex attention needs compilation.
        self.model.attention_backend = self.cfg_training.attention_backend
        if self.model.attention_backend not in ("flex_attention", "sdpa"):
            self.model.attention_backend = "sdpa"

    def layer_ids_for(self, num_target_layers: int, count: int | None = None) -> list[int]:
        """SpecForge's own rule for that depth, for `count` draft layers (default: this drafter's)."""
        from specforge.modeling.draft.dflash import build_target_layer_ids

        return list(build_target_layer_ids(num_target_layers, count or len(self.model.draft_model.layers)))

    def feature_projection(self) -> nn.Module:
        return self.model.draft_model.fc

    def parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())

    def draft_layers(self) -> list[nn.Module]:
        return list(self.model.draft_model.layers)

    def rotary(self) -> nn.Module | None:
        return self.model.draft_model.rotary_emb

    @contextlib.contextmanager
    def _wired(self, batch: Any, hooks: Any) -> Iterator[list[Tensor]]:
        anchors, valid = batch.anchors.clone(), batch.anchor_valid.clone()
        self.model.num_anchors = int(anchors.shape[1])
        self.model._sample_anchor_positions = lambda seq_len, loss_mask, device: (anchors.clone(), valid.clone())
        drafted: list[Tensor] = []

        def on_logits(_module: nn.Module, _args: Any, output: Tensor) -> Tensor:
            out = hooks.draft_logits(output)
            drafted.append(out)
            return out

        handles = [self.model.embed_tokens.register_forward_hook(lambda _m, _a, out: hooks.block_embeddings(out)),
                   self.model.lm_head.register_forward_hook(on_logits)]
        try:
            with _flex_masks_dense():
                yield drafted
        finally:
            del self.model._sample_anchor_positions
            for handle in handles:
                handle.remove()

    def _through_data_path(self, batch: Any, layer_ids: list[int] | None = None) -> dict[str, Tensor]:
        """The rows as SpecForge's training gets them: the selected layers (its extract_context_feature; the
        drafter's own ids unless `layer_ids` names another drafter's), each
        row stored as an offline sample a few positions longer than max_len, its offline normaliser
        (normalize_offline_sample) and its collator (zero padding)."""
        from specforge.algorithms.common.dflash_family_data import build_collator, normalize_offline_sample
        from specforge.modeling.draft.dflash import extract_context_feature

        ids = layer_ids if layer_ids is not None else list(self.model.draft_model.target_layer_ids)
        features = extract_context_feature(list(batch.hidden_states), ids)
        g = torch.Generator().manual_seed(11)
        samples = []
        for row in range(batch.input_ids.shape[0]):
            length = int((batch.doc_ids[row] >= 0).sum())
            raw = {"input_ids": torch.cat([batch.input_ids[row, :length], torch.randint(1, 60, (TAIL,), generator=g)]),
                   "loss_mask": torch.cat([batch.loss_mask[row, :length], torch.ones(TAIL, dtype=batch.loss_mask.dtype)]),
                   "hidden_states": torch.cat([features[row, :length],
                                               torch.randn(TAIL, features.shape[-1], generator=g).to(features.dtype)])}
            samples.append(normalize_offline_sample(raw, max_len=length))
        collated = build_collator()(samples)
        width = batch.input_ids.shape[1]
        if collated["input_ids"].shape[1] != width:  # rows all padded: the collator pads to the longest only
            pad = width - collated["input_ids"].shape[1]
            collated = {k: torch.nn.functional.pad(v, (0, 0, 0, pad) if v.dim() == 3 else (0, pad)) for k, v in collated.items()}
        return collated

    def _forward(self, batch: Any, hooks: Any) -> tuple[Tensor, list[Tensor]]:
        fed = self._through_data_path(batch)
        with self._wired(batch, hooks) as drafted:
            loss, _accuracy, _metrics = self.model(input_ids=fed["input_ids"], hidden_states=fed["hidden_states"],
                                                   loss_mask=fed["loss_mask"])
        return loss, drafted

    def draft_logits(self, batch: Any, hooks: Any) -> Tensor:
        self.model.eval()
        _loss, drafted = self._forward(batch, hooks)
        return torch.cat(drafted, dim=1).reshape(batch.anchors.shape[0], batch.anchors.shape[1], self.block_size, -1)

    def loss(self, batch: Any, hooks: Any) -> Tensor:
        self.model.train()
        loss, _drafted = self._forward(batch, hooks)
        return loss

    def sample_anchors(self, batch: Any, num_anchors: int) -> tuple[Tensor, Tensor]:
        """SpecForge's sampler, as its forward calls it, on the batch's loss mask (through its data path)."""
        self.model.num_anchors = num_anchors
        mask = self._through_data_path(batch)["loss_mask"]
        return self.model._sample_anchor_positions(mask.shape[1], mask, mask.device)

    def train_step(self, batch: Any) -> None:
        # SpecForge's BF16Optimizer is AdamW over the parameters that require grad (specforge/optimizer.py).
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-3)
        optimizer.zero_grad()
        self.loss(batch, SimpleNamespace(block_embeddings=lambda x: x, draft_logits=lambda x: x)).backward()
        optimizer.step()

    # --- the run's paths the experiments do not take ------------------------------------------------------

    def path_checks(self, lab: Any) -> list[Verdict]:
        """Verdicts on code the run takes that the experiments bypass: the chunked objective (the experiments
        run it in one piece), the capture-layer rule of offline / server training (the experiments select the
        layers with extract_context_feature over the drafter's own ids), the flex mask builder, a block at the
        row's end (its labels and positions) and the trainer's gradient accumulation across micro-batches."""
        checks = [(self._chunked_objective, "dflash.loss_kind", "objective-chunking"),
                  (self._capture_layers, "dflash.target_layer_ids", "capture-layers"),
                  (self._mask_builders, "dflash.context_excludes_anchor", "mask-builders"),
                  (self._row_end, ("dflash.target_shift", "dflash.block_position_ids"), "row-end-block"),
                  (self._accumulation, "dflash.loss_kind", "gradient-accumulation"),
                  (self._saved_mask_token, ("dflash.mask_token_distinct", "dflash.export_contract"), "saved-mask-token"),
                  (self._exported_draft, ("dflash.block_position_ids", "dflash.rope_served_as_trained"),
                   "exported-draft"),
                  (self._optimizer_steps, "dflash.optimizer_schedule", "optimizer-steps"),
                  (self._supervised_spans, "dflash.chat_template_consistency", "supervised-spans"),
                  (self._reported_acceptance, "dflash.train_serve_gap", "reported-acceptance")]
        return [verdict for check, invariants, name in checks for verdict in guarded(check, lab, invariants, name)]

    def _reported_acceptance(self, lab: Any) -> Verdict:
        """The `accept_len` SpecForge's Domino forward reports (`OnlineDominoModel.forward`, its chunk terms and
        `compute_accept_len`, all as they run), on drafts designed over its own targets and evaluated slots, against
        serving's rule on the same drafts (sleuth.probes.acceptance). Only the Domino objective reports one (a DFlash
        run reports none, DSpark an expectation of its own): it is driven where the recipe chose Domino, or where no
        recipe chose a strategy, since the metric is then one flag away (`training.strategy: domino`)."""
        from sleuth.probes.acceptance import design, one_hot_logits, verdict_fields

        strategy = (self.recipe.get("training") or {}).get("strategy")
        common = dict(invariant="dflash.train_serve_gap", experiment="reported-acceptance",
                      hypothesis="the accept_len a run reports is the acceptance serving would see for the same drafts",
                      perturbed="SpecForge's Domino training model built by its own providers on the probe's target; "
                                "the drafter's final logits inside its forward replaced by a designed pattern over its "
                                "own targets: a different first wrong slot per block, correct slots after it, blocks "
                                "cut short by the row's end or a loss-mask hole",
                      threshold="reported accept_len = serving's, its sum and block count too")
        if strategy not in (None, "domino"):
            return Verdict(status="unknown", measurement="", reason=f"the recipe's training.strategy {strategy} "
                           "reports no accept length (SpecForge computes one in its Domino objective only)",
                           not_exercised=["Domino's accept_len (compute_accept_len): not this run's strategy"], **common)
        model = self._domino_training_model()
        # without shift_label a block's targets start at the anchor's own token, which is not weighted
        first_slot = 0 if model.shift_label else 1
        designed: list[Any] = []
        reported: list[tuple[float, float]] = []
        chunk_terms = model._domino_objective_chunk_terms
        pending: dict[str, Tensor] = {}

        def designed_chunk(hidden: Tensor, prev_ids: Tensor, target_ids: Tensor, weight_mask: Tensor,
                           eval_weight_mask: Tensor) -> Any:
            plan = design(target_ids, eval_weight_mask > 0, first_slot, self.target.vocab_size,
                          offset=sum(int(p.predictions[..., 0].numel()) for p in designed))
            designed.append(plan)
            pending["predictions"] = plan.predictions
            terms = chunk_terms(hidden, prev_ids, target_ids, weight_mask, eval_weight_mask)
            reported.append((float(terms[6]), float(terms[8])))  # accept_num, accept_den (the chunk's own sums)
            return terms

        def designed_head(base_logits4d: Tensor, **_kwargs: Any) -> Tensor:
            return one_hot_logits(pending["predictions"], base_logits4d.shape[-1], base_logits4d)

        anchors, valid = lab.batch.anchors.clone(), lab.batch.anchor_valid.clone()
        model.num_anchors = int(anchors.shape[1])
        model._sample_anchor_positions = lambda seq_len, loss_mask, device: (anchors.clone(), valid.clone())
        model._domino_objective_chunk_terms, model._apply_domino_head = designed_chunk, designed_head
        # several chunks, as a run whose anchors outnumber objective_chunk_blocks (512 against 128 by default) sums
        # its metric's terms over them
        model.objective_chunk_blocks = DOMINO_CHUNK
        fed = self._through_data_path(lab.batch, list(model.draft_model.target_layer_ids))
        model.eval()
        with torch.no_grad(), _flex_masks_dense():
            _loss, _accuracy, metrics = model(input_ids=fed["input_ids"], hidden_states=fed["hidden_states"],
                                              loss_mask=fed["loss_mask"])
        if not designed or "accept_len" not in metrics:
            return Verdict(status="unknown", measurement="", reason="SpecForge's Domino forward reported no "
                           "accept_len, or did not evaluate its objective through its chunk terms", **common)
        plan = SimpleNamespace(accepted_sum=sum(p.accepted_sum for p in designed), blocks=sum(p.blocks for p in designed),
                               partial_blocks=sum(p.partial_blocks for p in designed))
        fields = verdict_fields(sum(r[0] for r in reported), sum(r[1] for r in reported), plan, "accept_len")
        mean = float(metrics["accept_len"])
        expected = plan.accepted_sum / plan.blocks if plan.blocks else float("nan")
        fields["measurement"] += f"; the forward's accept_len {mean:.4f}"
        if fields["status"] == "match" and not abs(mean - expected) <= 1e-4 * max(1.0, expected):
            fields.update(status="mismatch", observed=f"the forward reports accept_len {mean:.3f} where its own chunk "
                          f"sums and serving's rule give {expected:.3f}")
        source = "the recipe's strategy" if strategy == "domino" else "probe choice: no recipe chose a strategy"
        return Verdict(coverage={"objective": f"domino ({source})", "blocks": plan.blocks,
                                 "blocks_cut_short": plan.partial_blocks, "chunks": len(designed)},
                       not_exercised=["DSpark's expected acceptance (tau): an expectation over its accept "
                                      "probabilities, not a count"], **fields, **common)

    def _domino_training_model(self) -> Any:
        """SpecForge's Domino training model, as its providers build it for the run's recipe with
        `training.strategy: domino`. Domino generates no draft config: the DFlash drafter's, with Domino's
        architecture and its GRU head (small sizes of the probe's; `shift_label` at its default), is written
        beside the recipe's."""
        from transformers import AutoTokenizer

        from specforge.algorithms.builtin import builtin_algorithm_registry
        from specforge.config import Config
        from specforge.training.model_loading import resolve_draft_config

        providers = builtin_algorithm_registry().resolve("domino").providers.model
        written = self.draft_config.to_dict()
        written["architectures"] = [providers.draft_config.architecture]
        written["dflash_config"] = {**(written.get("dflash_config") or {}), "projector_type": "domino",
                                    "emb_dim": DOMINO_HEAD, "gru_hidden_dim": DOMINO_HEAD}
        written.pop("auto_map", None)
        path = self.scratch / "domino-draft.json"
        path.write_text(json.dumps(written, default=str))
        recipe = self.cfg.model_dump()
        recipe["training"]["strategy"] = "domino"
        recipe["model"]["draft_model_config"] = str(path)
        cfg = Config.model_validate(recipe)
        draft_config = resolve_draft_config(cfg, provider=providers.draft_config)
        draft = providers.build_draft(cfg, draft_config).float()
        parts = providers.build_training_model(cfg, draft, draft_config, self.target_config,
                                               AutoTokenizer.from_pretrained(str(self.target_dir)))
        model = parts.model.float()
        if model.attention_backend not in ("flex_attention", "sdpa"):
            model.attention_backend = "sdpa"  # flex's mask_mod is evaluated densely (_flex_masks_dense), as in build()
        return model

    def _supervised_spans(self, _lab: Any) -> Verdict:
        """SpecForge's `preprocess_conversations` under the run's chat template (`data.chat_template`), on a
        two-turn conversation, with a tokenizer that holds the template's headers and end-of-turn as tokens of their
        own: each assistant turn's content and its end-of-turn must be supervised (serving accepts the end-of-turn at
        every turn's end; a drafter never trained on it cannot draft it), and nothing of the user turns."""
        import warnings

        from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        from specforge.data.preprocessing import preprocess_conversations
        from specforge.data.template import TEMPLATE_REGISTRY

        name = self.cfg.data.chat_template
        template = TEMPLATE_REGISTRY.get(name)
        common = dict(invariant="dflash.chat_template_consistency", experiment="supervised-spans",
                      hypothesis="the supervised span of every assistant turn is its content and its end-of-turn "
                                 "token; no user token is supervised",
                      perturbed=f"a two-turn conversation through preprocess_conversations with the {name!r} template",
                      threshold="exact spans", coverage={"chat_template": name, "parser": template.parser_type,
                                                          "span_pattern": getattr(template, "assistant_pattern_type", None)})
        # Only the end-of-turn-terminated span is driven: the other patterns end a turn at markers of their own
        # (longcat's "[Round N] USER:", inkling's role tags) that the tokenizer's real chat template renders and the
        # parser's fallback rendering, the one this check can run, does not. The thinking parser (Qwen3.5 / 3.6's
        # `qwen3.5` template) is the general one with thinking enabled, the same span rule.
        if (template.parser_type not in ("general", "thinking")
                or getattr(template, "assistant_pattern_type", "general") != "general"
                or not template.end_of_turn_token or not template.assistant_header):
            return Verdict(status="unknown", measurement="", reason=f"the {name!r} template (parser "
                           f"{template.parser_type}, span pattern {getattr(template, 'assistant_pattern_type', '?')}) "
                           "is not the end-of-turn-terminated one this check drives", **common)
        words = [f"w{i}" for i in range(12)]
        core = Tokenizer(models.WordLevel(vocab={"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        pieces = [p for p in dict.fromkeys((template.assistant_header, template.user_header, template.end_of_turn_token))
                  if p]
        core.add_tokens([AddedToken(p, normalized=False, special=False) for p in pieces])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<unk>")
        turns = [("user", "w1 w2"), ("assistant", "w3 w4 w5"), ("user", "w6"), ("assistant", "w7 w8")]
        conversation = [{"role": role, "content": text} for role, text in turns]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback rendering (no chat_template in the tokenizer) warns
            out = preprocess_conversations(tokenizer, [conversation], template, max_length=256)
        ids, mask = out["input_ids"][0].flatten().tolist(), out["loss_mask"][0].flatten().tolist()
        eot = tokenizer.convert_tokens_to_ids(template.end_of_turn_token)
        assistant_words = {tokenizer.convert_tokens_to_ids(w) for _, text in turns[1::2] for w in text.split()}
        user_words = {tokenizer.convert_tokens_to_ids(w) for _, text in turns[0::2] for w in text.split()}
        supervised = [i for i, m in zip(ids, mask) if m]
        problems = []
        missing = sorted(assistant_words - set(supervised))
        if missing:
            problems.append(f"assistant content tokens {missing} unsupervised")
        eots_after_assistant = [p for p in range(1, len(ids)) if ids[p] == eot and ids[p - 1] in assistant_words]
        dropped = [p for p in eots_after_assistant if not mask[p]]
        if not eots_after_assistant:
            problems.append("no end-of-turn token follows an assistant turn in the tokenized conversation")
        elif dropped:
            problems.append(f"the end-of-turn token after {len(dropped)} of {len(eots_after_assistant)} assistant turns "
                            "is unsupervised")
        leaked = sorted(user_words & set(supervised))
        if leaked:
            problems.append(f"user tokens {leaked} supervised")
        measurement = (f"{len(ids)} tokens, {sum(mask)} supervised; end-of-turn after an assistant turn at "
                       f"{eots_after_assistant}, supervised there: {[bool(mask[p]) for p in eots_after_assistant]}")
        if problems:
            return Verdict(status="mismatch", measurement=measurement,
                           observed="; ".join(problems) + ": the drafter is trained on other spans than serving "
                                    "drafts (it must draft each turn's end-of-turn)",
                           expected="each assistant turn's content and end-of-turn supervised, nothing else",
                           fix="Supervise each assistant turn through its end-of-turn token (include it in the span).",
                           **common)
        return Verdict(status="match", measurement=measurement,
                       observed="each assistant turn's content and end-of-turn supervised, no user token", **common)

    def _optimizer_steps(self, _lab: Any) -> Verdict:
        """SpecForge's optimizer as its assembly builds it from the run's config (training/assembly.py
        `_optimizer_factory`: BF16Optimizer over a copy of the drafter in the run's dtype, with its scheduler), over
        the recipe's total steps (or SCHEDULE_STEPS where it sets none): the configured rate, the clip coefficient
        for a gradient below and one above max_grad_norm, one step (the model's parameters must be the updated
        float32 masters), its saved state loaded into a fresh optimizer (the same masters, moments and schedule
        position), and the schedule (warmup to the peak; cosine down to its minimum at the last step, half the
        peak midway after warmup)."""
        import math
        import warnings

        from specforge.training.assembly import _optimizer_factory

        t = self.cfg.training
        peak, limit, kind = float(t.learning_rate), float(t.max_grad_norm), str(t.lr_scheduler)
        steps = int(_optimizer_factory(self.cfg).total_steps or SCHEDULE_STEPS)  # the recipe's horizon where it sets one

        # The run's parameter dtype (the recipe's model.torch_dtype, SpecForge's default bfloat16; the experiments
        # run in float32): BF16Optimizer keeps float32 masters of parameters in that dtype.
        from specforge.config.schema import ModelConfig

        dtype_name = str((self.recipe.get("model") or {}).get("torch_dtype")
                         or ModelConfig.model_fields["torch_dtype"].default)
        run_dtype = getattr(torch, dtype_name)
        drafter = copy.deepcopy(self.model.draft_model).to(run_dtype)

        def build() -> Any:
            factory = _optimizer_factory(self.cfg)
            if factory.total_steps is None:
                factory.configure_total_steps(steps)
            return factory(drafter)

        problems, parts = [], []
        optimizer = build()
        base = [float(x) for x in optimizer.scheduler.base_lrs]
        parts.append(f"base rates {base}; parameters in {dtype_name}")
        if any(abs(b - peak) > 1e-12 * peak for b in base):
            problems.append(f"the optimizer's base rate is {base}, not training.learning_rate {peak:g}")
        params = [p for p in optimizer.model_params]
        g = torch.Generator().manual_seed(5)
        raw = [torch.randn(p.shape, generator=g) for p in params]
        norm = math.sqrt(sum(float(r.square().sum()) for r in raw))
        for factor in (10.0, 0.1):  # the unclipped one last: it is the gradient the step below takes
            for p, r in zip(params, raw):
                p.grad = (r * (factor * limit / norm)).to(p.dtype)
            # the coefficient the gradients as stored call for, summed in float64
            stored = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params))
            want = min(1.0, limit / (stored + 1e-6))
            _total, coefficient = optimizer._grad_norm_and_clip_coefficient()
            parts.append(f"clip coefficient at {factor:g} x max_grad_norm: {float(coefficient):.6g} (wanted {want:.6g})")
            if abs(float(coefficient) - want) > 1e-4 * want:
                problems.append(f"a gradient at {factor:g} x max_grad_norm ({limit:g}) is scaled by "
                                f"{float(coefficient):.6g}, not {want:.6g} (min(1, max_grad_norm / its norm))")
        # One step with the unclipped gradient: the model's parameters must be the updated float32 masters. The
        # step's rate is raised to 0.1 for it, so every update is larger than the run dtype's rounding (a bf16
        # weight near 1 does not move for an update of 1e-4: a master left uncopied would not show).
        for group in optimizer.optimizer.param_groups:
            group["lr"] = 0.1
        before = [p.detach().clone() for p in params]
        optimizer.step()
        moved = sum(int(not torch.equal(p.detach(), b)) for p, b in zip(params, before))
        behind = [i for i, (p, mp) in enumerate(zip(params, optimizer.fp32_params))
                  if not torch.equal(p.detach(), mp.detach().to(p.dtype))]
        parts.append(f"one step: {moved} of {len(params)} parameter tensors moved; {len(behind)} differ from their masters")
        if behind or not moved:
            problems.append(f"after a step the model's parameters are not its updated float32 masters ({len(behind)} of "
                            f"{len(params)} differ, {moved} moved): the model trains one update behind what the "
                            "optimizer computed")
        # Its checkpoint state, loaded into a fresh optimizer (what a resumed run does): the same masters, moments
        # and schedule position.
        import specforge.optimizer as optimizer_module

        resumed = build()
        announce = optimizer_module.print_on_rank0  # it asks torch.distributed for the rank: a message, muted here
        optimizer_module.print_on_rank0 = lambda *_args, **_kwargs: None
        try:
            resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        finally:
            optimizer_module.print_on_rank0 = announce
        lost = [i for i, (a, r) in enumerate(zip(optimizer.fp32_params, resumed.fp32_params)) if not torch.equal(a, r)]
        moments = [k for k, v in optimizer.optimizer.state_dict()["state"].items()
                   for name, t in v.items() if isinstance(t, torch.Tensor)
                   and not torch.equal(t, resumed.optimizer.state_dict()["state"][k][name])]
        position = (optimizer.scheduler.last_epoch, resumed.scheduler.last_epoch)
        parts.append(f"resumed from its state: {len(lost)} masters and {len(moments)} moments differ, schedule at "
                     f"{position[1]} (saved {position[0]})")
        if lost or moments or position[0] != position[1]:
            problems.append(f"an optimizer resumed from its saved state is not the saved one: {len(lost)} of "
                            f"{len(params)} float32 masters, {len(moments)} moment tensors differ, schedule at "
                            f"{position[1]} for {position[0]}")
        optimizer = build()
        warmup = int(float(t.warmup_ratio) * steps)
        rates = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the scheduler stepped without optimizer steps: only its rates are read
            for _ in range(steps):
                optimizer.scheduler.step()
                rates.append(float(optimizer.optimizer.param_groups[0]["lr"]))
        at = lambda step: rates[step - 1]  # noqa: E731 - the rate after `step` scheduler steps
        parts.append(f"schedule ({kind}, {steps} steps, warmup {warmup}): rate after warmup {at(max(warmup, 1)):.4g}, "
                     f"midway {at(warmup + (steps - warmup) // 2):.4g}, at the last step {at(steps):.4g}")
        # 1e-3: SpecForge's hand-over from warmup to the cosine overshoots the peak by ~2e-5 for one step
        if abs(max(rates) - peak) > 1e-3 * peak:
            problems.append(f"the schedule peaks at {max(rates):.4g}, not at the configured {peak:g}")
        if kind == "cosine":
            if at(steps) > 1e-6 * peak:
                problems.append(f"the cosine schedule ends at {at(steps):.4g} ({at(steps) / peak:.2%} of "
                                "the peak), not at its minimum 0: its period is not the steps after warmup")
            middle = at(warmup + (steps - warmup) // 2)
            if abs(middle - peak / 2) > 0.02 * peak:
                problems.append(f"the cosine schedule is at {middle:.4g} midway after warmup, not half the peak")
        common = dict(invariant="dflash.optimizer_schedule", experiment="optimizer-steps",
                      hypothesis="SpecForge's optimizer trains at training.learning_rate, clips only a gradient above "
                                 "max_grad_norm (to that norm) and follows its schedule to the end",
                      perturbed=f"the optimizer built from the run's config for {steps} steps over a copy of the "
                                f"drafter in the run's {dtype_name}; gradients at 10 and 0.1 x max_grad_norm, one "
                                "step at rate 0.1, its state loaded into a fresh optimizer; its scheduler stepped through",
                      measurement="; ".join(parts), threshold="base rate within 1e-12, peak within 1e-3, the cosine's "
                      "end below 1e-6 of the peak and its middle within 2 % of half of it, clip coefficients within 1e-4",
                      coverage={"lr_scheduler": kind, "learning_rate": peak, "max_grad_norm": limit,
                                "warmup_steps": warmup})
        if problems:
            return Verdict(status="mismatch", observed="; ".join(problems),
                           expected="the configured rate, min(1, max_grad_norm / norm), warmup then the schedule to "
                                    "its minimum at the last step",
                           fix="Clip with min(1, max_norm / norm) from a float32 sum of squares; copy the masters into "
                               "the model after the optimizer's step; save the float32 masters themselves; run the "
                               "cosine over total_steps - warmup_steps.",
                           **common)
        return Verdict(status="match", observed="rate, clipping, a step, a resumed state and the schedule as configured",
                       **common)

    def _saved_mask_token(self, _lab: Any) -> Verdict | list[Verdict]:
        """The mask id training fills the blocks with where its sources disagree, and the id the saved draft config
        gives serving. Two cases, each built by the run's own providers:
          * a draft config pinning one id (a published drafter's) and a recipe setting another (model.mask_token_id):
            SpecForge's resolution prefers the recipe's; whichever it trains with is the one the checkpoint must carry;
          * a warm start: a draft config recording the id the drafter trained with, no recipe id, and a tokenizer
            that names another token its mask token. The drafter's learned response is to the recorded id's
            embedding, so training must keep it (SpecForge #604's pattern is the mask id changing under a warm start)."""
        import json

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.target_dir))
        pinned = int(self.model.mask_token_id)
        explicit = next(i for i in range(1, int(self.target.vocab_size)) if i != pinned
                        and i not in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id))

        def trained_and_saved(recipe_id: int | None, tokenizer: Any, name: str) -> tuple[int, Any]:
            cfg = self.cfg.model_copy(deep=True)
            cfg.model.mask_token_id = recipe_id
            draft_config = copy.deepcopy(self.draft_config)
            dflash = dict(getattr(draft_config, "dflash_config", None) or {})
            dflash["mask_token_id"] = pinned
            draft_config.dflash_config = dflash
            draft = self.providers.build_draft(cfg, draft_config).float()
            parts = self.providers.build_training_model(cfg, draft, draft_config, self.target_config, tokenizer)
            saved_dir = self.scratch / name
            draft.save_pretrained(str(saved_dir))
            saved = (json.loads((saved_dir / "config.json").read_text()).get("dflash_config") or {}).get("mask_token_id")
            return int(parts.model.mask_token_id), saved

        trained, saved = trained_and_saved(explicit, tokenizer, "saved-draft")
        own_mask = copy.deepcopy(tokenizer)
        own_mask.mask_token = own_mask.convert_ids_to_tokens(explicit)  # a tokenizer with its own mask token
        warm_trained, warm_saved = trained_and_saved(None, own_mask, "warm-start-draft")
        common = dict(invariant="dflash.mask_token_distinct", experiment="saved-mask-token",
                      hypothesis="training fills the blocks with the mask id its configuration pins (the recipe's, else "
                                 "the draft config's, before a tokenizer's), and the saved draft config carries that id",
                      perturbed=f"(a) a draft config pinning mask id {pinned} and a recipe setting model.mask_token_id "
                                f"{explicit}; (b) a warm start: the draft config pinning {pinned}, no recipe id, a "
                                f"tokenizer whose mask token is {explicit}; each drafter built and saved by SpecForge, "
                                "its config.json read",
                      measurement=f"(a) training fills the blocks with {trained}, the saved config says {saved}; "
                                  f"(b) training fills them with {warm_trained}, the saved config says {warm_saved}",
                      threshold="(a) saved = trained; (b) trained = saved = the draft config's id",
                      coverage={"pinned": pinned, "explicit": explicit, "warm_start_tokenizer_mask": explicit})
        if warm_trained != pinned:
            return Verdict(status="mismatch",
                           observed=f"on a warm start the blocks are filled with {warm_trained} (the tokenizer's mask "
                                    f"token), not the id {pinned} the drafter's config records and it trained with",
                           expected=f"mask_token_id {pinned} (the draft config's, above the tokenizer's)",
                           fix="Resolve the mask id as: explicit recipe id, then the draft config's recorded id, then "
                               "the tokenizer's mask token, then an unused embedding row.", **common)
        wrong = [(case, t, s_) for case, t, s_ in (("a", trained, saved), ("b", warm_trained, warm_saved)) if s_ != t]
        if wrong:
            case, t, s_ = wrong[0]
            # The checkpoint breaks the export contract, and serving fills the blocks with another mask token than
            # training did: both rules, one observation.
            return [Verdict(status="mismatch",
                            observed=f"({case}) the saved draft config's mask_token_id is {s_}, but training fills the "
                                     f"blocks with {t}: serving fills them with a token the drafter never trained on",
                            expected=f"mask_token_id {t}",
                            fix="Write the mask id training uses into the draft config (overwrite it, do not keep an "
                                "older one).", **{**common, "invariant": invariant})
                    for invariant in ("dflash.mask_token_distinct", "dflash.export_contract")]
        return Verdict(status="match", observed=f"trained with the pinned id in each case, and the saved config carries "
                                                f"it ({trained}, {warm_trained})", **common)

    def _exported_draft(self, _lab: Any) -> list[Verdict]:
        """A drafter of block size EXPORT_BLOCK with a YaRN rope, built by the run's own providers from the run's
        config, saved as SpecForge's export writes it (save_pretrained, then `apply_legacy_rope_scaling`, which
        `to_hf` / `to_sglang` call): the block size training uses (the training wrapper's) against the draft's and
        the saved config's, and the rotation each kind of reader builds from the saved config (`rope_parameters`;
        legacy readers: `rope_scaling` with the top-level `rope_theta`) against the trained rotary's."""
        import json

        from transformers import AutoTokenizer

        from specforge.export.checkpoint_io import apply_legacy_rope_scaling
        from specforge.training.model_loading import resolve_draft_config

        cfg = self.cfg.model_copy(deep=True)
        cfg.model.draft_block_size = EXPORT_BLOCK
        draft_config = resolve_draft_config(cfg, provider=self.providers.draft_config)
        theta = float((getattr(draft_config, "rope_parameters", None) or {}).get("rope_theta") or 10000.0)
        draft_config.rope_parameters = {**EXPORT_ROPE, "rope_theta": theta}
        draft = self.providers.build_draft(cfg, draft_config).float()
        tokenizer = AutoTokenizer.from_pretrained(str(self.target_dir))
        trained_block = int(self.providers.build_training_model(cfg, draft, draft_config, self.target_config,
                                                                tokenizer).model.block_size)
        where = self.scratch / "exported-draft"
        draft.save_pretrained(str(where))
        apply_legacy_rope_scaling(str(where))
        saved = json.loads((where / "config.json").read_text())
        saved_block = saved.get("block_size", (saved.get("dflash_config") or {}).get("block_size"))
        perturbed = (f"a drafter of block size {EXPORT_BLOCK} (model.draft_block_size) with a {EXPORT_ROPE['rope_type']} "
                     f"rope (factor {EXPORT_ROPE['factor']:g}), built by the run's providers and saved as SpecForge's "
                     "export writes it (save_pretrained, apply_legacy_rope_scaling)")
        blocks = {"training": trained_block, "the draft model": int(draft.block_size), "the saved config": saved_block}
        block_common = dict(invariant="dflash.block_position_ids", experiment="exported-draft", perturbed=perturbed,
                            hypothesis="training builds its blocks with the draft's block size, the one the export "
                                       "tells serving",
                            measurement=", ".join(f"{k}: {v}" for k, v in blocks.items()), threshold="equal sizes")
        if len(set(blocks.values())) > 1:
            block = Verdict(status="mismatch", expected=f"block size {EXPORT_BLOCK} everywhere",
                            observed=f"training builds blocks of {trained_block} while the draft and its export use "
                                     f"{draft.block_size} / {saved_block}: positions, masks and labels of every block "
                                     "differ from what is served",
                            fix="Take the training block size from the draft model (its config's block_size).",
                            **block_common)
        else:
            block = Verdict(status="match", observed=f"block size {trained_block} in training, draft and export",
                            **block_common)
        return [block, self._exported_rotation(draft, saved, perturbed)]

    @staticmethod
    def _exported_rotation(draft: nn.Module, saved: dict[str, Any], perturbed: str) -> Verdict:
        """The trained rotary against the one built, by the drafter's own rotary class, from each representation a
        reader takes of the saved config."""
        trained = draft.rotary_emb
        readers: dict[str, dict[str, Any]] = {}
        if isinstance(saved.get("rope_parameters"), dict):
            readers["rope_parameters"] = dict(saved["rope_parameters"])
        legacy = saved.get("rope_scaling")
        if isinstance(legacy, dict):
            kind = legacy.get("rope_type") or legacy.get("type") or "default"
            readers["legacy rope_scaling + rope_theta"] = (
                {**legacy, "rope_type": kind, "rope_theta": saved.get("rope_theta")} if kind != "default"
                else {"rope_type": "default", "rope_theta": saved.get("rope_theta")})
        common = dict(invariant="dflash.rope_served_as_trained", experiment="exported-draft", perturbed=perturbed,
                      hypothesis="every rope representation the export writes rebuilds the trained rotation",
                      threshold="equal inverse frequencies and attention scaling (rtol 1e-5)")
        wrong, read = [], []
        for name, rope in readers.items():
            config = copy.deepcopy(draft.config)
            config.rope_parameters = rope
            served = type(trained)(config=config)
            same = (served.inv_freq.shape == trained.inv_freq.shape
                    and torch.allclose(served.inv_freq.double(), trained.inv_freq.double(), rtol=1e-5, atol=0.0)
                    and abs(float(served.attention_scaling) - float(trained.attention_scaling)) <= 1e-5)
            read.append(f"{name}: {rope.get('rope_type')}")
            if not same:
                wrong.append(f"{name} rebuilds a {rope.get('rope_type')} rope where the drafter trained with "
                             f"{trained.rope_type}")
        measurement = f"trained: {trained.rope_type}; " + "; ".join(read)
        if wrong:
            return Verdict(status="mismatch", measurement=measurement, expected=f"{trained.rope_type} in every reader",
                           observed="the exported config serves another rotation than the drafter trained with: "
                                    + "; ".join(wrong),
                           fix="Mirror rope_parameters into rope_scaling with its rope_type (and keep rope_theta).",
                           **common)
        if not readers:
            return Verdict(status="unknown", measurement=measurement, reason="the export wrote no rope fields", **common)
        return Verdict(status="match", measurement=measurement, observed="every rope representation rebuilds the "
                       "trained rotation", not_exercised=["partial rotary, mRoPE sections and the pair layout "
                                                          "(is_neox_style)"], **common)

    def _row_end_positions(self, lab: Any, given: list[Tensor], row: int, slot: int, anchor: int,
                           start: int) -> Verdict:
        """The positions of the row-end block's slots (`given`: the ids its rotary embedding was called with in
        `_row_end`'s forward; `start`: the anchor's position): anchor + j for every slot, also
        past the row's end. Serving always drafts a block past the end of what is known, at anchor + j; a slot
        clamped or wrapped there trains its neighbours on keys at positions they never see served. The
        experiments' layout keeps every block inside its row, so this is the only place it is exercised."""
        b = self.block_size
        expected = [start + j for j in range(b)]
        common = dict(
            invariant="dflash.block_position_ids", experiment="row-end-positions",
            hypothesis="the slots of a block at the row's end sit at position anchor + j, past the end too",
            perturbed=f"row {row}'s last anchor moved to position {anchor} (its block runs past the row's end); the "
                      "position ids given to the drafter's rotary embedding read",
            threshold="exact position ids",
            coverage={"row_end_anchor": anchor, "block_size": b},
        )
        q = int(lab.batch.anchors.shape[1]) * b
        rows = [ids.reshape(-1, ids.shape[-1])[min(row, ids.reshape(-1, ids.shape[-1]).shape[0] - 1)]
                for ids in given if ids.shape[-1] >= q]
        if not rows:
            return Verdict(status="unknown", measurement="", reason="the rotary embedding was not called with the "
                           "block's position ids", **common)
        got = rows[0][-q:][slot * b:(slot + 1) * b].tolist()
        measurement = f"the block at {anchor}: position ids {got}"
        if got != expected:
            return Verdict(status="mismatch", measurement=measurement,
                           observed=f"the block anchored at {anchor} (past the row's end at {lab.batch.input_ids.shape[1]}"
                                    f") gets positions {got}, not anchor + j = {expected}: its trailing slots are "
                                    "clamped or wrapped, while serving drafts them at anchor + j",
                           expected=f"{expected}", fix="Give block slot j the position anchor + j, with no clamp at "
                           "the row's end (only the label indices are clamped).", **common)
        return Verdict(status="match", measurement=measurement,
                       observed="a block past the row's end keeps positions anchor + j", **common)

    def _accumulation(self, lab: Any) -> Verdict:
        """SpecForge's optimizer boundary (training/controller.py TrainerCore over its DFlash strategy, with the
        FSDP backend's backward and gradient scaling), two micro-batches with different token counts at
        accumulation_steps 2, against the gradient of the objective it promises: the pooled weighted mean
        (sum of the micro-batches' loss numerators over the sum of their denominators, its loss_terms), or the
        mean of the micro-batch losses where the model returns no loss_terms. The experiments run one forward,
        so the arithmetic across micro-batches is only exercised here."""
        from specforge.runtime.contracts import TrainBatch
        from specforge.training.backend import FSDPTrainingBackend
        from specforge.training.controller import TrainerCore
        from specforge.training.strategies.base import DFlashTrainStrategy

        common = dict(
            invariant="dflash.loss_kind", experiment="gradient-accumulation",
            hypothesis="at accumulation_steps 2, the gradient SpecForge's trainer steps with is the gradient of the "
                       "objective over both micro-batches (their loss numerators over their pooled denominator)",
            perturbed="two micro-batches (the probe's batch; the same with the second half of every row "
                      "unsupervised) through SpecForge's TrainerCore, DFlash strategy and FSDP backend arithmetic "
                      "(single process), the optimizer step replaced by reading the gradients",
            threshold=f"every trainable parameter's gradient within {CHUNK_GRAD_RTOL:g} of its norm",
        )
        half = lab.batch.loss_mask.clone()
        half[:, half.shape[1] // 2:] = 0
        micro = [lab.batch, lab.batch.replace(loss_mask=half)]
        trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        identity = SimpleNamespace(block_embeddings=lambda x: x, draft_logits=lambda x: x)
        self.model.train()

        # the promised objective, from the model's own terms
        terms, losses = [], []
        for batch in micro:
            fed = self._through_data_path(batch)
            with self._wired(batch, identity):
                loss, _acc, metrics = self.model(input_ids=fed["input_ids"], hidden_states=fed["hidden_states"],
                                                 loss_mask=fed["loss_mask"])
            losses.append(loss)
            terms.append(metrics.get("loss_terms"))
        if all(t is not None for t in terms):
            objective = sum(t[0].reshape(()) for t in terms) / sum(t[1].detach().reshape(()) for t in terms)
            promised = "the pooled weighted mean sum(numerators) / sum(denominators)"
            dens = [float(t[1]) for t in terms]
        else:
            objective, promised, dens = sum(losses) / len(losses), "the mean of the micro-batch losses", []
        reference = torch.autograd.grad(objective, list(trainable.values()), allow_unused=True)

        # the trainer's boundary
        backend = FSDPTrainingBackend(SimpleNamespace(fsdp_process_group=None))
        backend.module, backend._wrapped = self.model, False
        stepped: dict[str, Tensor] = {}

        def read_gradients() -> None:
            stepped.update({n: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
                            for n, p in trainable.items()})

        backend.step = read_gradients  # type: ignore[method-assign]
        core = TrainerCore(DFlashTrainStrategy(self.model), backend, accumulation_steps=2)
        saved = {n: p.grad for n, p in trainable.items()}
        try:
            for p in trainable.values():
                p.grad = None
            for i, batch in enumerate(micro):
                fed = self._through_data_path(batch)
                with self._wired(batch, identity):
                    core.train_step(TrainBatch(sample_ids=[f"probe-{i}"], strategy="dflash", tensors=fed))
        finally:
            for n, p in trainable.items():
                p.grad = saved[n]
        measurement_base = (f"denominators {', '.join(f'{d:g}' for d in dens)}; " if dens else "")
        if not stepped:
            return Verdict(status="unknown", measurement=measurement_base, reason="the trainer did not reach its "
                           "optimizer boundary after accumulation_steps micro-batches", **common)
        diffs = {}
        for (name, ref) in zip(trainable, reference):
            ref = torch.zeros_like(stepped[name]) if ref is None else ref.detach()
            scale = max(ref.norm().item(), stepped[name].norm().item())
            diffs[name] = (stepped[name] - ref).norm().item() / scale if scale > 0 else 0.0
        worst = max(diffs, key=diffs.get)
        ratio = (sum(stepped[n].norm().item() for n in trainable) /
                 max(sum((torch.zeros(()) if r is None else r.norm()).item() for r in reference), 1e-30))
        measurement = (measurement_base + f"largest relative gradient difference {diffs[worst]:.3g} ({worst}); "
                       f"gradient norm ratio trainer / {promised}: {ratio:.4g}")
        coverage = {"accumulation_steps": 2, "micro_batch_denominators": dens, "promised": promised,
                    "run_accumulation_steps": getattr(self.cfg_training, "accumulation_steps", None)}
        if diffs[worst] > CHUNK_GRAD_RTOL:
            return Verdict(status="mismatch", measurement=measurement, coverage=coverage,
                           observed=f"with gradient accumulation the trainer steps with other gradients than those of "
                                    f"{promised}: {ratio:.4g} x their norm, max relative difference {diffs[worst]:.3g} "
                                    f"({worst}); the effective loss scale depends on which micro-batch came last",
                           expected=f"the gradient of {promised}",
                           fix="Normalise the accumulated gradients once, by the total of every micro-batch's loss "
                               "denominator (world size x accumulation steps / total), not by one micro-batch's.",
                           measured={"gradient": diffs[worst], "norm_ratio": ratio}, **common)
        return Verdict(status="match", measurement=measurement, coverage=coverage,
                       observed=f"accumulating two micro-batches gives the gradient of {promised}",
                       measured={"gradient": diffs[worst], "norm_ratio": ratio}, **common)

    def _row_end(self, lab: Any) -> list[Verdict]:
        """A block whose slots run past the row's end (an anchor two positions before it: SpecForge's sampler
        allows it, its next token is supervised): the slots whose label would lie beyond the row have no label,
        so they must get no gradient. The probe's layout keeps every block inside its row."""
        b = self.block_size
        s = int(lab.batch.input_ids.shape[1])
        anchors = lab.batch.anchors.clone()
        valid = lab.batch.anchor_valid.clone()
        row, slot = 0, int(valid[0].sum()) - 1  # the row's last valid anchor, moved to the end
        anchor = s - 2
        anchors[row, slot] = anchor
        batch = lab.batch.replace(anchors=anchors, anchor_valid=valid)
        common = dict(
            invariant="dflash.target_shift", experiment="row-end-block",
            hypothesis="slots whose label position p+j lies beyond the row's end are not trained (no label there)",
            perturbed=f"row {row}'s last anchor moved to position {anchor} of {s}: slots 2..{b - 1} of its block have "
                      "no label; the drafter's logits replaced by a leaf, the loss's gradient read per slot",
            threshold="no gradient (exactly 0) on the slots past the end; some on slot 1",
        )
        if b < 3:
            return [Verdict(status="not_applicable", measurement="", reason="a block of < 3 slots cannot run past the "
                            "end with a supervised next token", **common)]
        leaves: list[Tensor] = []

        def as_leaf(z: Tensor) -> Tensor:
            leaf = z.detach().clone().requires_grad_(True)
            leaves.append(leaf)
            return leaf

        given: list[Tensor] = []

        def record(_module: nn.Module, args: Any, kwargs: Any) -> None:
            ids = args[1] if len(args) > 1 else kwargs.get("position_ids")
            if isinstance(ids, Tensor):
                given.append(ids.detach().clone())

        handle = self.model.draft_model.rotary_emb.register_forward_pre_hook(record, with_kwargs=True)
        try:
            loss = self.loss(batch, SimpleNamespace(block_embeddings=lambda x: x, draft_logits=as_leaf))
        finally:
            handle.remove()
        positions = self._row_end_positions(lab, given, row, slot, anchor, int(batch.position_ids[row, anchor]))
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        grad = torch.cat([torch.zeros_like(z) if g is None else g for z, g in zip(leaves, grads)], dim=1)
        per_slot = grad.reshape(anchors.shape[0], anchors.shape[1], b, -1)[row, slot].abs().amax(-1)  # [B]
        past = [j for j in range(b) if anchor + j >= s]
        trained_past = [j for j in past if float(per_slot[j]) > 0]
        measurement = "largest |d loss / d logit| per slot of that block: " + ", ".join(
            f"{j}: {float(per_slot[j]):.2g}" for j in range(b))
        coverage = {"row_end_anchor": anchor, "seq_len": s, "slots_past_the_end": past}
        if float(per_slot[1]) == 0:
            return [Verdict(status="unknown", measurement=measurement, coverage=coverage,
                            reason="slot 1 of the block at the row's end gets no gradient either: nothing is read",
                            **common), positions]
        if trained_past:
            return [Verdict(status="mismatch", measurement=measurement, coverage=coverage,
                            observed=f"a block at the row's end trains slots {trained_past}, whose label position "
                                     f"(anchor {anchor} + j) is past the row's last position {s - 1}: they learn a "
                                     "token clamped or wrapped from elsewhere",
                            expected="no gradient on slots with p + j >= seq_len",
                            fix="Mark label positions >= seq_len invalid (label_indices < seq_len) before the loss.",
                            **common), positions]
        return [Verdict(status="match", measurement=measurement, coverage=coverage,
                        observed=f"a block at the row's end trains none of its {len(past)} slots past the end",
                        **common), positions]

    def _mask_builders(self, lab: Any) -> Verdict:
        """The flex mask the run builds (`attention_backend: flex_attention`, SpecForge's recipes) against
        SpecForge's dense SDPA builder, the one its own tests check against a Python-loop reference, on the
        probe's anchors and with sliding windows narrower than the probe's contexts: the experiments see the
        windows of a real recipe (2048) never bind, so a window bound off by one would pass them."""
        from specforge.algorithms.common import dflash_family_model as family

        b, s = self.block_size, int(lab.batch.input_ids.shape[1])
        anchors, keep = lab.batch.anchors.clone(), lab.batch.anchor_valid.clone()
        run_window = getattr(self.model.draft_model, "sliding_window", None)
        # Windows where the run has sliding layers, and, with no run config, as the variants do: a defect on the
        # path other runs take (SpecForge's Qwen3.5/3.6 recipes slide) is the code's.
        windowed = run_window is not None or not self.has_run_config
        windows: list[int | None] = [None] + sorted({w for w in (run_window, 3, b + 2) if isinstance(w, int) and w > 0}
                                                     if windowed else set())
        common = dict(
            invariant="dflash.context_excludes_anchor", experiment="mask-builders",
            hypothesis="the flex mask_mod the run uses allows exactly what SpecForge's SDPA mask builder allows",
            perturbed="nothing: both builders on the probe's anchors and padded slot, windows "
                      + ", ".join("none" if w is None else str(w) for w in windows),
            threshold="every (query, key) pair equal",
        )
        if self.cfg_training.attention_backend != "flex_attention":
            return Verdict(status="not_applicable", measurement="", reason="the run builds the SDPA mask itself", **common)
        differences = []
        with _flex_masks_dense():
            for window in windows:
                args = dict(anchor_positions=anchors, block_keep_mask=keep, S=s, block_size=b, device=anchors.device,
                            sliding_window=window)
                flex = family.create_dflash_block_mask(**args).bool()
                dense = family.create_dflash_sdpa_mask(**args).bool().expand_as(flex)
                if not torch.equal(flex, dense):
                    diff = flex != dense
                    context = int(diff[..., :s].sum())
                    differences.append((window, context, int(diff[..., s:].sum()),
                                        int((flex & ~dense)[..., :s].sum()), int((~flex & dense)[..., :s].sum()),
                                        _block_difference_kind(flex, dense, s, b)))
        measurement = (f"{len(windows)} window setting(s) compared; differing (query, key) pairs: "
                       + ("; ".join(f"window {w}: {c} context ({extra} more, {fewer} fewer in flex), {d} block"
                                    + (f" ({kind})" if kind else "")
                                    for w, c, d, extra, fewer, kind in differences) or "none"))
        coverage = {"windows": windows, "run_sliding_window": run_window}
        if differences:
            w, c, d, extra, fewer, kind = differences[0]
            # Which rule the difference breaks: whole blocks masked out in one builder and not the other are the
            # keep mask's (a padded anchor's block trained, a real one dropped); a difference among one block's
            # own keys is the in-block rule's; across blocks the isolation rule's; in the context the anchor's.
            common["invariant"] = ("dflash.anchor_sampling" if kind == "whole blocks" else
                                   "dflash.block_bidirectional" if kind == "within a block" else
                                   "dflash.context_excludes_anchor" if c else "dflash.blocks_isolated")
            return Verdict(status="mismatch", measurement=measurement, coverage=coverage,
                           observed=f"the flex mask the run uses differs from SpecForge's SDPA mask at window "
                                    f"{'none' if w is None else w}: {c} context pairs ({extra} more visible, {fewer} "
                                    f"fewer in flex), {d} block pairs",
                           expected="the two builders equal (SpecForge tests its SDPA mask against a loop reference)",
                           fix="Make create_dflash_block_mask's mask_mod compute what create_dflash_sdpa_mask computes "
                               "(the window's lower bound, the anchor bound, the block rule).",
                           **common)
        return Verdict(status="match", measurement=measurement, coverage=coverage,
                       observed="the flex and SDPA builders allow the same pairs" + (
                           f", windows {windows[1:]} included" if len(windows) > 1 else ""), **common)

    def _objective_and_gradients(self, batch: Any, chunk: int) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss and d loss / d every trainable parameter with objective_chunk_blocks = chunk, no probe
        hooks (autograd.grad, so no .grad is left behind for the experiments)."""
        trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        identity = SimpleNamespace(block_embeddings=lambda x: x, draft_logits=lambda x: x)
        saved = self.model.objective_chunk_blocks
        self.model.objective_chunk_blocks = chunk
        try:
            loss = self.loss(batch, identity)
            grads = torch.autograd.grad(loss, list(trainable.values()), allow_unused=True)
        finally:
            self.model.objective_chunk_blocks = saved
        return loss.detach().double(), {n: (torch.zeros_like(p) if g is None else g).double()
                                        for (n, p), g in zip(trainable.items(), grads)}

    def _chunked_objective(self, lab: Any) -> Verdict:
        # the probe's batch, and the same with every anchor valid: its padded slots carry no weight, so a slice
        # of them that went missing from the totals (the last one, with the probe's layout) would change nothing
        batches = {"the probe's batch": lab.batch,
                   "every anchor valid": lab.batch.replace(anchor_valid=torch.ones_like(lab.batch.anchor_valid))}
        blocks = int(lab.batch.anchors.shape[1])
        run_chunk = int(self.cfg_training.objective_chunk_blocks)
        # several chunks on the probe's batch (1 and 2 blocks), and the run's own size (checkpointed even when
        # it holds all the probe's blocks); 0 is the one piece the experiments use
        sizes = sorted({c for c in (*CHUNK_SIZES, run_chunk) if c > 0 and (c < blocks or c == run_chunk)})
        common = dict(
            invariant="dflash.loss_kind", experiment="objective-chunking",
            hypothesis="the chunked objective the run uses (training.objective_chunk_blocks, checkpointed slices "
                       "of blocks) gives the loss and gradients of the same objective in one piece",
            perturbed=f"objective_chunk_blocks {', '.join(map(str, sizes))} against 0 (one piece), on the probe's "
                      f"batch of {blocks} blocks per row and on it with every anchor valid, no probe hooks",
            threshold=f"loss within {CHUNK_LOSS_RTOL:g} relative; every trainable parameter's gradient within "
                      f"{CHUNK_GRAD_RTOL:g} of its norm",
        )
        if blocks < 2 or not sizes:
            return Verdict(status="unknown", measurement="", reason=f"the batch has {blocks} block(s) per row: "
                           "no chunk size splits it", **common)
        # gradient difference, loss difference, chunk, parameter, batch
        worst: tuple[float, float, int, str, str] = (0.0, 0.0, 0, "", "")
        parts = []
        zero: set[str] = set()
        for label, batch in batches.items():
            whole_loss, whole = self._objective_and_gradients(batch, 0)
            zero |= {n for n, g in whole.items() if g.abs().max().item() == 0.0}
            for chunk in sizes:
                loss, grads = self._objective_and_gradients(batch, chunk)
                loss_rel = abs(loss - whole_loss).item() / max(abs(whole_loss).item(), 1e-30)
                diffs = {}
                for name, ref in whole.items():
                    scale = max(ref.norm().item(), grads[name].norm().item())
                    diffs[name] = (grads[name] - ref).norm().item() / scale if scale > 0 else 0.0
                name = max(diffs, key=diffs.get) if diffs else ""
                parts.append(f"{label}, chunk {chunk}: loss {loss_rel:.2g}, gradient {diffs.get(name, 0.0):.2g} ({name})")
                if (max(diffs.get(name, 0.0) / CHUNK_GRAD_RTOL, loss_rel / CHUNK_LOSS_RTOL)
                        > max(worst[0] / CHUNK_GRAD_RTOL, worst[1] / CHUNK_LOSS_RTOL)):
                    worst = (diffs.get(name, 0.0), loss_rel, chunk, name, label)
        grad_rel, loss_rel, chunk, name, label = worst
        measurement = "relative difference from the one piece: " + "; ".join(parts)
        coverage = {"chunk_sizes": sizes, "run_objective_chunk_blocks": run_chunk, "blocks_per_row": blocks,
                    "batches": list(batches), "parameters_compared": len(whole),
                    "parameters_without_gradient": sorted(zero)}
        if grad_rel > CHUNK_GRAD_RTOL or loss_rel > CHUNK_LOSS_RTOL:
            what = "gradients" if grad_rel > CHUNK_GRAD_RTOL else "a loss"
            return Verdict(status="mismatch", measurement=measurement, coverage=coverage,
                           observed=f"the chunked objective the run uses (objective_chunk_blocks={chunk}; the run's "
                                    f"is {run_chunk}) gives other {what} than the same objective in one piece: max "
                                    f"relative difference {grad_rel:.3g} in the gradient of {name}, {loss_rel:.3g} in "
                                    f"the loss ({label})",
                           expected="the same loss and gradients whatever the chunk size (chunking only bounds memory)",
                           fix="Sum every chunk's terms into the totals with their graphs (no detach, no dropped or "
                               "repeated slice), so each block's gradient reaches the drafter.",
                           measured={"gradient": grad_rel, "loss": loss_rel, "chunk": chunk}, **common)
        return Verdict(status="match", measurement=measurement, coverage=coverage,
                       observed=f"objective_chunk_blocks {sizes} give the loss and gradients of the one piece (max "
                                f"relative difference {grad_rel:.2g} gradient, {loss_rel:.2g} loss)",
                       measured={"gradient": grad_rel, "loss": loss_rel}, **common)

    def _capture_layers(self, _lab: Any) -> Verdict:
        from specforge.training.model_loading import draft_config_dict

        reads = [int(i) for i in self.model.draft_model.target_layer_ids]
        rule = self.providers.resolve_capture_layers
        text_config = getattr(self.target_config, "text_config", self.target_config)
        # The two callers of the rule, with the arguments each passes: offline capture resolves it over the draft
        # config object and the target config (application/composition.py), the server-capture contract over the
        # draft config's dict and the target's text config (training/capture_contract.py).
        captured = {
            "offline capture (application/composition.py)": [int(i) for i in rule(self.cfg, self.draft_config, self.target_config)],
            "server capture contract (training/capture_contract.py)":
                [int(i) for i in rule(self.cfg, draft_config_dict(self.cfg, provider=self.providers.draft_config),
                                      text_config)],
        }
        common = dict(
            invariant="dflash.target_layer_ids", experiment="capture-layers",
            hypothesis="the target layers SpecForge captures for offline / server training (resolve_capture_layers) "
                       "are the layers the drafter is built to read (draft_model.target_layer_ids)",
            perturbed="nothing: SpecForge's capture-layer rule called as its offline capture and server-capture "
                      "contract call it, on the probe's draft config",
            measurement="; ".join(f"{where}: {ids}" for where, ids in captured.items()) + f"; the drafter reads {reads}",
            threshold="the same layer ids, in the same order",
            coverage={"capture_layers": captured, "drafter_target_layer_ids": reads},
        )
        wrong = {where: ids for where, ids in captured.items() if ids != reads}
        if wrong:
            return Verdict(status="mismatch",
                           observed="; ".join(f"{where} captures target layers {ids}" for where, ids in wrong.items())
                           + f", but the drafter is built to read {reads} (draft_model.target_layer_ids): offline and "
                             "server-trained drafters learn from other layers than the ones they are served with",
                           expected=f"capture layers {reads}",
                           fix="Capture exactly the draft config's dflash_config.target_layer_ids (the ids the drafter "
                               "reads, in its own convention), with no offset.",
                           **common)
        return Verdict(status="match", observed=f"offline capture and the server-capture contract capture {reads}, "
                                                "the layers the drafter reads", **common)


def _block_difference_kind(flex: Tensor, dense: Tensor, context: int, block_size: int) -> str:
    """Where two [rows, heads, N*B, S + N*B] block masks differ: "whole blocks" when some block's queries see
    nothing in one and something in the other (the keep mask applied to the wrong blocks), "within a block" when
    every differing block key is in the query's own block, "across blocks" otherwise, "" in the context only."""
    rows = flex.any(-1).reshape(*flex.shape[:2], -1, block_size).any(-1)  # [rows, heads, N]: block sees anything
    other = dense.any(-1).reshape(*dense.shape[:2], -1, block_size).any(-1)
    if not torch.equal(rows, other):
        return "whole blocks"
    diff = (flex != dense)[..., context:]
    if not diff.any():
        return ""
    q = torch.arange(diff.shape[-2]) // block_size
    k = torch.arange(diff.shape[-1]) // block_size
    same = q[:, None] == k[None, :]
    return "within a block" if not (diff & ~same).any() else "across blocks"
