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
Checked on their own (`path_checks`): the collated row against the packed row (a document cut at the row's end
included), the config.json `save_pretrained` writes, and each optimizer's learning rate.
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

from sleuth.probes.adapters.synthetic import owned_scratch, write_target_dir
from sleuth.probes.target import EOS_TOKEN
from sleuth.probes.verdict import Verdict, guarded

DEFAULT_TARGET_LAYERS = 8
CUT_TAIL = 5  # positions the row's last document is stored beyond the row (the collator cuts them)
# The dtype the probe's second collation stores the cache in: vLLM hands hidden states over in bf16, while the probe
# trains in float32, so a collator that casts some hidden-state keys and not others shows.
CACHE_DTYPE = torch.bfloat16
DRAFT_VOCAB = 48  # a reduced draft vocabulary (--draft-vocab-size) below the probe target's 64 tokens
PARTIAL_ROTARY = 0.25  # Qwen3.5 / 3.6 targets rotate a quarter of each head; their drafters rotate all of it
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
    "speculators' D-PACE with alpha 0.3 and a full-attention layer beside causal sliding layers, on a Qwen3.5-layout "
    "verifier": {"train": {"draft": {"full_attention_indices": [0]}, "dflash": {"dpace_alpha": 0.3}}},
}
# The variant whose verifier is written as a Qwen3.5 / 3.6 text checkpoint (`qwen3_5_text`, its final norm in the
# x * (1 + w) convention, synthetic.py): the trainer's own reading of that family runs.
QWEN3_5_VARIANT = next(label for label in VARIANTS if label.endswith("Qwen3.5-layout verifier"))


class SpeculatorsSubject:
    def __init__(self, package_dir: str, context: dict[str, Any], origin: str | None = None) -> None:
        import speculators
        from speculators.models.dflash import core
        from speculators.models.dflash.core import DFlashDraftModel

        where = Path(speculators.__file__).resolve().parent
        if where != Path(package_dir).resolve():
            raise ImportError(f"speculators was imported from {where}, not from the diagnosed {package_dir}")
        self.core, self.model_class = core, DFlashDraftModel
        self.scratch = owned_scratch(self, "sleuth-speculators-")
        self.verifier = self.scratch / "verifier"
        self.package_dir, self.has_run_config = package_dir, bool(context.get("config"))
        self.verifier_family = "qwen3_5" if origin == QWEN3_5_VARIANT else "qwen3"
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

        # The values as the config resolved them (TrainConfig), not as get_trainer_kwargs read them back: the
        # experiments compare what the loss applies with what the run asked for, so an expectation taken from
        # the code that consumes the config would agree with a key it misreads.
        def asked(dest: str, read: Any) -> Any:
            return flat[dest] if flat.get(dest) is not None else read

        chosen = asked("per_position_loss_weight", kwargs["per_position_loss_weight"])
        weighting = {"dpace": "dpace", "fixed-exp-decay": "fixed-exp"}.get(chosen, chosen)
        configured: dict[str, dict[str, Any]] = {
            "weighting": {"value": weighting, "source": self._source("per_position_loss_weight")},
            "gamma": {"value": asked("dflash_decay_gamma", kwargs["gamma"]), "source": self._source("dflash_decay_gamma")},
            "dpace_alpha": {"value": asked("dpace_alpha", kwargs["dpace_alpha"]), "source": self._source("dpace_alpha")},
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
            # losses/utils.py loss_function: each row's weighted sum over loss_mask.sum(dim=1), the rows averaged
            "loss_reduction": "row_token_mean",
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
            configured["sliding_window_non_causal"] = {"value": bool(self.model.sliding_window_non_causal),
                                                       "source": self._source("sliding_window_non_causal")}
        return info

    def build(self, target: Any) -> None:
        from speculators.train.cli import build_draft_model

        self.target = target
        write_target_dir(target, self.verifier, family=self.verifier_family)
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
            write_target_dir(self.target, where, num_layers=num_target_layers, family=self.verifier_family)
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

    def _through_data_path(self, batch: Any, stored_dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """The row as speculators' training gets it: each document stored as vLLM hands it over (the selected
        layers, id i = hidden_states[i], then the final layer before its norm: [seq, k+1, H]), read by its
        dataset (`ArrowDataset._get_raw_data`, `BaseDataset.__getitem__`) and packed by its `CollateFn`
        (document ids, positions restarting per document; the row's last document stored longer than the row, so
        the collator's cut of a document at the row's end is on the path). `stored_dtype`: the cache holds the
        states in that dtype while training asks the collator for the batch's (a bf16 cache under float32 training)."""
        from speculators.train.data import ArrowDataset, CollateFn

        stack = torch.stack([batch.hidden_states[i][0] for i in self.layer_ids] + [batch.last_hidden[0]], dim=1)
        training_dtype = stack.dtype
        if stored_dtype is not None:
            stack = stack.to(stored_dtype)
        docs = batch.doc_ids[0]
        spans, start = [], 0
        for p in range(1, docs.numel() + 1):
            if p == docs.numel() or docs[p] != docs[start]:
                if docs[start] >= 0:
                    spans.append((start, p))
                start = p
        stored = [{"hidden_states": stack[a:b], "token_ids": batch.input_ids[0, a:b]} for a, b in spans]
        data = [{"input_ids": batch.input_ids[0, a:b], "loss_mask": batch.loss_mask[0, a:b]} for a, b in spans]
        if spans and spans[-1][1] == docs.numel():
            # The row's last document is stored CUT_TAIL positions longer than the row, as a long conversation is:
            # the collator truncates it at max_len, so its path for a document cut at the row's end runs.
            g = torch.Generator().manual_seed(13)
            stored[-1] = {"hidden_states": torch.cat([stored[-1]["hidden_states"],
                                                      torch.randn(CUT_TAIL, *stack.shape[1:], generator=g).to(stack.dtype)]),
                          "token_ids": torch.cat([stored[-1]["token_ids"], torch.randint(1, 60, (CUT_TAIL,), generator=g)])}
            data[-1] = {"input_ids": stored[-1]["token_ids"],
                        "loss_mask": torch.cat([data[-1]["loss_mask"], torch.ones(CUT_TAIL, dtype=batch.loss_mask.dtype)])}
        dataset = ArrowDataset.__new__(ArrowDataset)  # the reading, without the files it would read from
        dataset.transfer = SimpleNamespace(get_cached=lambda index: stored[index])
        dataset.data = data
        dataset._map_to_file_idx = lambda index: index
        dataset.on_missing = "raise"
        collate = CollateFn(max_len=batch.input_ids.shape[1], hidden_size=stack.shape[-1],
                            num_target_layers=len(self.layer_ids), dtype=training_dtype)
        return collate([dataset[i] for i in range(len(spans))])

    def _forward(self, batch: Any, hooks: Any) -> tuple[Tensor, list[Tensor]]:
        loss, drafted, _metrics = self._forward_with_metrics(batch, hooks)
        return loss, drafted

    def _forward_with_metrics(self, batch: Any, hooks: Any) -> tuple[Tensor, list[Tensor], dict[str, Any]]:
        if batch.input_ids.shape[0] != 1:
            raise ValueError("speculators' DFlash forward takes one packed row")
        kwargs = {**self.call_kwargs, "max_anchors": int(batch.anchors.shape[1])}
        fed = self._through_data_path(batch)
        with self._wired(batch, hooks) as drafted:
            _, loss, metrics = self.model(
                hidden_states=fed["hidden_states"],
                input_ids=fed["input_ids"],
                loss_mask=fed["loss_mask"],
                verifier_last_hidden_states=fed["verifier_last_hidden_states"],
                document_ids=fed["document_ids"],
                position_ids=fed["position_ids"],
                **kwargs,
            )
        return loss, drafted, metrics

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

    def path_checks(self, lab: Any) -> list[Verdict]:
        """What speculators' data path hands the model (its dataset and CollateFn, with the row's last document cut
        at the row's end) against the packed row the experiments mean: the experiments read the model's behaviour
        on the collated row, so a collator that changed the documents would change what they compare against."""
        checks = [(self._collated_row, "dflash.context_excludes_anchor", "collated-row"),
                  (self._window_width, "dflash.context_excludes_anchor", "window-width"),
                  (lambda _lab: self._check_saved_config(), ("dflash.export_contract", "dflash.rope_served_as_trained",
                                                             "dflash.sliding_window_served"), "saved-config"),
                  (lambda _lab: self._check_optimizer_rates(), "dflash.optimizer_schedule", "optimizer-rates"),
                  (self._reported_acceptance, "dflash.train_serve_gap", "reported-acceptance"),
                  (self._token_frequencies, "dflash.target_tables_resolve", "token-frequencies"),
                  (lambda _lab: self._converted_checkpoints(),
                   ("dflash.mask_token_distinct", "dflash.fc_input_layers", "dflash.export_contract"), "convert-dflash")]
        return [verdict for check, invariant, name in checks for verdict in guarded(check, lab, invariant, name)]

    def _reported_acceptance(self, lab: Any) -> Verdict:
        """The `eal` speculators' forward reports, on drafts designed over its own targets and trained slots (its
        `compute_metrics`, as the forward calls it, handed one-hot logits of the designed predictions), against
        serving's rule on the same drafts (sleuth.probes.acceptance)."""
        from sleuth.probes.acceptance import design, one_hot_logits, verdict_fields

        names = type(self.model).forward.__globals__
        original = names.get("compute_metrics")
        common = dict(invariant="dflash.train_serve_gap", experiment="reported-acceptance",
                      hypothesis="the eal a run reports is the acceptance serving would see for the same drafts",
                      perturbed="the drafter's predictions inside speculators' forward replaced by a designed pattern "
                                "over its own targets: a different first wrong slot per block, correct slots after it, "
                                "blocks cut short by a document end or a loss-mask hole",
                      threshold="reported eal = serving's, its sum and block count too")
        if not callable(original):
            return Verdict(status="unknown", measurement="", reason="speculators' forward does not call "
                           "compute_metrics: the metric's path is not the one this check drives", **common)
        first_slot = 0 if getattr(self.model.config, "sample_from_anchor", False) else 1
        designed: list[Any] = []

        def designed_metrics(logits: Tensor, targets: Tensor, loss_mask: Tensor, block_size: int, *args: Any,
                             **kwargs: Any) -> Any:
            vocab = logits.shape[-1]
            plan = design(targets.argmax(-1).reshape(-1, block_size), loss_mask.reshape(-1, block_size),
                          first_slot, vocab)
            designed.append(plan)
            drafts = one_hot_logits(plan.predictions.reshape(logits.shape[:-1]), vocab, logits)
            return original(drafts, targets, loss_mask, block_size, *args, **kwargs)

        identity = SimpleNamespace(block_embeddings=lambda x: x, draft_logits=lambda x: x)
        names["compute_metrics"] = designed_metrics
        try:
            self.model.eval()
            with torch.no_grad():
                _loss, _drafted, metrics = self._forward_with_metrics(lab.batch, identity)
        finally:
            names["compute_metrics"] = original
        if not designed or "eal_sum" not in metrics or "eal_total" not in metrics:
            return Verdict(status="unknown", measurement="", reason="the forward reported no eal_sum / eal_total",
                           **common)
        plan = designed[-1]
        fields = verdict_fields(float(metrics["eal_sum"]), float(metrics["eal_total"]), plan, "eal")
        return Verdict(coverage={"blocks": plan.blocks, "blocks_cut_short": plan.partial_blocks,
                                 "first_drafted_slot": first_slot}, **fields, **common)

    def _window_width(self, lab: Any) -> Verdict:
        """speculators' sliding-window mask (the model's own `_create_attention_mask`, causal within the block as
        its default) at windows narrower than the probe's contexts (3 and B + 2: the experiments' windows, 2048 by
        default, never bind): the context keys each slot of each block sees, against the two window conventions
        the upstream trainers use, one for every slot: speculators' W positions before the anchor
        (kv >= anchor - W), or SpecForge's and transformers' window ending at the slot's own position
        (kv >= anchor + j - (W - 1)). A rule that is neither (one position narrower or wider) is a defect; which one
        a server applies is `sliding_window_served`'s question."""
        fed = self._through_data_path(lab.batch)
        docs = fed["document_ids"]
        s, b = int(docs.shape[1]), self.block_size
        keep = lab.batch.anchor_valid[0]
        anchors = lab.batch.anchors[0][keep]
        windows = sorted({3, b + 2})
        common = dict(invariant="dflash.context_excludes_anchor", experiment="window-width",
                      hypothesis="a sliding-window layer's block sees the context positions of its document inside "
                                 "the window, by one of the upstream conventions for every slot",
                      perturbed=f"speculators' mask at sliding windows {windows} (causal within the block) on the "
                                f"probe's {int(anchors.numel())} anchors and packed documents",
                      threshold="every (slot, context key) pair as one convention says",
                      coverage={"windows": windows})
        wrong: list[str] = []
        conventions_seen: set[str] = set()
        for window in windows:
            mask = type(self.model)._create_attention_mask(self.model, docs, s, anchors, docs.device,
                                                           sliding_window=window, sliding_window_non_causal=False)
            dense = mask if isinstance(mask, Tensor) else mask.to_dense() if hasattr(mask, "to_dense") else None
            if dense is None:
                return Verdict(status="unknown", measurement="", reason=f"the mask is a {type(mask).__name__}, not "
                               "readable as (query, key) pairs", **common)
            dense = dense.bool().reshape(-1, dense.shape[-2], dense.shape[-1])[0]
            fits = {"speculators (W before the anchor)": True, "transformers (window ends at the slot)": True}
            first_wrong = None
            for i, a in enumerate(anchors.tolist()):
                doc = int(docs[0, a])
                in_doc = docs[0] == doc
                for j in range(b):
                    got = dense[i * b + j, :s]
                    positions = torch.arange(s)
                    before = in_doc & (positions < a)
                    wants = {"speculators (W before the anchor)": before & (positions >= a - window),
                             "transformers (window ends at the slot)": before & (positions >= a + j - (window - 1))}
                    for name, want in wants.items():
                        if fits[name] and not torch.equal(got, want):
                            fits[name] = False
                            first_wrong = first_wrong or (a, j, int(got.sum()), {n: int(w.sum()) for n, w in wants.items()})
            chosen = [name for name, ok in fits.items() if ok]
            conventions_seen |= set(chosen)
            if not chosen:
                a, j, count, counts = first_wrong
                wrong.append(f"window {window}: slot {j} of the block at {a} sees {count} context positions, where "
                             + " or ".join(f"{n} gives {c}" for n, c in counts.items()))
        measurement = "; ".join(wrong) if wrong else f"windows {windows}: every slot as {', '.join(sorted(conventions_seen))}"
        if wrong:
            return Verdict(status="mismatch", measurement=measurement,
                           observed="the sliding-window mask follows no window convention: " + "; ".join(wrong),
                           expected="kv >= anchor - W (speculators) or kv >= anchor + j - (W - 1) (transformers)",
                           fix="Bound the window as speculators' reference does: kv_base_pos >= q_anchor - sliding_window.",
                           **common)
        return Verdict(status="match", measurement=measurement,
                       observed=f"the sliding-window mask follows {', '.join(sorted(conventions_seen))} at windows {windows}",
                       **common)

    def _check_saved_config(self) -> list[Verdict]:
        """What speculators saves with the drafter (`save_pretrained`, what vLLM's loader reads), for the built
        drafter and for two drafters the run's other settings build: a reduced draft vocabulary (its d2t / t2d made
        by the trainer's own `parse_vocab_mappings` from a token_freq.pt) and a partial-rotary verifier (Qwen3.5 /
        3.6 rotate a quarter of each head). Two verdicts: the export contract (every trained tensor saved, a reduced
        vocabulary's head and maps, the tokens served per step, block size, mask token) and the rotation a server
        builds from the saved layer config (theta, partial_rotary_factor) against the one the drafter trained with."""
        import json

        perturbed = (f"nothing: the built drafter, one with a draft vocabulary of {DRAFT_VOCAB} (maps from the trainer's "
                     f"token-frequency path) and one on a verifier with partial_rotary_factor {PARTIAL_ROTARY}, each "
                     "saved with save_pretrained and read back")
        export = dict(invariant="dflash.export_contract", experiment="saved-config", perturbed=perturbed,
                      hypothesis="the saved drafter holds what the loader reads, as it trained: every trained tensor, a "
                                 "reduced vocabulary's lm_head and d2t / t2d naming the same tokens, speculative_tokens "
                                 "= B - 1 (B with sample_from_anchor), its block size and mask token",
                      threshold="the export contract's rules; equal values")
        rope = dict(invariant="dflash.rope_served_as_trained", experiment="saved-config", perturbed=perturbed,
                    hypothesis="the rotation a server builds from the saved layer config (rotary dims = head_dim x "
                               "partial_rotary_factor, theta) is the one the drafter's rotary applied in training",
                    threshold="equal inverse frequencies (rtol 1e-5)")
        found: dict[str, list[str]] = {"export": [], "rope": []}
        parts: list[str] = []
        try:
            reduced, map_problems = self._draft_vocab_drafter()
            found["export"] += map_problems
            built = {"built": self.model, f"draft vocabulary {DRAFT_VOCAB}": reduced,
                     f"partial-rotary verifier ({PARTIAL_ROTARY})": self._drafter_on_partial_rotary_verifier()}
            for label, model in built.items():
                saved = self.scratch / f"saved-{len(parts)}"
                model.save_pretrained(str(saved))
                config = json.loads((saved / "config.json").read_text())
                wrong_export, wrong_rope = _saved_problems(model, saved, config, self.block_size)
                found["export"] += [f"{label}: {p}" for p in wrong_export]
                found["rope"] += [f"{label}: {p}" for p in wrong_rope]
                found.setdefault("window", []).extend(f"{label}: {p}" for p in _window_problems(config))
                parts.append(f"{label}: {'; '.join(wrong_export + wrong_rope) or 'as trained'}")
        except Exception as exc:  # noqa: BLE001 - a drafter that cannot be built or saved here says nothing of the export
            reason = (f"a drafter could not be built or saved: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}")
            return [Verdict(status="unknown", measurement="; ".join(parts), reason=reason, **common)
                    for common in (export, rope)]
        measurement = "; ".join(parts)
        verdicts = []
        if found.get("window"):
            # Mismatch only: a consistent window here says nothing of the window a server applies
            verdicts.append(Verdict(
                invariant="dflash.sliding_window_served", experiment="saved-config", perturbed=perturbed,
                hypothesis="a layer the saved config calls sliding_attention carries the window it trained with",
                threshold="a positive sliding_window, use_sliding_window not false, wherever a layer is sliding",
                status="mismatch", measurement=measurement, expected="the trained window on every sliding layer",
                observed="the saved layer config has sliding layers without a window: " + "; ".join(found["window"][:3])
                         + " (the drafter trained, and is served, with full attention where its layer types say "
                           "sliding, or a server picks one reading and training the other)",
                fix="Set use_sliding_window (and sliding_window) whenever any layer is sliding_attention."))
        if found["export"]:
            verdicts.append(Verdict(
                status="mismatch", measurement=measurement, expected="what the loader reads, as the drafter trained",
                observed="the saved drafter is loaded otherwise than it trained: " + "; ".join(found["export"][:4]),
                fix="Save speculative_tokens = block_size - 1 for DFlash (slot 0 is the anchor), the block size and mask "
                    "token the drafter trained with, every trained tensor, and for a reduced vocabulary its lm_head and "
                    "d2t / t2d maps that name the same tokens.", **export))
        else:
            verdicts.append(Verdict(
                status="match", measurement=measurement, observed="the saved drafters hold what the loader reads",
                not_exercised=["the weights of a checkpoint written by speculators' training loop (its Checkpointer; "
                               "save_pretrained of the built drafters was read)"], **export))
        if found["rope"]:
            verdicts.append(Verdict(
                status="mismatch", measurement=measurement, expected="the trained rotation",
                observed="a server rotates the saved drafter otherwise than it trained: " + "; ".join(found["rope"][:3]),
                fix="Drop the verifier's partial_rotary_factor from the drafter's layer config (the drafter rotates its "
                    "whole head), or train with the rotation the config serves.", **rope))
        else:
            verdicts.append(Verdict(
                status="match", measurement=measurement, observed="the saved rotation is the trained one",
                not_exercised=["scaled ropes (YaRN, linear), mRoPE sections and the pair layout (is_neox_style)"],
                **rope))
        return verdicts

    def _converted_checkpoints(self) -> list[Verdict]:
        """speculators' converter for external DFlash checkpoints (`speculators convert`, convert/dflash), on two
        z-lab-layout checkpoints written from the built drafter: one as z-lab saves it, one Laguna-style (fused
        qkv_proj, and an fc one tap wider whose last tap is the verifier's last layer, which the converter drops).
        The converted checkpoint must carry the source's mask token, each kept tap's fc columns, every other tensor,
        the layer ids in speculators' convention (z-lab id + 1) and the block size."""
        import json

        from safetensors.torch import load_file, save_file

        from speculators.convert.dflash.converter import DFlashConverter

        layer = {k: v for k, v in self.model.config.transformer_layer_config.to_dict().items()
                 if not k.startswith("_") and k != "transformers_version"}
        hidden, depth = int(layer["hidden_size"]), int(self.target.num_layers)
        zlab_ids = [i - 1 for i in self.model.target_layer_ids]
        body = {k: v.detach().clone().contiguous() for k, v in self.model.state_dict().items()
                if not k.startswith(("embed_tokens.", "lm_head.", "verifier_")) and k not in ("d2t", "t2d")}
        mask = int(self.model.mask_token_id)
        problems: dict[str, list[str]] = {"dflash.mask_token_distinct": [], "dflash.fc_input_layers": [],
                                          "dflash.export_contract": []}
        g = torch.Generator().manual_seed(29)
        for style in ("z-lab", "fused qkv, fc one tap wider"):
            source = dict(body)
            ids = list(zlab_ids)
            if style != "z-lab":
                ids.append(depth - 1)  # the verifier's last layer: implicit in speculators, dropped by the converter
                source["fc.weight"] = torch.cat([body["fc.weight"], torch.randn(hidden, hidden, generator=g)], dim=1)
                for name in [k for k in body if k.endswith("self_attn.q_proj.weight")]:
                    stem = name[: -len("q_proj.weight")]
                    parts = [source.pop(f"{stem}{p}_proj.weight") for p in "qkv"]
                    source[f"{stem}qkv_proj.weight"] = torch.cat(parts, dim=0)
            where = self.scratch / f"convert-{len(ids)}"
            (where / "source").mkdir(parents=True, exist_ok=True)
            config = {**layer, "architectures": ["DFlashDraftModel"], "block_size": self.block_size,
                      "num_target_layers": depth, "dflash_config": {"mask_token_id": mask, "target_layer_ids": ids}}
            (where / "source" / "config.json").write_text(json.dumps(config))
            save_file(source, str(where / "source" / "model.safetensors"), metadata={"format": "pt"})
            DFlashConverter().convert(where / "source", where / "converted", base_model=str(self.verifier),
                                      validate=False)
            converted = json.loads((where / "converted" / "config.json").read_text())
            tensors = load_file(str(where / "converted" / "model.safetensors"))
            if converted.get("mask_token_id") != mask:
                problems["dflash.mask_token_distinct"].append(
                    f"{style}: the converted config's mask_token_id is {converted.get('mask_token_id')}, the source "
                    f"trained with {mask}")
            fc = tensors.get("fc.weight")
            want_fc = body["fc.weight"]
            if fc is None or fc.shape != want_fc.shape or not torch.equal(fc.float(), want_fc.float()):
                moved = [] if fc is None or fc.shape != want_fc.shape else [
                    i for i in range(len(zlab_ids)) if not torch.equal(fc[:, i * hidden:(i + 1) * hidden].float(),
                                                                       want_fc[:, i * hidden:(i + 1) * hidden].float())]
                problems["dflash.fc_input_layers"].append(
                    f"{style}: the converted fc.weight does not carry the source's columns of "
                    + (f"taps {moved} (of {len(zlab_ids)})" if moved else "its taps")
                    + " - the converted drafter reads other layers through the source's weights")
            others = [k for k in body if k != "fc.weight" and (k not in tensors or not torch.equal(
                tensors[k].float(), body[k].float()))]
            if others:
                problems["dflash.export_contract"].append(f"{style}: {len(others)} tensor(s) differ from the source: "
                                                          + ", ".join(others[:3]))
            if converted.get("aux_hidden_state_layer_ids") != [i + 1 for i in zlab_ids]:
                problems["dflash.export_contract"].append(
                    f"{style}: aux_hidden_state_layer_ids {converted.get('aux_hidden_state_layer_ids')} for z-lab ids "
                    f"{ids} (want {[i + 1 for i in zlab_ids]})")
            if converted.get("block_size") != self.block_size:
                problems["dflash.export_contract"].append(
                    f"{style}: block_size {converted.get('block_size')}, the source's {self.block_size}")
        hypotheses = {
            "dflash.mask_token_distinct": "a converted checkpoint carries the mask token the source drafter trained with",
            "dflash.fc_input_layers": "a converted checkpoint's fc reads each kept target layer through the source's "
                                      "own columns for it",
            "dflash.export_contract": "a converted checkpoint carries the source's tensors, its layer ids in "
                                      "speculators' convention and its block size"}
        verdicts = []
        for invariant, found in problems.items():
            common = dict(invariant=invariant, experiment="convert-dflash", hypothesis=hypotheses[invariant],
                          perturbed="nothing: z-lab-layout checkpoints of the built drafter (one plain, one with fused "
                                    "qkv_proj and an fc one tap wider) converted with speculators' DFlashConverter",
                          measurement="; ".join(found) or "converted as the source", threshold="equal values")
            if found:
                verdicts.append(Verdict(status="mismatch", observed="; ".join(found[:3]), expected="the source's values",
                                        fix="Carry the source's mask_token_id (dflash_config), fc columns (the first "
                                            "k x H: the taps kept) and tensors into the converted checkpoint.",
                                        **common))
            else:
                verdicts.append(Verdict(status="match", observed="converted as the source", **common))
        return verdicts

    def _token_frequencies(self, _lab: Any) -> Verdict:
        """speculators' `save_token_frequency_distribution` (what data generation writes as token_freq.pt, the draft
        vocabulary's source) over conversations whose supervised spans end on a token of their own and follow prompt
        tokens of their own: the counts must be those of the supervised tokens, span edges included."""
        from collections import Counter

        from speculators.train.vocab_mapping import save_token_frequency_distribution

        g = torch.Generator().manual_seed(17)
        vocab = int(self.target.vocab_size)
        conversations, want = [], Counter()
        for _ in range(3):
            ids, mask = [], []
            for _turn in range(2):
                prompt = torch.randint(2, vocab // 2, (5,), generator=g).tolist()
                answer = torch.randint(vocab // 2, vocab - 2, (6,), generator=g).tolist() + [EOS_TOKEN]
                ids += prompt + answer
                mask += [0] * len(prompt) + [1] * len(answer)
            item = {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask)}
            conversations.append(item)
            want.update(item["input_ids"][item["loss_mask"].bool()].tolist())
        where = self.scratch / "token-frequencies" / "token_freq.pt"
        where.unlink(missing_ok=True)
        save_token_frequency_distribution(conversations, where)
        counted = {int(k): int(v) for k, v in torch.load(where, weights_only=True).items()}
        common = dict(invariant="dflash.target_tables_resolve", experiment="token-frequencies",
                      hypothesis="the token frequencies a reduced draft vocabulary is built from count the supervised "
                                 "tokens, each span's first and last included",
                      perturbed="3 conversations of 2 turns: prompt tokens unsupervised, answers supervised and ending "
                                "on eos",
                      measurement=f"{sum(counted.values())} tokens counted over {len(counted)} ids; "
                                  f"{sum(want.values())} supervised over {len(want)} ids",
                      threshold="equal counts per id", coverage={"conversations": 3, "turns": 2})
        if counted != dict(want):
            extra = sorted(set(counted) - set(want))[:4]
            short = sorted(t for t in want if counted.get(t, 0) < want[t])[:4]
            return Verdict(status="mismatch",
                           observed=f"token_freq counts other tokens than the supervised ones: ids {extra} counted "
                                    f"though never supervised, ids {short} under-counted; the draft vocabulary built "
                                    "from it keeps other tokens than the ones the drafter must draft",
                           expected="the count of every supervised token", fix="Count input_ids[loss_mask] as they "
                           "are (no shift): the drafter drafts the supervised tokens themselves.", **common)
        return Verdict(status="match", observed="the supervised tokens' counts, span edges included", **common)

    def _draft_vocab_drafter(self) -> tuple[nn.Module, list[str]]:
        """The drafter `--draft-vocab-size` builds, and what is wrong with its maps: the maps from the trainer's own
        path (`parse_vocab_mappings`, which generates them from data_path/token_freq.pt), checked against the
        frequencies they came from. Built once; the saved-config and optimizer checks both read it."""
        if getattr(self, "_draft_vocab", None) is None:
            problems: list[str] = []
            self._draft_vocab = (self._build_draft_vocab_drafter(problems), problems)
        model, problems = self._draft_vocab
        return model, list(problems)

    def _build_draft_vocab_drafter(self, problems: list[str]) -> nn.Module:
        from speculators.train.cli import build_draft_model, parse_vocab_mappings

        data = self.scratch / "data-draft-vocab"
        data.mkdir(exist_ok=True)
        vocab = self.target.vocab_size
        # frequencies not monotone in the id, so a map kept in frequency order is told from one in id order
        freq = {t: int(1 + (t * 37) % vocab) for t in range(1, vocab)}
        torch.save(freq, data / "token_freq.pt")
        args = argparse.Namespace(**{**self.flat, "verifier_name_or_path": str(self.verifier), "draft_attn_impl": "sdpa",
                                     "from_pretrained": None, "draft_config": None, "data_path": str(data),
                                     "draft_vocab_size": DRAFT_VOCAB, "d2t_path": None, "t2d_path": None,
                                     "token_freq_path": None, "trust_remote_code": False})
        d2t, t2d, draft_vocab = parse_vocab_mappings(args)
        want = sorted(sorted(freq, key=lambda t: (-freq[t], t))[:DRAFT_VOCAB])
        picked = (torch.arange(d2t.numel()) + d2t).tolist()
        if sorted(picked) != want:
            problems.append(f"draft vocabulary {DRAFT_VOCAB}: the maps keep {len(set(picked) & set(want))} of the "
                            f"{DRAFT_VOCAB} most frequent tokens")
        model = build_draft_model(args, self.model_class, t2d, d2t, draft_vocab).float()
        return model

    def _drafter_on_partial_rotary_verifier(self) -> nn.Module:
        """The drafter built on a verifier whose rope_parameters carry partial_rotary_factor (the default draft
        construction: the verifier's config gives the layer config)."""
        import json

        from speculators.train.cli import build_draft_model

        where = self.scratch / "verifier-partial-rotary"
        if not (where / "config.json").is_file():
            write_target_dir(self.target, where)
            config = json.loads((where / "config.json").read_text())
            rope = dict(config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta")})
            config["rope_parameters"] = {**rope, "partial_rotary_factor": PARTIAL_ROTARY}
            (where / "config.json").write_text(json.dumps(config))
        args = argparse.Namespace(**{**self.flat, "verifier_name_or_path": str(where), "draft_attn_impl": "sdpa",
                                     "from_pretrained": None, "draft_config": None})
        return build_draft_model(args, self.model_class, None, None, self.target.vocab_size).float()

    def _check_optimizer_rates(self) -> Verdict:
        """speculators' build_optimizers, as its trainer calls it, over the run's optimizer settings, and with a
        Muon rate of its own (10 x lr, the best-practices recipe's ratio) where the run's Muon rate is the default
        (unset: lr): each optimizer's groups must carry their configured rate."""
        from speculators.train.optimizers import build_optimizers

        keys = ("optimizer", "lr", "weight_decay", "muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns_steps",
                "muon_adjust_lr_fn")
        base = {k: self.flat.get(k) for k in keys}
        settings = [("the run's settings", base)]
        if base.get("optimizer") == "muon" and base.get("muon_lr") in (None, base.get("lr")):
            settings.append(("muon_lr 10 x lr (probe choice)", {**base, "muon_lr": 10 * float(base["lr"])}))
        elif base.get("optimizer") != "muon" and "optimizer" not in self.sources:
            # No run config chose the optimizer: the code's other one (the best-practices recipe's Muon) is a path a
            # run of this code takes with one flag, so it is exercised too. A config that says adamw excludes it.
            settings.append(("Muon, muon_lr 10 x lr (probe choice: no run config chose the optimizer)",
                             {**base, "optimizer": "muon", "muon_lr": 10 * float(base["lr"])}))
        muon_settings = [(label, config) for label, config in settings if config.get("optimizer") == "muon"]
        common = dict(invariant="dflash.optimizer_schedule", experiment="optimizer-rates",
                      hypothesis="each optimizer the trainer builds trains its parameters at the configured rate "
                                 "(Muon: muon_lr, AdamW: lr); Muon orthogonalises hidden matrices only, never a "
                                 "vocabulary's embedding or head",
                      perturbed="; ".join(label for label, _ in settings)
                      + (f"; Muon's split on a drafter with a draft vocabulary of {DRAFT_VOCAB} (its lm_head trained)"
                         if muon_settings else ""),
                      threshold="equal rates; no vocabulary-shaped parameter in Muon")
        wrong, seen = [], []
        for label, config in settings:
            for optimizer in build_optimizers(self.model, SimpleNamespace(**config)):
                kind = type(optimizer).__name__
                want = float(config["muon_lr"] if kind == "Muon" else config["lr"])
                for group in optimizer.param_groups:
                    seen.append(f"{label}: {kind} lr {group['lr']:g}")
                    if abs(float(group["lr"]) - want) > 1e-12 * max(want, 1e-30):
                        wrong.append(f"{kind} at lr {group['lr']:g} where {label} give {want:g}")
        if muon_settings:
            reduced, _map_problems = self._draft_vocab_drafter()
            names = {id(p): n for n, p in reduced.named_parameters()}
            for label, config in muon_settings:
                for optimizer in build_optimizers(reduced, SimpleNamespace(**config)):
                    if type(optimizer).__name__ != "Muon":
                        continue
                    vocab_shaped = [names.get(id(p), "?") for group in optimizer.param_groups for p in group["params"]
                                    if DRAFT_VOCAB in tuple(p.shape)]
                    seen.append(f"{label}, draft vocabulary {DRAFT_VOCAB}: {len(vocab_shaped)} vocabulary-shaped "
                                "parameter(s) in Muon")
                    if vocab_shaped:
                        wrong.append(f"Muon orthogonalises and steps {', '.join(vocab_shaped)} (the reduced "
                                     f"vocabulary's head, trained) at muon_lr {config['muon_lr']:g} instead of AdamW at "
                                     f"lr {config['lr']:g}")
                # The routing rule on the vocabulary-shaped parameters this code keeps frozen (speculators 0.9.0
                # freezes every lm_head): reported, not judged, since no step of this run takes that route.
                frozen = [p for p in reduced.parameters() if not p.requires_grad and DRAFT_VOCAB in tuple(p.shape)]
                for p in frozen:
                    p.requires_grad_(True)
                try:
                    routed = [names.get(id(p), "?") for optimizer in build_optimizers(reduced, SimpleNamespace(**config))
                              if type(optimizer).__name__ == "Muon" for group in optimizer.param_groups
                              for p in group["params"] if DRAFT_VOCAB in tuple(p.shape)]
                finally:
                    for p in frozen:
                        p.requires_grad_(False)
                if frozen:
                    seen.append(f"{label}: its frozen vocabulary-shaped parameters made trainable (no step of this "
                                f"code trains them), Muon would take {', '.join(routed) if routed else 'none of them'}")
        measurement = "; ".join(dict.fromkeys(seen))
        if wrong:
            return Verdict(status="mismatch", measurement=measurement,
                           observed="an optimizer trains at another rate than configured: " + "; ".join(wrong),
                           expected="Muon at muon_lr over hidden matrices, AdamW at lr over the rest (embeddings and "
                                    "heads included)",
                           fix="Build each optimizer with its own configured learning rate (Muon: muon_lr), and route "
                               "every embedding and vocabulary head to AdamW, trained or not.", **common)
        schedule_problems, schedule_measured = self._check_schedule_and_resume()
        measurement += "; " + schedule_measured
        if schedule_problems:
            return Verdict(status="mismatch", measurement=measurement, observed="; ".join(schedule_problems),
                           expected="warmup = ratio x the resolved total steps, the schedule from 0 up to the peak and "
                                    "down to 0 at the last step, resume from the highest epoch",
                           fix="Resolve warmup over the scheduler's total steps (max_steps where set); resume from the "
                               "numerically highest epoch directory.", **common)
        return Verdict(status="match", measurement=measurement,
                       observed="every optimizer at its configured rate; schedule and resume epoch as configured",
                       not_exercised=["gradient clipping and the order of backward, clip, optimizer and scheduler steps "
                                      "(speculators' Trainer.train_epoch, which places its batches on a GPU rank)"],
                       **common)

    def _check_schedule_and_resume(self) -> tuple[list[str], str]:
        """speculators' own schedule resolution and schedulers (train/trainer.py `_resolve_scheduler_steps`,
        `Trainer.setup_optimizer`) under the documented rules (warmup = ratio x total steps, total = max_steps where
        set, else epochs x batches; explicit warmup steps win), with a max_steps and a ratio of the probe's; and the
        epoch its checkpointer resumes from (`_get_previous_epoch`) among directories 0..11."""
        import warnings

        from speculators.train import checkpointer as checkpointing
        from speculators.train.trainer import Trainer, _resolve_scheduler_steps

        problems, parts = [], []
        batches = 50
        cases = [  # (what the probe sets, want (warmup, total))
            ({"num_epochs": 3, "max_steps": 100, "scheduler_warmup_ratio": 0.1}, (10, 100)),
            ({"num_epochs": 2, "max_steps": None, "scheduler_warmup_ratio": 0.1}, (10, 100)),
            ({"num_epochs": 2, "max_steps": None, "scheduler_warmup_steps": 7}, (7, 100)),
            ({"num_epochs": 2, "max_steps": None}, (1, 100)),
        ]
        base = {"scheduler_total_steps": None, "scheduler_warmup_steps": None, "scheduler_warmup_ratio": None}
        for given, want in cases:
            got = tuple(_resolve_scheduler_steps(SimpleNamespace(**{**base, **given}), batches))
            if got != want:
                problems.append(f"with {given} and {batches} batches per epoch the schedule resolves to (warmup, "
                                f"total) {got}, not {want}")
        parts.append(f"{len(cases)} schedule resolutions")
        keys = ("optimizer", "lr", "weight_decay", "muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns_steps",
                "muon_adjust_lr_fn", "scheduler_type", "scheduler_num_cosine_cycles")
        for kind in dict.fromkeys([str(self.flat.get("scheduler_type") or "linear"), "cosine"]):
            if kind == "none":
                continue
            config = SimpleNamespace(**{**{k: self.flat.get(k) for k in keys}, **base, "scheduler_type": kind,
                                        "num_epochs": 2, "max_steps": None, "scheduler_warmup_ratio": 0.1})
            trainer = SimpleNamespace(model=self.model, config=config, resume_from_checkpoint=False,
                                      checkpointer=None, train_loader=range(batches))
            Trainer.setup_optimizer(trainer)
            for optimizer, scheduler in zip(trainer.optimizers, trainer.schedulers):
                peak = float(scheduler.base_lrs[0])
                rates = [float(optimizer.param_groups[0]["lr"])]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # schedulers stepped without optimizer steps: only rates read
                    for _ in range(2 * batches):
                        scheduler.step()
                        rates.append(float(optimizer.param_groups[0]["lr"]))
                name = type(optimizer).__name__
                parts.append(f"{kind} {name}: start {rates[0]:.3g}, after warmup {rates[10]:.3g}, end {rates[-1]:.3g}")
                if rates[0] != 0.0 or abs(rates[10] - peak) > 1e-9 * peak or rates[-1] > 1e-9 * peak:
                    problems.append(f"the {kind} schedule of {name} runs {rates[0]:.3g} -> {rates[10]:.3g} (after the "
                                    f"10 warmup steps) -> {rates[-1]:.3g} (last step), not 0 -> {peak:g} -> 0")
        with tempfile.TemporaryDirectory(prefix="sleuth-epochs-") as where:
            for epoch in range(12):
                (Path(where) / str(epoch)).mkdir()
            holder = SimpleNamespace(path=Path(where))
            resumed = checkpointing.BaseCheckpointer._get_previous_epoch(holder)
        parts.append(f"resumes from epoch {resumed} of 0..11")
        if resumed != 11:
            problems.append(f"with epoch directories 0..11 the checkpointer resumes from epoch {resumed}, not 11")
        return problems, "; ".join(parts)

    def _collated_row(self, lab: Any) -> Verdict:
        batch = lab.batch
        fed = self._through_data_path(batch)
        valid = batch.doc_ids[0] >= 0
        compared = {
            "document_ids": (fed["document_ids"][0], batch.doc_ids[0], "dflash.context_excludes_anchor"),
            "position_ids": (fed["position_ids"][0], batch.position_ids[0], "dflash.block_position_ids"),
            "loss_mask": (fed["loss_mask"][0], batch.loss_mask[0], "dflash.target_shift"),
            "input_ids": (fed["input_ids"][0], batch.input_ids[0], "dflash.target_shift"),
        }
        wrong = {}
        for name, (got, want, _invariant) in compared.items():
            differ = (got.long() != want.long()) & valid
            if differ.any():
                wrong[name] = [int(i) for i in differ.nonzero().flatten()]
        # The cache's dtype is not the run's: every floating tensor must still reach the model in the training dtype
        # (the targets lm_head(norm(h_L)) computed at another precision than serving computes them, else).
        training_dtype = batch.hidden_states[0].dtype
        cached = self._through_data_path(batch, stored_dtype=CACHE_DTYPE)
        dtypes = {k: v.dtype for k, v in cached.items() if isinstance(v, Tensor) and v.is_floating_point()}
        off_dtype = {k: d for k, d in dtypes.items() if d != training_dtype}
        last = [d for d in batch.doc_ids[0].unique().tolist() if d >= 0][-1]
        common = dict(
            experiment="collated-row",
            hypothesis="speculators' dataset and CollateFn hand the model the packed row's documents as they are: "
                       "document ids, positions restarting per document, loss mask and tokens; a document cut at the "
                       "row's end keeps its id for the part that fits",
            perturbed=f"the row's last document (id {last}) stored {CUT_TAIL} positions longer than the row, so the "
                      f"collator cuts it; the row again from a {CACHE_DTYPE} cache with the collator asked for "
                      f"{training_dtype}",
            threshold="every valid position equal; every floating tensor handed to the model in the training dtype",
            coverage={"cut_document": last, "cut_positions": CUT_TAIL, "fields": list(compared),
                      "cache_dtype": str(CACHE_DTYPE), "training_dtype": str(training_dtype),
                      "collated_dtypes": {k: str(d) for k, d in dtypes.items()}},
        )
        if off_dtype:
            key = next(iter(off_dtype))
            invariant = "dflash.target_logits_source" if "verifier" in key or "last" in key else "dflash.fc_input_layers"
            return Verdict(invariant=invariant, status="mismatch",
                           measurement="collated dtypes from a " + str(CACHE_DTYPE) + " cache: " + ", ".join(
                               f"{k} {d}" for k, d in dtypes.items()),
                           observed=f"speculators' collator hands the model {key} in {off_dtype[key]} (the cache's "
                                    f"dtype), not the training dtype {training_dtype}: "
                           + ("the target logits are computed at another precision than the aux states and serving"
                              if invariant == "dflash.target_logits_source"
                              else "fc reads the target's states at another precision than training runs in"),
                           expected=f"every hidden-state tensor in {training_dtype}",
                           fix="Cast every hidden-state tensor the collator writes (hidden_states and "
                               "verifier_last_hidden_states) to the configured hidden-state dtype.", **common)
        if not wrong:
            return Verdict(invariant="dflash.context_excludes_anchor", status="match",
                           measurement=f"{int(valid.sum())} positions compared, none differ",
                           observed="the collated row is the packed row, the cut document included, in the training "
                                    "dtype from a cache in another", **common)
        name, where = next(iter(wrong.items()))
        got, want, invariant = compared[name]
        return Verdict(invariant=invariant, status="mismatch",
                       measurement="; ".join(f"{n}: {len(w)} positions differ (first at {w[0]})" for n, w in wrong.items()),
                       observed=f"speculators' collator changes the row's {name} at {len(where)} positions (first at "
                                f"{where[0]}: {int(got[where[0]])} where the packed row has {int(want[where[0]])}); "
                                "the blocks anchored there train on another context than the documents' own",
                       expected=f"the packed row's {name}",
                       fix="Keep each packed document's id, positions and mask in the collated row, including the "
                           "part of a document cut at the row's end.", **common)

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


def _window_problems(config: dict[str, Any]) -> list[str]:
    """A saved layer config whose layer types say sliding_attention without a window to slide (Qwen3's config drops
    sliding_window to None when use_sliding_window is false)."""
    layer = config.get("transformer_layer_config") or config
    types = layer.get("layer_types") or []
    if "sliding_attention" not in types:
        return []
    window, use = layer.get("sliding_window"), layer.get("use_sliding_window")
    if isinstance(window, int) and window > 0 and use is not False:
        return []
    return [f"{types.count('sliding_attention')} of {len(types)} layers sliding_attention with sliding_window "
            f"{window}, use_sliding_window {use}"]


def _saved_problems(model: nn.Module, saved: Path, config: dict[str, Any],
                    block_size: int) -> tuple[list[str], list[str]]:
    """(export problems, rotation problems) of one saved drafter directory, by the rules sleuth's export contract
    applies (sleuth.probes.exported) and against the drafter that was saved: every trained tensor saved, a reduced
    vocabulary's head and maps, the tokens served per step, block size and mask token; and the rotation a server
    builds from the saved layer config."""
    from safetensors import safe_open

    from sleuth.probes.exported import draft_vocab_problems, drafted_per_step, served_inv_freq

    weights = saved / "model.safetensors"
    with safe_open(str(weights), framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    problems = []
    unsaved = [n for n, p in model.named_parameters() if p.requires_grad and n not in shapes]
    if unsaved:
        problems.append(f"{len(unsaved)} trained tensor(s) are not in the checkpoint: {', '.join(unsaved[:3])}")
    layer = config.get("transformer_layer_config") or {}
    draft_vocab, vocab = config.get("draft_vocab_size"), layer.get("vocab_size")
    if isinstance(draft_vocab, int) and isinstance(vocab, int) and draft_vocab < vocab:
        def read_maps() -> tuple[Tensor, Tensor]:
            with safe_open(str(weights), framework="pt") as handle:
                return handle.get_tensor("d2t"), handle.get_tensor("t2d")

        problems += draft_vocab_problems(shapes, read_maps, draft_vocab, vocab, layer.get("hidden_size"))
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    want = {"speculative_tokens": drafted_per_step(block_size, bool(config.get("sample_from_anchor"))),
            "block_size": block_size, "mask_token_id": int(model.mask_token_id)}
    got = {"speculative_tokens": methods[0].get("speculative_tokens"), "block_size": config.get("block_size"),
           "mask_token_id": config.get("mask_token_id")}
    for key, value in want.items():
        if got[key] != value:
            problems.append(f"{key} {got[key]} (trained: {value})" + (
                "; serving drafts one token per step more than the block's B - 1 trained slots"
                if key == "speculative_tokens" else ""))
    rotation: list[str] = []
    served = served_inv_freq(layer)
    trained = getattr(getattr(model, "rotary_emb", None), "inv_freq", None)
    if isinstance(served, Tensor) and isinstance(trained, Tensor):
        trained = trained.detach().double().cpu()
        if served.shape != trained.shape:
            rotation.append(f"served rotation turns {2 * served.numel()} dims per head, training turned "
                            f"{2 * trained.numel()}")
        elif not torch.allclose(served, trained, rtol=1e-5, atol=0.0):
            rotation.append("served rotation frequencies differ from the trained ones (theta or scaling)")
    return problems, rotation


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
