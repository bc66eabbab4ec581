"""The probe protocol: the few callables sleuth needs to run experiments on a DFlash implementation.

A *subject* is any object with some of the methods of `ProbeSubject`. sleuth gets one by calling an
entry function `module:function` (`--probe-entry`, or `trainer.probe:probe_subject` in a run's `code/`
copy) with one argument, a dict `context` ({"run_dir": str | None, "code": str | None, "config": dict |
None}; `config` is the `--config` mapping). Everything runs in a separate process (`sleuth.probes.worker`),
on CPU, with tiny dimensions and no network. The probe owns the *target*: it builds a synthetic one
(random hidden states for every layer, embeddings, lm_head, final norm: `ProbeTarget`) and hands the
subject batches whose answers it knows (`ProbeBatch`). The subject builds a tiny drafter for that target
and runs its own code on those batches.

The contract (docs/guides/your-trainer.md "Probes: sleuth runs the code" says the same):

Where the code is imported from. The child's sys.path starts with the import root: for `--code PATH`
  PATH itself when it is a directory, its parent when it is a file (so `--code src/ --probe-entry
  mytrainer.probe:subject` imports `src/mytrainer/probe.py`); for `--run`, the run's `code/` copy. The
  entry module and everything it imports come from there, never from an installed copy.

Every method is optional. A subject may implement only some methods (a trainer whose loss is inline
  in `main()` cannot offer `loss`): a method that is missing, not callable, or raises NotImplementedError
  (what `sleuth probe init` writes for the parts it could not wire) makes exactly the experiments that
  need it `unknown` with "not provided by the entry: loss()" and its message; the others run. PROBE_NEEDS
  lists which experiment needs which methods. `describe()` is needed by all of them (it gives the block
  size and the target depth the subject is configured for).

Call order, all on the one object the entry returned, in one process:
  1. `describe()` once;
  2. `build(target)` exactly once, before anything else uses the drafter;
  3. `parameters()` once to give every drafter weight a visible random value (it is called again by
     fc-norm and the optimizer step); values may be `nn.Parameter`s or plain tensors, and sleuth writes into them in
     place, so they must be the tensors the drafter computes with, not copies;
  4. `draft_logits(batch, hooks)` twice on the same batch (the answers must be equal: a forward that is
     not deterministic, e.g. dropout left on, cannot be probed), then many times with perturbed batches
     and hooks, one experiment after another: layers-read, attention, context-per-layer (with
     `draft_layers()`), rotary-positions (with `rotary()`), fc-norm (`feature_projection()`, and
     `parameters()` with one `loss()`), then loss-gradient (`loss(batch, hooks)` a few times);
  5. `train_step(batch)` exactly once, last (it changes the weights).
  Nothing is called concurrently; no method is called after `train_step`.

Conventions the subject must follow (they are what makes the experiments' answers unambiguous):
  * `ProbeBatch.hidden_states` is the target's output in Hugging Face layout: L+1 tensors [N, S, H],
    index 0 the embeddings, index i the output of decoder layer i-1, index L already final-normed
    (`lm_head(hidden_states[L])` are the final logits, `ProbeBatch.logits`). `last_hidden` is the last
    layer's output before the final norm (what speculators calls `verifier_last_hidden_states`).
    The subject selects its layers from these exactly as its own code does.
  * Anchors are given (`anchors` [N, A]): the subject uses them instead of sampling its own.
    `anchor_valid` [N, A] marks the real ones; a False entry is padding whose block the subject must
    leave out of the loss, as its own sampler's padding would be (`sleuth probe check` tests this; the
    experiments themselves pass all anchors valid).
  * Block tokens are ordered block-major: token t of the drafter's block stream is slot t % B of block
    t // B. `ProbeHooks.block_embeddings` is applied to the block tokens' input embeddings ([..., A*B, H])
    and `ProbeHooks.draft_logits` to the drafter's logits ([..., A*B, V]) before the loss; the subject
    uses what the hooks return in place of the tensors it passed them (a hook that is called but whose
    result is dropped is the most common adapter bug: `sleuth probe check` catches it).
  * `rotary()`: the module called as `module(x, position_ids)` (or `position_ids=`). The experiment reads
    the position ids of the FIRST call in a `draft_logits` pass; position_ids is [N, T] or [T], its last
    A*B entries the block tokens' positions (block-major) and, when T = S + A*B, its first S entries the
    context's. A drafter that rotates context and block in separate calls must make the block's call
    first, or expose a wrapper that sees both.
  * Embeddings and lm_head are recognised by value, not by name: any tensor in `parameters()` equal to
    `target.embed_weight` (or `lm_head_weight`) in shape and values when the drafter is built is that
    role; the target's own tensors are also checked for changes (a subject that uses them directly and
    lets the optimizer touch them). The subject uses the target's `mask_token_id`, embeddings, lm_head
    and final norm (copies are fine).
  * `train_step(batch)` is one step with the optimizer the implementation builds for training (its
    parameter groups, its choice of what is trained). It may build a new optimizer each call or keep one
    from `build`: it is called once.

Optional, read where present (absent ones leave what they would decide `unknown`, with the reason):
`layer_ids_for(num_target_layers, count=None)` (the subject's layer-id rule for any depth),
`sample_anchors(batch, num_anchors)` (its training sampler: anchors and valid flags [N, n]),
`feature_projection()` (fc, the module the concatenated target features enter), `variants()` (the same code
under other settings, {label: subject}, probed too), `path_checks(lab)` (Verdicts on code the run takes that
the experiments bypass, each joined to the verdict on its invariant). describe() may add "configured" ({name: {"value",
"source"}}: weighting, gamma, dpace_alpha, loss, target_layer_ids, and where each came from, "run config
..." when the run's config set it), "max_rows", "documents_per_row", "layer_types",
"sliding_causal_within_block", "loss_reduction", "anchor_exclusions", "layer_ids_source", "mask_token_source"; it is read
again after build().

This module imports no torch at load time, so sleuth's own process can read it without the heavy stack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor, nn

PROTOCOL_VERSION = 1
# How the subject's layer ids map to hidden_states (describe()["layer_id_convention"]):
#   "zlab": id i is hidden_states[i + 1]; "vllm": id i is hidden_states[i];
#   "external": the subject consumes features selected outside its code (e.g. by vLLM), so which layers
#   it reads is not the subject's to decide and the target_layer_ids probe does not apply.
LAYER_ID_CONVENTIONS = ("zlab", "vllm", "external")

# The one list of describe()'s fields: name -> (required, what it says). The table in docs/guides/your-trainer.md is checked
# against it (tests/probes/test_protocol_contract.py); a field an experiment starts reading is added here.
DESCRIBE_FIELDS: dict[str, tuple[bool, str]] = {
    "name": (False, "a short name for the report"),
    "protocol": (False, f"the protocol version the subject follows ({PROTOCOL_VERSION})"),
    "block_size": (True, "B, the block size the drafter is built and trained with"),
    "num_target_layers": (True, "L, the depth of the target the subject is configured for (the synthetic "
                                "target gets this many layers)"),
    "layer_ids": (False, "the target layer ids the subject selects, in its own convention (without them "
                         "the layers-read probe cannot say whether all selected layers are read)"),
    "layer_id_convention": (False, "one of " + ", ".join(LAYER_ID_CONVENTIONS) + " (default zlab)"),
    "documents_per_row": (False, "1 when the subject's rows never hold more than one document (it is then "
                                 "probed on one-document rows); \"packed\" (the default, also any number "
                                 ">= 2) for a trainer that packs several documents per row, with positions "
                                 "restarting per document and a document mask"),
    "notes": (False, "a list of strings: what configuration was exercised (shown in the report)"),
    # Read by the experiments' coverage (what the run's path is, so a `match` can say it was exercised):
    "configured": (False, "{name: {\"value\", \"source\"}} for weighting, gamma, dpace_alpha, loss, "
                          "target_layer_ids: the values the subject runs with, \"run config ...\" where the run's "
                          "config set one (a verdict on it then only says the code follows the config)"),
    "max_rows": (False, "the most rows per batch the subject takes (1 for a single-row forward)"),
    "layer_types": (False, "each draft layer's attention type (\"full_attention\", \"sliding_attention\")"),
    "loss_reduction": (False, "how the code promises to divide the weighted sum of the slot losses: "
                              "\"weighted_mean\" (by the weights' sum), \"row_weighted_mean\", \"token_mean\" (by "
                              "the number of trained slots), \"row_token_mean\" (per row, rows averaged), "
                              "\"batch_mean\" (by the rows), \"sum\"; the loss-gradient probe reads the normaliser "
                              "from the gradient's absolute size; absent: it is reported, not judged"),
    "sliding_causal_within_block": (False, "true where the sliding-window layers are causal within a block by "
                                           "the subject's configuration"),
    "anchor_exclusions": (False, "the positions the subject's sampler documents it never draws (\"last B "
                                 "positions\", \"unsupervised next token\")"),
    "anchor_sampler_source": (False, "which code sample_anchors() calls (shown in the coverage)"),
    "layer_ids_source": (False, "which code computed layer_ids (its own rule, the config, an explicit list)"),
    "mask_token_source": (False, "how the subject resolved its mask token"),
}
PACKED = "packed"

# The protocol's methods, and which of them each experiment needs (a missing one makes it unknown).
PROTOCOL_METHODS = ("describe", "build", "parameters", "draft_logits", "loss", "train_step", "draft_layers", "rotary")
PROBE_NEEDS: dict[str, tuple[str, ...]] = {
    "layers-read": ("describe", "build", "draft_logits"),
    "attention": ("describe", "build", "draft_logits"),
    "context-per-layer": ("describe", "build", "draft_logits", "draft_layers"),
    "rotary-positions": ("describe", "build", "draft_logits", "rotary"),
    "fc-norm": ("describe", "build", "draft_logits"),  # feature_projection() and loss() where offered
    "block-inputs": ("describe", "build", "draft_logits"),
    "loss-gradient": ("describe", "build", "loss"),
    "anchor-sampling": ("describe",),  # its sampler (sample_anchors) is optional; padded anchors come from the loss
    "optimizer-step": ("describe", "build", "parameters", "train_step"),
}


@dataclass(frozen=True)
class ProbeTarget:
    """A synthetic target model: shapes, a Qwen3-style config, and the frozen tensors the drafter shares."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    mask_token_id: int
    embed_weight: Tensor  # [V, H]
    lm_head_weight: Tensor  # [V, H]
    norm_weight: Tensor  # [H] the final RMSNorm's gain

    def config_kwargs(self, num_hidden_layers: int | None = None) -> dict[str, Any]:
        """Keyword arguments for `transformers.Qwen3Config` describing this target (or a drafter over it)."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": num_hidden_layers or self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "attention_dropout": 0.0,
        }

    def qwen3_config(self, num_hidden_layers: int | None = None) -> Any:
        from transformers import Qwen3Config

        return Qwen3Config(**self.config_kwargs(num_hidden_layers))


@dataclass(frozen=True)
class ProbeBatch:
    """Packed rows with known answers. N rows of S positions, A anchors per row, blocks of B tokens."""

    input_ids: Tensor  # [N, S] long
    position_ids: Tensor  # [N, S] long, restart at 0 per document
    doc_ids: Tensor  # [N, S] long, -1 = padding
    loss_mask: Tensor  # [N, S] long, 1 = supervised
    anchors: Tensor  # [N, A] long
    anchor_valid: Tensor  # [N, A] bool
    hidden_states: tuple[Tensor, ...]  # L+1 x [N, S, H], Hugging Face layout (see the module docstring)
    last_hidden: Tensor  # [N, S, H] the last layer's output before the final norm
    logits: Tensor  # [N, S, V] lm_head(hidden_states[L]): the target's final logits

    def replace(self, **changes: Any) -> ProbeBatch:
        return replace(self, **changes)


def _identity(tensor: Tensor) -> Tensor:
    return tensor


@dataclass
class ProbeHooks:
    """Where an experiment intervenes; the subject calls both on the tensors named and uses the results."""

    block_embeddings: Callable[[Tensor], Tensor] = field(default=_identity)
    draft_logits: Callable[[Tensor], Tensor] = field(default=_identity)


@runtime_checkable
class ProbeSubject(Protocol):
    """What an entry function returns (every method optional, see the module docstring). Methods the
    probes do not find are reported `unknown`, never guessed."""

    def describe(self) -> dict[str, Any]:
        """The subject's configuration: the fields of DESCRIBE_FIELDS (block_size and num_target_layers
        required)."""

    def build(self, target: ProbeTarget) -> None:
        """Build a tiny drafter for `target` the way the implementation builds it (called once)."""

    def parameters(self) -> dict[str, nn.Parameter | Tensor]:
        """Every parameter the implementation holds: the drafter's, and embeddings / lm_head if it owns copies."""

    def draft_logits(self, batch: ProbeBatch, hooks: ProbeHooks) -> Tensor:
        """The drafter's logits for every block token, [N, A, B, V] (no gradient needed)."""

    def loss(self, batch: ProbeBatch, hooks: ProbeHooks) -> Tensor:
        """The implementation's training loss on `batch`, a scalar with its autograd graph."""

    def train_step(self, batch: ProbeBatch) -> None:
        """One optimizer step, with the optimizer the implementation builds for training (called once, last)."""

    def draft_layers(self) -> list[nn.Module]:
        """The drafter's decoder layers in order; each takes the block tokens' hidden states as its first
        positional argument or as the keyword `hidden_states`."""

    def rotary(self) -> nn.Module | None:
        """The module that turns position ids into rotary embeddings (called as module(x, position_ids))."""


# --- partial subjects ------------------------------------------------------------------------------------


class NotProvided(Exception):  # noqa: N818 - it names what the subject did not provide, not an error kind
    """A protocol method the subject does not offer (missing, not callable, or NotImplementedError)."""

    def __init__(self, method: str, detail: str = "") -> None:
        self.method, self.detail = method, detail.strip()
        super().__init__(self.reason)

    @property
    def reason(self) -> str:
        return f"not provided by the entry: {self.method}()" + (f" ({self.detail})" if self.detail else "")


class PartialSubject:
    """The subject as the experiments see it: every protocol method is there; calling one the subject does
    not offer raises NotProvided, which the worker turns into `unknown` verdicts for the experiments that
    needed it. Other attributes pass through to the subject."""

    def __init__(self, subject: Any) -> None:
        self.subject = subject

    def provides(self, method: str) -> bool:
        return callable(getattr(self.subject, method, None))

    def missing(self) -> list[str]:
        return [m for m in PROTOCOL_METHODS if not self.provides(m)]

    def _call(self, method: str, *args: Any) -> Any:
        function = getattr(self.subject, method, None)
        if not callable(function):
            raise NotProvided(method)
        try:
            return function(*args)
        except NotImplementedError as exc:  # a scaffold's TODO (`sleuth probe init`), or an abstract stub
            raise NotProvided(method, str(exc)) from None

    def describe(self) -> dict[str, Any]:
        return self._call("describe")

    def build(self, target: ProbeTarget) -> None:
        return self._call("build", target)

    def parameters(self) -> dict[str, Any]:
        return self._call("parameters")

    def draft_logits(self, batch: ProbeBatch, hooks: ProbeHooks) -> Tensor:
        return self._call("draft_logits", batch, hooks)

    def loss(self, batch: ProbeBatch, hooks: ProbeHooks) -> Tensor:
        return self._call("loss", batch, hooks)

    def train_step(self, batch: ProbeBatch) -> None:
        return self._call("train_step", batch)

    def draft_layers(self) -> list[Any]:
        return self._call("draft_layers")

    def rotary(self) -> Any:
        return self._call("rotary")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["subject"], name)


def check_description(info: Any) -> dict[str, Any]:
    """describe()'s answer as a dict with the required fields, or ValueError saying what is wrong."""
    if not isinstance(info, dict):
        raise ValueError(f"describe() returned a {type(info).__name__}, not a dict")
    missing = [name for name, (required, _doc) in DESCRIBE_FIELDS.items() if required and name not in info]
    if missing:
        raise ValueError(f"describe() lacks {', '.join(missing)}")
    for name in ("block_size", "num_target_layers"):
        value = info[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"describe()[{name!r}] must be a positive int, got {value!r}")
    convention = info.get("layer_id_convention", "zlab")
    if convention not in LAYER_ID_CONVENTIONS:
        raise ValueError(f"describe()['layer_id_convention'] must be one of {', '.join(LAYER_ID_CONVENTIONS)}, "
                         f"got {convention!r}")
    return dict(info)
