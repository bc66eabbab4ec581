"""The one configuration object of a training run.

Every switch that the seed's history needs is an explicit, validated field whose default is the
reference value (vllm-project/speculators, z-lab/dflash; see ../shared/DFLASH.md for citations). The fully
resolved config is saved as `config.json` in the run directory: it is half of the contract that `sleuth`
reads, so field names and meanings only change with a CHANGELOG entry.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainer.safe_io import JsonTooDeep, UnsafeFileError, loads_json, read_limited

CONFIG_SCHEMA_VERSION = 1

# Bounds that keep a typo from hanging or exhausting the machine; each is far above any real DFlash run.
MAX_BLOCK_SIZE = 64
MAX_SEQ_LEN = 2**20
MAX_EVAL_PROMPTS = 10_000
MAX_EVAL_NEW_TOKENS = 16_384
MAX_SEED = 2**63  # exclusive: torch generators take a signed 64-bit seed
MAX_CONFIG_FILE_BYTES = 2**20
# A config file expands to at most this many YAML nodes once aliases are followed: a real config has a few
# hundred; an alias bomb ("billion laughs") has billions and must fail before it is expanded.
MAX_YAML_NODES = 100_000


class ConfigError(ValueError):
    """A user's config is wrong; the message is one line that says what and where."""


DraftLayerType = Literal["full_attention", "sliding_attention"]


def refuse_booleans(model: type[BaseModel], values: Any, prefix: str) -> Any:
    """A boolean where a field takes a number or a name is an error: pydantic would read `true` as 1, so
    `--set target_logits_source=true` would train toward layer 1. One rule for every config section."""
    if isinstance(values, dict):
        for key, value in values.items():
            field = model.model_fields.get(key)
            items = value if isinstance(value, (list, tuple)) else [value]
            if field is not None and field.annotation is not bool and any(isinstance(v, bool) for v in items):
                raise ValueError(f"{prefix}{key} takes a number or a name, not a boolean (got {value!r})")
    return values


class DraftConfig(BaseModel):
    """The drafter's own shape where it differs from the target's: every field None is the target's value.

    The fields are Qwen3Config's (the drafter's layers are Qwen3 decoder layers). The width stays the
    target's hidden size: the fused context and the target's embeddings / lm_head live in that space.
    Resolved against the target by trainer/model/drafter.py `draft_config_from_target`; the resolved
    values are in run.json `drafter` and in every export's config.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    num_attention_heads: int | None = Field(
        None, ge=1, le=1024, description="Query heads. Alone, it also sets head_dim = hidden // heads and "
        "num_key_value_heads = heads (the target's values belong to the target's head count).")
    num_key_value_heads: int | None = Field(None, ge=1, le=1024, description="K/V heads; must divide the query heads.")
    head_dim: int | None = Field(None, ge=2, le=1024, description="Per-head width (even: RoPE rotates pairs).")
    intermediate_size: int | None = Field(None, ge=1, description="MLP width.")
    layer_types: list[DraftLayerType] | None = Field(
        None, description="One per drafter layer: 'full_attention' or 'sliding_attention' (a window over the "
        "context before the anchor; trainer/model/attention_mask.py). None: every layer full attention.")
    sliding_window: int | None = Field(
        None, ge=1, le=MAX_SEQ_LEN, description="W of the sliding_attention layers: context positions "
        "anchor-W .. anchor-1 (speculators' semantics); at least block_size.")
    sliding_window_non_causal: bool = Field(
        False, description="Sliding layers attend bidirectionally within the block (speculators' flag); "
        "False: causally (speculators' and the published Qwen3.6 drafter's default). Full layers always "
        "attend bidirectionally.")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base; None: the target's.")
    rope_parameters: dict[str, Any] | None = Field(
        None, description="The whole RoPE (transformers 5 `rope_parameters`: rope_type, rope_theta, scaling "
        "factors) instead of the target's. The drafter rotates its whole head with 1-D positions, so neither "
        "partial_rotary_factor below 1 nor mRoPE sections are accepted.")

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, values: Any) -> Any:
        return refuse_booleans(cls, values, "draft_config.")

    @field_validator("rope_parameters")
    @classmethod
    def _rope_the_drafter_can_rotate(cls, rope: dict[str, Any] | None) -> dict[str, Any] | None:
        if rope is None:
            return None
        partial = rope.get("partial_rotary_factor", 1.0)
        if not isinstance(partial, (int, float)) or isinstance(partial, bool) or partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial!r}: the drafter's Qwen3 layers rotate the whole head; "
                             "drop the key (speculators #613: a copied 0.25 is served as a quarter-head rotation)")
        for key in ("mrope_section", "mrope_interleaved"):
            if key in rope:
                raise ValueError(f"{key}: the drafter's positions are 1-D text positions (plain RoPE); drop the key")
        theta = rope.get("rope_theta")
        if isinstance(theta, str):  # YAML 1.1 reads `1e7` (no dot) as a string
            try:
                theta = float(theta)
            except ValueError:
                pass
        if theta is not None and (not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0
                                  or not math.isfinite(theta)):
            raise ValueError(f"rope_theta must be a positive number, got {theta!r}")
        return rope if theta is None else {**rope, "rope_theta": float(theta)}

    @model_validator(mode="after")
    def _attention_consistent(self) -> DraftConfig:
        slides = "sliding_attention" in (self.layer_types or [])
        if slides and self.sliding_window is None:
            raise ValueError("draft_config.layer_types has sliding_attention layers but no sliding_window")
        if self.sliding_window is not None and not slides:
            raise ValueError(f"draft_config.sliding_window {self.sliding_window} is set but no layer is "
                             "sliding_attention: set draft_config.layer_types")
        if self.sliding_window_non_causal and not slides:
            raise ValueError("draft_config.sliding_window_non_causal only applies to sliding_attention layers")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv is not None and heads % kv:
            raise ValueError(f"draft_config.num_attention_heads {heads} is not divisible by num_key_value_heads {kv}")
        if self.head_dim is not None and self.head_dim % 2:
            raise ValueError(f"draft_config.head_dim {self.head_dim} must be even (RoPE rotates pairs)")
        if self.rope_theta is not None and self.rope_parameters is not None:
            raise ValueError("draft_config sets both rope_theta and rope_parameters; put rope_theta in rope_parameters")
        return self

    def as_shape(self) -> dict[str, Any]:
        """The overrides for trainer.model.drafter.draft_config_from_target (None = the target's)."""
        return self.model_dump()


DrafterKind = Literal["dflash", "dflash2", "dspark"]


class DFlash2Config(BaseModel):
    """DFlash2's additions to the DFlash drafter (drafter_kind: dflash2); defaults are speculators 0.9.0's
    (models/dflash2/config.py:26-45 for the shape, train/config/schema.py for selector_loss_alpha).

    Each decoder layer wraps attention and MLP in grouped dynamic causal convolutions over the block's own
    slots (taps never cross a block boundary), and a candidate selector re-ranks the unary top-k with a
    bilinear predecessor x hidden x candidate score (trainer/model/dflash2.py).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    conv_kernel_size: int = Field(2, ge=1, le=MAX_BLOCK_SIZE,
                                  description="Taps of each convolution (the slot itself and k-1 before it); <= block_size.")
    conv_group_size: int = Field(16, ge=1, description="Hidden channels that share one dynamic tap; must divide the "
                                 "hidden size.")
    selector_rank: int = Field(256, ge=1, le=65536, description="Rank r of the selector's codebooks [V, r] and of its "
                               "hidden projection H -> r.")
    selector_top_k: int = Field(16, ge=1, le=4096, description="Unary candidates K the selector re-ranks (at most the "
                                "vocabulary).")
    selector_loss_alpha: float = Field(1.0, ge=0, description="Weight of the selector's K-way cross entropy next to "
                                       "the unary loss.")

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, values: Any) -> Any:
        return refuse_booleans(cls, values, "dflash2.")


class DSparkConfig(BaseModel):
    """DSpark's additions to the DFlash drafter (drafter_kind: dspark). Defaults are speculators 0.9.0's
    (speculators/models/dspark/config.py, core.py `get_trainer_kwargs`); /work/shared/DFLASH_FAMILY.md, DSpark.

    The main loss term is the run's `loss` (ce | kl; speculators' DSpark default is kl_div) with the run's
    loss_decay_gamma, normalised as speculators does (per row: sum(decay * mask * loss) / sum(mask)).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    sample_from_anchor: bool = Field(
        True, description="True (DSpark): slot k predicts token a+k+1, slot 0 is trained (weight 1) and a block "
        "proposes B tokens. False: DFlash's slot rule (slot k predicts a+k, slot 0 untrained, B-1 proposals).")
    markov_rank: int = Field(
        256, ge=0, le=65536, description="Rank r of the Markov logit bias W2 . W1[prev] (W1: verifier vocabulary "
        "x r, W2: r x draft vocabulary); 0: no Markov head.")
    markov_head_type: Literal["vanilla", "gated", "rnn"] = Field(
        "vanilla", description="'vanilla': W2 W1[prev]; 'gated': W2 (sigmoid(G[h; W1[prev]]) * W1[prev]); "
        "'rnn': a gated recurrent state over the block's slots.")
    enable_confidence_head: bool = Field(
        True, description="A Linear(H [+ r], 1) per slot trained toward the slot's acceptance rate 1 - TV.")
    confidence_head_with_markov: bool = Field(
        True, description="The confidence head also reads W1[prev] (needs markov_rank > 0).")
    confidence_head_alpha: float = Field(
        1.0, ge=0, description="Weight of the confidence head's BCE in the loss.")
    draft_confidence_min: float | None = Field(
        None, gt=0, le=1, description="Decoding (eval) only: draft slot k while the confidence head's predicted "
        "chance that slots up to k are all accepted, prod sigmoid(c_j), is at least this (at least one slot); "
        "llama.cpp's --spec-draft-conf-min. None: every slot drafts. Needs the confidence head.")

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, values: Any) -> Any:
        return refuse_booleans(cls, values, "dspark.")

    @model_validator(mode="after")
    def _heads_consistent(self) -> DSparkConfig:
        if self.draft_confidence_min is not None and not self.enable_confidence_head:
            raise ValueError("dspark.draft_confidence_min needs the confidence head (enable_confidence_head: true)")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError("dspark.confidence_head_with_markov requires dspark.markov_rank > 0 (or set "
                             "confidence_head_with_markov: false)")
        return self


class TrainConfig(BaseModel):
    # allow_inf_nan=False: `lr: .inf` or `nan` would train to NaN losses and call the run completed.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    schema_version: int = CONFIG_SCHEMA_VERSION

    # --- what is trained on -------------------------------------------------------------------------
    target: str = Field(
        "embedded",
        description="'embedded' (the small Qwen3 target built by `trainer target build`), 'embedded-qwen3_5' "
        "(a tiny qwen3_5 hybrid built the same way on first use) or the path of any Hugging Face causal-LM "
        "directory, loaded with AutoModelForCausalLM.from_pretrained.",
    )
    data: str = Field(
        "embedded",
        description="'embedded' (the deterministic embedded corpus) or a path: .jsonl of chat "
        "conversations ('messages' or ShareGPT 'conversations'; loss on assistant tokens) or of "
        "{'text': ...} rows, or a .txt file (documents separated by blank lines).",
    )

    hidden_states: str | None = Field(
        None,
        description="A directory written by `trainer hidden-states generate` for this target, data and "
        "seq_len: the run reads the target's layers from it and loads only the target's embeddings, final "
        "norm and lm_head (eval, when on, loads the whole target when it first runs). A directory of "
        "speculators' offline hidden states (hs_<i>.safetensors, or its parent) is read too.",
    )
    hidden_states_layers: list[int] | None = Field(
        None,
        description="For speculators' hidden states only: the --target-layer-ids the vLLM server extracted "
        "(vLLM's convention, id i = HF hidden_states[i], without the final layer launch_vllm.py appends); "
        "their files do not record them (required for such a directory).",
    )

    # --- DFlash architecture: the invariants sleuth checks ---------------------------------------------
    drafter_kind: DrafterKind = Field(
        "dflash",
        description="Which member of the DFlash family is trained: 'dflash' (the drafter as published); "
        "'dflash2' (local dynamic convolutions and a candidate selector; settings under `dflash2`); 'dspark' "
        "(DFlash plus a Markov logit head and a confidence head; settings under `dspark`).",
    )
    dflash2: DFlash2Config = Field(
        default_factory=DFlash2Config,
        description="DFlash2's convolutions and candidate selector (used with drafter_kind: dflash2).",
    )
    dspark: DSparkConfig | None = Field(
        None, description="DSpark's settings (drafter_kind: dspark only; filled with speculators' defaults).")
    block_size: int = Field(8, ge=1, le=MAX_BLOCK_SIZE, description="Tokens per draft block: slot 0 anchor + B-1 masks.")
    draft_layers: int = Field(5, ge=1, le=64, description="Qwen3-style decoder layers in the drafter.")
    draft_config: DraftConfig = Field(
        default_factory=DraftConfig,
        description="The drafter's own heads, head_dim, MLP width, per-layer attention (layer_types, "
        "sliding_window) and RoPE where they differ from the target's (DraftConfig; empty: the target's).",
    )
    target_layer_ids: list[int] | None = Field(
        None,
        description="Target decoder layers whose outputs condition the drafter (z-lab convention: id i is "
        "HF hidden_states[i+1]). None: the layer rule of default_target_layer_ids (z-lab's "
        "round(1 + i*(L-4)/(k-1)) for k = draft_layers, [L//2] for k = 1; fewer layers on shallow targets).",
    )
    fc_layers: list[int] | None = Field(
        None,
        description="Indices into target_layer_ids of the layers concatenated into fc. None: all of them "
        "(the reference). A subset reproduces the v5 bug.",
    )
    target_logits_source: Literal["final", "last_selected"] | int = Field(
        "final",
        description="'final': targets are the target model's real output lm_head(norm(h_L)). An integer "
        "layer id takes lm_head(norm(h_id)) of that intermediate layer instead (the v5 bug); "
        "'last_selected' is the last of target_layer_ids, resolved to its id when the run starts.",
    )
    loss: Literal["ce", "kl"] = Field("ce", description="ce: against the target's argmax; kl: to its softmax.")
    loss_decay_gamma: float | None = Field(
        4.0, gt=0, description="Slot k >= 1 weighs exp(-(k-1)/gamma); None disables the decay."
    )
    loss_weighting: Literal["decay", "dpace"] = Field(
        "decay",
        description="'decay': slot k >= 1 weighs exp(-(k-1)/loss_decay_gamma) (DFlash as published). "
        "'dpace': D-PACE, weights from the drafter's own confidence (speculators' current DFlash default; "
        "needs loss: ce; loss_decay_gamma is then unused).",
    )
    dpace_alpha: float = Field(0.5, gt=0, le=1, description="D-PACE confidence smoothing, in (0, 1].")
    context_includes_anchor: bool = Field(
        False,
        description="False (reference): a block sees context strictly before its anchor. True lets it see "
        "the anchor's own hidden state, which does not exist at inference (the v6 bug).",
    )
    max_anchors: int = Field(32, ge=1, description="Anchors sampled per packed sequence (reference: 512).")
    draft_vocab_size: int | None = Field(
        None, ge=2,
        description="Reduced draft vocabulary: the drafter predicts only the N most frequent supervised tokens "
        "of the training data (speculators' --draft-vocab-size; d2t/t2d saved with the run). None: the target's.",
    )
    mask_token_id: int | None = Field(
        None, description="None: the tokenizer's mask token, else an unused embedding row."
    )

    # --- optimisation ----------------------------------------------------------------------------------
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="'adamw' for every weight; 'muon': torch.optim.Muon for the 2-D weight matrices, AdamW "
        "for the rest (norms), as speculators splits them.",
    )
    muon_lr: float | None = Field(None, gt=0, description="Peak lr of the Muon group; None: lr (speculators).")
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    muon_weight_decay: float = Field(0.1, ge=0)
    muon_ns_steps: int = Field(5, ge=1, le=20, description="Newton-Schulz iterations.")
    muon_adjust_lr_fn: Literal["original", "match_rms_adamw"] = Field(
        "match_rms_adamw", description="Muon's lr adjustment; 'match_rms_adamw' matches AdamW's update RMS."
    )
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    grad_clip: float | None = Field(1.0, gt=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(20, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    steps: int = Field(300, ge=1)
    batch_size: int = Field(8, ge=1, description="Packed sequences per step (global, across processes).")
    seq_len: int = Field(256, ge=8, le=MAX_SEQ_LEN, description="Tokens per packed sequence.")
    seed: int = Field(0, ge=0, lt=MAX_SEED, description="Seeds the drafter's init, batches and anchors.")

    parallelism: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="Under torchrun: 'ddp' replicates the drafter on every rank; 'fsdp2' shards its weights "
        "and optimizer state (torch's fully_shard). Checkpoints are the same either way.",
    )
    target_parallelism: Literal["none", "fsdp2"] = Field(
        "none",
        description="Under torchrun: 'none' holds the whole frozen target on every rank; 'fsdp2' shards its "
        "decoder layers over the ranks (torch's fully_shard; each layer gathered for its forward, then freed), "
        "so a target larger than one device trains. Embeddings, final norm and lm_head stay whole on every rank.",
    )

    # --- bookkeeping -----------------------------------------------------------------------------------
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    eval_every: int | None = Field(
        25, ge=1, description="Speculative-decoding eval every N steps (tau in metrics.jsonl); None: off."
    )
    val_every: int | None = Field(
        None, ge=1,
        description="Validation every N steps on the held-out documents: loss, acc, position_acc, streak and "
        "eal as `split: val` rows in metrics.jsonl (the same batches every time). None: off.",
    )
    val_batches: int = Field(2, ge=1, le=1000, description="Held-out batches (of batch_size rows) per validation.")
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="Also log metrics to these trackers (their libraries must be installed; wandb runs offline "
        "unless WANDB_MODE says otherwise). metrics.jsonl is always written.",
    )
    eval_prompts: int = Field(8, ge=1, le=MAX_EVAL_PROMPTS)
    eval_max_new_tokens: int = Field(64, ge=1, le=MAX_EVAL_NEW_TOKENS)
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype; bfloat16 is for CUDA."
    )
    loss_chunk_size: int | None = Field(
        None, ge=1,
        description="Block slots whose logits the loss holds at once (rounded down to whole blocks, at least "
        "one): the loss path's peak memory grows with it, not with max_anchors x block_size x vocabulary. "
        "None: as many as fit 256 MiB of float32 logits; a run saves the number it used in config.json.",
    )

    # --- target fidelity (trainer/target/fidelity.py, `dflash.target_forward_fidelity`) ------------------
    target_packing: Literal["auto", "positions", "layer_masks", "varlen", "per_document"] = Field(
        "auto",
        description="How packed rows go through the target. auto: the first way whose fidelity check passes "
        "(varlen only on CUDA with flash-linear-attention; per_document, exact but slower, is the last resort).",
    )
    target_fidelity_tolerance: float | None = Field(
        None, gt=0,
        description="Largest max-abs difference (hidden states, logits) between the packed and the plain target "
        "forward that a run accepts. None: 1e-3 in float32, 1e-1 in bfloat16.",
    )
    allow_target_fidelity_failure: bool = Field(
        False, description="Train even when the fidelity check fails (the record in run.json says so)."
    )

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, values: Any) -> Any:
        return refuse_booleans(cls, values, "")

    @field_validator("dflash2", mode="before")
    @classmethod
    def _dflash2_null_is_defaults(cls, value: Any) -> Any:
        # `--set dflash2=null` clears a preset's section (a section is merged key by key otherwise)
        return {} if value is None else value

    @model_validator(mode="before")
    @classmethod
    def _dspark_defaults(cls, values: Any) -> Any:
        # A dspark run always saves its DSpark settings explicitly, speculators' defaults where not given.
        if isinstance(values, dict) and values.get("drafter_kind") == "dspark" and values.get("dspark") is None:
            values = {**values, "dspark": {}}
        return values

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError("each beta must be in [0, 1)")
        return betas

    @field_validator("target_layer_ids")
    @classmethod
    def _layer_ids_sorted_unique(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None:
            if not ids:
                raise ValueError("must name at least one layer")
            if any(i < 0 for i in ids) or sorted(set(ids)) != ids:
                raise ValueError("must be distinct non-negative layer ids in increasing order, e.g. [1, 3]")
        return ids

    @model_validator(mode="after")
    def _cross_field_checks(self) -> TrainConfig:
        if self.fc_layers is not None:
            k = len(self.target_layer_ids) if self.target_layer_ids is not None else self.draft_layers
            if not self.fc_layers or sorted(set(self.fc_layers)) != self.fc_layers:
                raise ValueError(f"fc_layers must be distinct increasing indices, e.g. [0, 1]; {self.fc_layers} is not")
            if self.fc_layers[0] < 0 or self.fc_layers[-1] >= k:
                raise ValueError(f"fc_layers {self.fc_layers} index outside the {k} selected target layers")
        if isinstance(self.target_logits_source, int) and self.target_logits_source < 0:
            raise ValueError("target_logits_source must be 'final' or a non-negative layer id")
        if self.target_parallelism == "fsdp2" and self.hidden_states:
            raise ValueError("target_parallelism 'fsdp2' has nothing to shard with hidden_states (the target's "
                             "layers are not loaded); drop one of them")
        if self.target_parallelism == "fsdp2" and self.target_packing == "per_document":
            raise ValueError("target_parallelism 'fsdp2' needs a packed target forward (every rank runs each "
                             "sharded layer together); per_document runs a data-dependent number of forwards")
        if self.loss_weighting == "dpace" and self.loss != "ce":
            raise ValueError("loss_weighting 'dpace' needs loss 'ce' (D-PACE weighs cross-entropy confidences)")
        if self.seq_len <= self.block_size:
            raise ValueError(f"seq_len {self.seq_len} must exceed block_size {self.block_size}")
        self._drafter_kind_checks()
        draft = self.draft_config
        if draft.layer_types is not None and len(draft.layer_types) != self.draft_layers:
            raise ValueError(f"draft_config.layer_types names {len(draft.layer_types)} layers but draft_layers is "
                             f"{self.draft_layers}")
        if draft.sliding_window is not None and draft.sliding_window < self.block_size:
            # A window shorter than a block would hide part of the context the block's own slots predict from
            # (ModelOpt and speculators' configs enforce the same bound).
            raise ValueError(f"draft_config.sliding_window {draft.sliding_window} must be at least block_size "
                             f"{self.block_size}")
        return self

    def _drafter_kind_checks(self) -> None:
        """The family member's own constraints; the ones that need the target's sizes (hidden % group,
        top_k <= vocabulary) are checked when the drafter is built (trainer/model/dflash2.py)."""
        if self.drafter_kind != "dflash2" and self.dflash2 != DFlash2Config():
            raise ValueError(f"dflash2 settings are given but drafter_kind is {self.drafter_kind!r}: set "
                             "drafter_kind: dflash2 or drop the dflash2 section")
        if self.drafter_kind == "dflash2":
            self._dflash2_checks()
        if self.drafter_kind != "dspark":
            if self.dspark is not None:
                raise ValueError(f"dspark settings are given but drafter_kind is {self.drafter_kind!r}; set "
                                 "drafter_kind: dspark or drop the dspark section")
            return
        if self.loss_weighting != "decay":
            raise ValueError("drafter_kind 'dspark' trains with loss_weighting 'decay' only (D-PACE is not "
                             "implemented for DSpark here)")
        if self.draft_vocab_size is not None:
            raise ValueError("drafter_kind 'dspark' needs the target's full vocabulary here (draft_vocab_size: null)")
        if self.parallelism == "fsdp2":
            # the heads run outside the drafter's sharded forward (trainer/run/dspark_step.py)
            raise ValueError("drafter_kind 'dspark' trains with parallelism 'ddp' (fsdp2 is not implemented for it)")

    def _dflash2_checks(self) -> None:
        settings = self.dflash2
        if settings.conv_kernel_size > self.block_size:
            raise ValueError(f"dflash2.conv_kernel_size {settings.conv_kernel_size} exceeds block_size "
                             f"{self.block_size} (the convolutions never reach across a block)")
        if self.draft_vocab_size is not None:
            # speculators 0.9.0 refuses it too (models/dflash2/core.py:38-44): the selector's codebooks and
            # its predecessors are indexed by target ids.
            raise ValueError("drafter_kind 'dflash2' needs the full target vocabulary: drop draft_vocab_size")
        if self.loss_weighting != "decay":
            raise ValueError("drafter_kind 'dflash2' trains with loss_weighting 'decay' here (D-PACE for the "
                             "selector term is not implemented)")
        if self.parallelism == "fsdp2":
            raise ValueError("drafter_kind 'dflash2' runs the candidate selector outside the drafter's forward, "
                             "which FSDP2 does not gather: use parallelism 'ddp'")

    # --- derived values ----------------------------------------------------------------------------------
    def resolved_layer_ids(self, num_target_layers: int) -> list[int]:
        """The target layer ids for an L-layer target (validated against L)."""
        ids = self.target_layer_ids or default_target_layer_ids(num_target_layers, self.draft_layers)
        if ids[-1] >= num_target_layers:
            valid = default_target_layer_ids(num_target_layers, self.draft_layers)
            raise ConfigError(
                f"target_layer_ids {ids} name a layer past the target's last ({num_target_layers - 1}); "
                f"set target_layer_ids to null for the default rule (here {valid}) or to ids below {num_target_layers}"
            )
        source = self.target_logits_source
        if isinstance(source, int) and source >= num_target_layers:
            raise ConfigError(
                f"target_logits_source {source} is past the target's last layer "
                f"({num_target_layers - 1})"
            )
        return ids

    def fc_layer_ids(self, num_target_layers: int) -> list[int]:
        """The target layer ids actually concatenated into fc, in order."""
        ids = self.resolved_layer_ids(num_target_layers)
        return ids if self.fc_layers is None else [ids[i] for i in self.fc_layers]


def default_target_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """The layer rule: z-lab's k layers evenly from 1 to L-3 (a single layer: L//2), valid for any L >= 2.

    64, 5 -> [1,16,31,46,61]; 36, 5 -> [1,9,17,25,33]: exactly z-lab's build_target_layer_ids whenever
    the target has room for k distinct layers in 1..L-3 (L >= k + 3). A shallower target gets every layer
    of that range instead (k' < k layers, so fc reads k' layers), and when the range holds a single layer
    the single-layer rule applies: with k = 5, 8 -> [1,2,3,4,5], 7 -> [1,2,3,4], 6 -> [1,2,3], 5 -> [1,2],
    4 -> [2], 3 -> [1], 2 -> [0]. The last layer (L-1) is never chosen: its HF hidden state is the
    final-normed output, which vLLM cannot capture as an auxiliary state.
    """
    if num_target_layers < 2:
        raise ConfigError(
            f"a {num_target_layers}-layer target has no layer to condition the drafter on besides its output; "
            "DFlash needs a target with at least 2 decoder layers"
        )
    start, end = 1, num_target_layers - 3
    k = min(k, end - start + 1)
    if k <= 1:
        return [min(num_target_layers // 2, num_target_layers - 2)]
    # k <= end - start + 1 keeps the step >= 1, so the rounded ids are distinct
    return [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]


# --- presets: the seed's history on the embedded target -------------------------------------------------
# Each preset is a patch on the defaults, so `fixed` is literally the reference configuration.
PRESETS: dict[str, dict[str, Any]] = {
    "fixed": {},
    # An earlier run that still beat v5: everything but the decay was already right.
    "v3": {"loss_decay_gamma": 7.0},
    # The regressed run: fc over 4 of the 5 selected layers, targets from the last selected layer (L-3)
    # instead of the model's output, gamma 7 with block 8, hard CE.
    "v5": {"fc_layers": [0, 1, 2, 3], "target_logits_source": "last_selected", "loss_decay_gamma": 7.0},
    # The seed's attempted fix: all fc layers, final logits, gamma 4, but the context includes the anchor.
    "v6": {"context_includes_anchor": True},
    # The reference's current recipe (speculators 0.9.0 `train --speculator-type dflash` defaults, from its
    # RFC "DFlash Training Best Practices", speculators #979): block 16, D-PACE (alpha 0.5) with CE, Muon on
    # the 2-D weights at the base lr with match_rms_adamw, AdamW weight decay 0.01, 5 draft layers. Its
    # 512 anchors per sequence keep their density at our CPU-sized seq_len (32, our default); lr stays ours.
    "recipe-2026": {
        "block_size": 16,
        "loss_weighting": "dpace",
        "dpace_alpha": 0.5,
        "loss": "ce",
        "optimizer": "muon",
        "muon_adjust_lr_fn": "match_rms_adamw",
        "weight_decay": 0.01,
        "draft_layers": 5,
        "val_every": 25,  # speculators validates every epoch (--train-data-ratio 0.9); we have steps, not epochs
    },
}

# The published Qwen3.6-27B drafter (z-lab/Qwen3.6-27B-DFlash; SpecForge configs/qwen3.6-27b-dflash.json,
# z-lab 1fe684b "Add Draft sliding window"): 5 Qwen3 layers at the target's width 5120, 32 / 8 heads of 128,
# MLP 17408, four sliding-window layers (W = 2048) then one full-attention layer, full rotary at theta 1e7
# (the target rotates a quarter of its 256-wide heads with interleaved mRoPE; the drafter does neither),
# block 16, taps [1, 16, 31, 46, 61] on the 64-layer target (the layer rule, target_layer_ids: null), the mask
# token from the target's tokenizer. For a real qwen3_5 target: --preset zlab-qwen3.6-27b --set target=DIR.
QWEN36_LAYER_TYPES = ["sliding_attention"] * 4 + ["full_attention"]
ZLAB_QWEN36_27B: dict[str, Any] = {
    "block_size": 16,
    "draft_layers": 5,
    "draft_config": {
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 17408,
        "layer_types": QWEN36_LAYER_TYPES, "sliding_window": 2048,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7},
    },
}
PRESETS["zlab-qwen3.6-27b"] = ZLAB_QWEN36_27B
# The same structure at 1/64 of the width on the tiny `embedded-qwen3_5` target (hidden 80, 8 layers in the
# target's 3 x linear + 1 x full pattern), so it trains on a CPU: heads 32 / 8 -> 4 / 1 (the 4:1 grouping) of
# 128 -> 16 (heads x head_dim 4096 -> 64, as hidden 5120 -> 80), MLP 17408 -> 272, and the window with the
# sequence length, 2048 of 8192 -> 32 of 128 (still two blocks of 16, so decoding on held-out prompts runs
# well past it and eval measures acceptance beyond the window); anchors keep the default density (32 per 256
# tokens -> 16 per 128). Layer types, block, rotary, theta, the layer rule (on 8 layers [1, 2, 3, 4, 5]) and
# the mask-token rule are unchanged.
PRESETS["zlab-qwen3.6"] = {
    "target": "embedded-qwen3_5",
    "block_size": 16,
    "draft_layers": 5,
    "seq_len": 128,
    "max_anchors": 16,
    "draft_config": {
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 272,
        "layer_types": QWEN36_LAYER_TYPES, "sliding_window": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7},
    },
}

# DSpark as DeepSpec publishes it (deepseek-ai/DeepSpec config/dspark/dspark_qwen3_4b_online.py, mirrored by
# SpecForge configs/qwen3-8b-dspark.json): block 7 with the anchor slot trained (7 proposals), 5 draft layers on the
# layer rule ([1, 9, 17, 25, 33] on 36 layers; [1, 2, 3, 4, 5] on the embedded 8), gamma 4, lr 6e-4, a Markov
# head and a confidence head at weight 1.0. The loss is speculators 0.9.0's DSpark form (kl to the target plus
# the confidence BCE, speculators' denominators), the form our parity tests pin; DeepSpec's 0.1 CE + 0.9 L1 with
# its decayed global denominator is not implemented. Rank 256 at the 2560-wide Qwen3-4B scales to 16 at the
# embedded target's 128 (as the width); anchors keep our default density.
PRESETS["dspark-tiny"] = {
    "drafter_kind": "dspark",
    "block_size": 7,
    "draft_layers": 5,
    "loss": "kl",
    "loss_decay_gamma": 4.0,
    "lr": 6e-4,
    "dspark": {"markov_rank": 16, "markov_head_type": "vanilla", "confidence_head_alpha": 1.0},
}


# DFlash2 as speculators 0.9.0 trains it (`train --speculator-type dflash2`: 5 layers, block 8, KL to the
# verifier, fixed exponential decay gamma 4, selector weight 1.0, train/config/schema.py:486-505, 760-808; every
# layer sliding-window and non-causal within the block, train/cli.py:211-214, models/dflash2/config.py:22-25),
# the layout of z-lab's DFlash2 drafter config (5 sliding layers, W 2048). At tiny size on the embedded
# target (hidden 128, vocabulary 1536, seq_len 256): the window scales with the sequence, 2048 of 8192 -> 64 of
# 256 (still eight blocks, so held-out decoding runs past it); the selector's rank with the width, 256 at 5120
# hidden -> 32 at 128 (kept above 16 so the codebooks are not rank-starved at V 1536). Convolution k 2 / group
# 16 and top-K 16 are speculators' defaults unchanged.
PRESETS["dflash2-tiny"] = {
    "drafter_kind": "dflash2",
    "block_size": 8,
    "draft_layers": 5,
    "loss": "kl",
    "loss_decay_gamma": 4.0,
    "draft_config": {
        "layer_types": ["sliding_attention"] * 5, "sliding_window": 64, "sliding_window_non_causal": True,
    },
    "dflash2": {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32, "selector_top_k": 16,
        "selector_loss_alpha": 1.0,
    },
}


class BoundedSafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses documents whose aliases expand past MAX_YAML_NODES nodes.

    PyYAML shares an aliased node instead of copying it, so loading an alias bomb is quick, but anything
    that walks the result (validation, json.dumps into config.json) visits every expanded node and hangs.
    The expanded size is counted on the composed node graph, once per distinct node, before any object
    is constructed.
    """

    def compose_document(self) -> Any:
        node = super().compose_document()
        if node is not None:
            _check_expanded_size(node)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        # A key written twice in one mapping (lr: 0.001 ... lr: 1000) is an error, not "the last one wins":
        # which value the user meant cannot be guessed. Keys a merge (`<<: *base`) brings in may be overridden.
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key, line = self.construct_object(key_node, deep=False), key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKeyError(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: the constructor below reports it
                    continue
        return super().construct_mapping(node, deep=deep)


class DuplicateKeyError(yaml.YAMLError, ValueError):
    """A mapping gives the same key twice (YAML or JSON)."""

    def __init__(self, key: Any, first_line: int | None = None, second_line: int | None = None) -> None:
        self.key = key
        where = f" (lines {first_line} and {second_line})" if first_line and second_line else ""
        super().__init__(f"key {str(key)!r} is given twice{where}; keep one of them")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: refuse an object that gives a key twice (json keeps the last silently)."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise DuplicateKeyError(key)
        result[key] = value
    return result


def _check_expanded_size(root: Any) -> None:
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:  # iterative post-order: a deeply nested document must not exhaust Python's stack
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            children = _yaml_children(node)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[key] > MAX_YAML_NODES:
                raise yaml.YAMLError(
                    f"the document expands to more than {MAX_YAML_NODES} nodes through its aliases "
                    "(an alias bomb?); refusing to load it"
                )
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise yaml.YAMLError("the document refers to itself through an alias; refusing to load it")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _yaml_children(node) if id(child) not in sizes)


def _yaml_children(node: Any) -> list[Any]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def load_yaml(text: str, what: str) -> Any:
    """Parse YAML (or JSON, a subset) with alias expansion and nesting bounded; errors are ConfigError."""
    try:
        return yaml.load(text, Loader=BoundedSafeLoader)  # noqa: S506 - a SafeLoader subclass
    except DuplicateKeyError as exc:
        raise ConfigError(f"{what}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} does not parse: {str(exc).strip().splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{what} nests too deeply to be a config") from None
    except ValueError as exc:  # an integer of more digits than Python converts (4300): no config value
        raise ConfigError(f"{what} does not parse: {_first_sentence(exc)}") from None


def _first_sentence(exc: BaseException) -> str:
    return (" ".join(str(exc).split()).split(";")[0] or type(exc).__name__)[:200]


# Nested sections of the config: --set SECTION.key=value sets one key, and a config file's section is merged
# over the preset's key by key (a file that sets draft_config.sliding_window keeps the preset's layer types).
NESTED_SECTIONS: dict[str, type[BaseModel]] = {
    "draft_config": DraftConfig, "dflash2": DFlash2Config, "dspark": DSparkConfig,
}


def parse_override(item: str) -> tuple[str, Any]:
    """`key=value` from --set; the value is parsed as YAML so `7`, `null`, `[0,1]` and `final` all work.
    `draft_config.sliding_window=64` sets one key of a nested section."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    key, raw = item.split("=", 1)
    key = key.strip()
    section, _, sub = key.partition(".")
    if sub and section in NESTED_SECTIONS:
        if sub not in NESTED_SECTIONS[section].model_fields:
            raise ConfigError(f"unknown config key {key!r} in --set {item!r}{_suggest(sub, section)}")
    elif key not in TrainConfig.model_fields:
        raise ConfigError(f"unknown config key {key!r} in --set {item!r}{_suggest(key)}")
    try:
        value = yaml.load(raw, Loader=BoundedSafeLoader) if raw.strip() else None  # noqa: S506
    except (yaml.YAMLError, RecursionError, ValueError):  # left as text: the validator names the key
        value = raw
    return key, value


def _merge(values: dict[str, Any], update: dict[str, Any]) -> None:
    """values <- update, nested sections merged key by key (a section that is not a mapping replaces)."""
    for key, value in update.items():
        if key in NESTED_SECTIONS and isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value


def load_config_file(path: Path) -> dict[str, Any]:
    try:
        # a regular file only (a FIFO would block, a device never end), and no larger than a config can be
        text = read_limited(path, MAX_CONFIG_FILE_BYTES, "config file").decode("utf-8")
    except UnsafeFileError as exc:
        raise ConfigError(str(exc)) from None
    except PermissionError:
        raise ConfigError(f"permission denied: config file {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (bad byte at offset {exc.start})") from None
    if path.suffix == ".json":
        try:
            data = loads_json(text, object_pairs_hook=_no_duplicate_keys)
        except DuplicateKeyError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {path} does not parse: {exc.msg} at line {exc.lineno}") from None
        except JsonTooDeep:
            raise ConfigError(f"config file {path} nests too deeply to be a config") from None
        except ValueError as exc:  # an integer of more digits than Python converts (4300)
            raise ConfigError(f"config file {path} does not parse: {_first_sentence(exc)}") from None
    else:
        data = load_yaml(text, f"config file {path}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of config keys")
    return data


def build_config(
    preset: str | None = None,
    config_file: Path | None = None,
    overrides: list[str] | None = None,
    extra: dict[str, Any] | None = None,
) -> TrainConfig:
    """Defaults <- preset <- config file <- extra (e.g. --steps) <- --set overrides, then validated."""
    values: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        _merge(values, copy.deepcopy(PRESETS[preset]))
    if config_file is not None:
        _merge(values, load_config_file(config_file))
    _merge(values, extra or {})
    for item in overrides or []:
        key, value = parse_override(item)
        section, _, sub = key.partition(".")
        _merge(values, {section: {sub: value}} if sub else {key: value})
    return validate_config(values)


def validate_config(values: dict[str, Any]) -> TrainConfig:
    _check_number_range(values)
    try:
        return TrainConfig(**values)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc)) from None


# An integer too large to be a float (a YAML or JSON number of 309+ digits), in any key at any depth (a
# free-form section such as rope_parameters included), is refused here with its key, before a validator or
# torch meets it as an OverflowError.
def _check_number_range(values: Any) -> None:
    stack: list[tuple[str, Any]] = [("", values)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{key}.{k}" if key else str(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{key}.{i}", v) for i, v in enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                float(value)
            except OverflowError:
                try:
                    digits = len(str(abs(value)))
                except ValueError:  # past Python's int-to-str limit (4300 digits): an estimate will do
                    digits = int(value.bit_length() * 0.30103) + 1
                raise ConfigError(f"invalid config: {key or 'config'}: a number of about {digits} digits "
                                  "overflows a float; no config value is that large") from None


def resolve_for_target(config: TrainConfig, num_target_layers: int) -> TrainConfig:
    """Pin everything that depends on the target's depth, so the saved config.json is explicit."""
    ids = config.resolved_layer_ids(num_target_layers)
    update: dict[str, Any] = {"target_layer_ids": ids}
    if config.target_logits_source == "last_selected":
        update["target_logits_source"] = ids[-1]
    return validate_config({**config.model_dump(), **update})


def _one_line(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        loc = ".".join(str(p) for p in error["loc"]) or "config"
        if error["type"] == "extra_forbidden":
            section = str(error["loc"][0]) if len(error["loc"]) > 1 else None
            parts.append(f"unknown config key {loc!r}{_suggest(str(error['loc'][-1]), section)}")
        elif not error["loc"] or (error["type"] == "value_error" and error["msg"].startswith(f"Value error, {loc}")):
            # a whole-config (or whole-section) check: its message names the keys itself
            parts.append(error["msg"].removeprefix("Value error, "))
        else:
            value = error.get("input")
            shown = f" (got {value!r})" if not isinstance(value, dict) else ""
            parts.append(f"{loc}: {error['msg'].removeprefix('Value error, ')}{shown}")
    return "invalid config: " + "; ".join(parts)


def _suggest(key: str, section: str | None = None) -> str:
    import difflib

    model = NESTED_SECTIONS.get(section or "", TrainConfig)
    prefix = f"{section}." if section in NESTED_SECTIONS else ""
    fields = list(model.model_fields)
    close = difflib.get_close_matches(key, fields, n=1)
    if not close:  # "gama" is far from "loss_decay_gamma" as a whole, but close to its last word
        by_last_word = {field.rsplit("_", 1)[-1]: field for field in fields}
        close = [by_last_word[w] for w in difflib.get_close_matches(key, by_last_word, n=1)]
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""
