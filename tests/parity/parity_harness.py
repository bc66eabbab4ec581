"""Run our DFlash training step and speculators' `DFlashDraftModel` on identical weights and inputs.

Shared by tests/parity/test_speculators_parity.py (the CI gate) and bench/ (the throughput comparison and
the tolerance report). speculators is only imported, never copied: it is the reference we measure against.

What "identical" means here, and the conventions we line up on purpose:
  * Weights: our drafter is built at random (norm gains too, so a swapped norm cannot hide behind 1.0) and
    its state dict is loaded into speculators' model, whose names are the same z-lab layout. speculators
    also owns the frozen embeddings, lm_head, verifier_lm_head and verifier_norm (they start as NaN until
    loaded); we load the same tensors there and hand them to our step through a stand-in target.
  * Inputs: the same selected-layer features [S, k*H] and the same last hidden state of the verifier.
    speculators turns the last hidden state into targets with verifier_lm_head(verifier_norm(h)); our step
    receives target logits from the frozen target, so the stand-in computes lm_head(rms_norm(h)) there.
  * Anchors: our step's sampler (sample_step_anchors) draws them; speculators' `select_anchors` is replaced,
    for the call, by one that returns exactly those for that row (the sampler's own parity is tested
    separately).
  * speculators packs one row per forward (batch size 1). With N rows we run it once per row and average
    loss and gradients over rows: our loss is the mean of per-row losses, the same reduction.
  * gamma None (no decay) is gamma = inf for speculators: exp(-(k-1)/inf) = 1 for every slot k >= 1.
  * speculators' loss is given explicitly: `resolve_loss_config(name, "eager")` (its default "fused"
    losses need Triton) and per_position_loss_weight "fixed-exp-decay" or "dpace" with dpace_alpha, as the
    case's `weighting` says (its training CLI defaults DFlash to D-PACE; the model-level default is fixed
    decay).
  * speculators' dataloader adds uniform noise to the aux hidden states by default; that lives in its
    data pipeline, not in the model, so feeding tensors directly already leaves it out.
  * Documents: speculators' loss mask for slot j is loss_mask[p+j] with no document check, so a block
    anchored near the end of a document also trains on the NEXT document's first tokens; ours gives such
    slots weight 0 (the drafter cannot see that document's context). Parity inputs start every
    document after the first with an unsupervised prompt of at least B-1 tokens, where the two rules
    agree; test_cross_document_labels_are_the_one_documented_difference pins the difference itself.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import Qwen3Config

from trainer.model.drafter import DFlashDrafter
from trainer.model.loss import LogitsHead
from trainer.run.step import StepPlan, dflash_step, sample_step_anchors


@dataclass(frozen=True)
class ModelDims:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    draft_layers: int = 2
    vocab: int = 128
    num_features: int = 5  # k target layers concatenated into fc
    target_layers: int = 8  # the (imaginary) target's depth; only its config is needed
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0

    def target_config(self, num_hidden_layers: int | None = None, attn: str | None = None) -> Qwen3Config:
        config = Qwen3Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=num_hidden_layers or self.target_layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
        if attn is not None:
            config._attn_implementation = attn
        return config


@dataclass(frozen=True)
class ParityCase:
    name: str
    block_size: int
    max_anchors: int
    docs_per_row: tuple[int, ...]  # one entry per packed row: how many documents it holds
    seq_len: int
    gamma: float | None
    loss_kind: str  # "ce" | "kl"
    attn: str  # speculators' attention implementation: "eager" | "sdpa"
    seed: int
    dims: ModelDims = field(default_factory=ModelDims)
    weighting: str = "decay"  # "decay" (fixed-exp-decay) | "dpace" (speculators' current DFlash default)
    dpace_alpha: float = 0.5
    draft_vocab: int | None = None  # a reduced draft vocabulary of this size (speculators' d2t/t2d)

    @property
    def mask_token_id(self) -> int:
        return self.dims.vocab - 1  # an id the inputs never use


@dataclass
class Inputs:
    input_ids: Tensor  # [N, S]
    position_ids: Tensor  # [N, S], restart at 0 per document
    doc_ids: Tensor  # [N, S], -1 = padding
    loss_mask: Tensor  # [N, S]
    features: Tensor  # [N, S, k*H] selected target layers, concatenated
    last_hidden: Tensor  # [N, S, H] the verifier's last decoder layer output (before its final norm)
    embed_weight: Tensor  # [V, H]
    lm_head_weight: Tensor  # [V, H]
    verifier_norm_weight: Tensor  # [H]


def make_inputs(case: ParityCase, *, cross_document_labels: bool = False) -> Inputs:
    """Packed rows of 1-3 documents each: an unsupervised prompt, a supervised response, padding at the end.

    Every document after the first opens with a prompt of >= B-1 unsupervised tokens (see the module
    docstring); `cross_document_labels=True` drops that prompt so blocks do reach into the next document.
    """
    g = torch.Generator().manual_seed(case.seed)
    d, n_rows, seq_len, b = case.dims, len(case.docs_per_row), case.seq_len, case.block_size
    input_ids = torch.randint(0, d.vocab - 1, (n_rows, seq_len), generator=g)  # never the mask token
    position_ids = torch.zeros(n_rows, seq_len, dtype=torch.long)
    doc_ids = torch.full((n_rows, seq_len), -1, dtype=torch.long)
    loss_mask = torch.zeros(n_rows, seq_len, dtype=torch.long)
    for row, n_docs in enumerate(case.docs_per_row):
        padding = int(torch.randint(0, 4, (1,), generator=g))
        usable = seq_len - padding
        # Random cut points give documents of different lengths; each keeps >= 2B tokens.
        cuts = sorted(torch.randperm(usable // (2 * b) - 1, generator=g)[: n_docs - 1].add(1).mul(2 * b).tolist())
        bounds = [0, *cuts, usable]
        for doc, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            doc_ids[row, start:end] = doc
            position_ids[row, start:end] = torch.arange(end - start)
            if doc > 0 and cross_document_labels:
                prompt = 0
            else:
                low = b - 1 if doc > 0 else 0
                prompt = int(torch.randint(low, low + 3, (1,), generator=g))
            loss_mask[row, start + prompt : end] = 1
        input_ids[row, usable:] = 0  # padding token
    features = torch.randn(n_rows, seq_len, d.num_features * d.hidden, generator=g)
    last_hidden = torch.randn(n_rows, seq_len, d.hidden, generator=g)
    embed_weight = torch.randn(d.vocab, d.hidden, generator=g)
    # A head where two tokens dominate along hidden dim 0 gives ~50 % draft/target argmax agreement, so the
    # accuracy counts compared below are neither all 0 nor all 1; the random rest keeps KL non-trivial.
    lm_head_weight = torch.randn(d.vocab, d.hidden, generator=g) * 0.1
    lm_head_weight[0, 0] += 3.0
    lm_head_weight[1, 0] -= 3.0
    verifier_norm_weight = 1.0 + 0.1 * torch.randn(d.hidden, generator=g)
    return Inputs(input_ids, position_ids, doc_ids, loss_mask, features, last_hidden, embed_weight,
                  lm_head_weight, verifier_norm_weight)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Plain RMSNorm, x * rsqrt(mean(x^2) + eps) * w (the Qwen3 final norm)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class StandInTarget:
    """What dflash_step needs from a FrozenTarget, backed by the case's tensors instead of a model.

    forward_hidden returns the given features and norm(h_last), whose lm_head is the frozen target's final
    logits, computed the way speculators reconstructs them from the last hidden state.
    """

    def __init__(self, inputs: Inputs, eps: float):
        self.inputs = inputs
        self.eps = eps

    def forward_hidden(self, input_ids, position_ids, doc_ids, feature_layer_ids, logits_source):
        with torch.no_grad():
            normed = rms_norm(self.inputs.last_hidden, self.inputs.verifier_norm_weight, self.eps)  # [N, S, H]
        return self.inputs.features, normed

    def embed(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.inputs.embed_weight)

    def draft_head(self, vocab_ids: Tensor | None = None) -> LogitsHead:
        weight = self.inputs.lm_head_weight
        return LogitsHead(weight if vocab_ids is None else weight[vocab_ids])

    teacher_head = draft_head  # no output transform: speculators' verifier_lm_head

    def logits(self, hidden: Tensor, vocab_ids: Tensor | None = None) -> Tensor:
        return self.draft_head(vocab_ids)(hidden)


def build_our_drafter(case: ParityCase) -> DFlashDrafter:
    """Our drafter with every weight random, norm gains included (1 + 0.1 N(0, 1))."""
    d = case.dims
    torch.manual_seed(case.seed + 1)
    drafter = DFlashDrafter.from_target_config(
        d.target_config(), num_layers=d.draft_layers, num_features=d.num_features,
        block_size=case.block_size, mask_token_id=case.mask_token_id,
    )
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * 0.1)
    return drafter.float().train()


def speculators_loss_config(loss_kind: str):
    from speculators.losses import resolve_loss_config  # only the parity environment has it

    return resolve_loss_config({"ce": "ce", "kl": "kl_div"}[loss_kind], "eager")


def case_vocab_ids(case: ParityCase, inputs: Inputs) -> Tensor | None:
    """The draft vocabulary of the case, built by our trainer's rule from the inputs' supervised tokens."""
    if case.draft_vocab is None:
        return None
    from trainer.data.draft_vocab import draft_token_ids, token_frequencies

    return draft_token_ids(token_frequencies(inputs.input_ids, inputs.loss_mask), case.draft_vocab, case.dims.vocab)


def build_speculators_model(case: ParityCase, drafter: DFlashDrafter, inputs: Inputs):
    """speculators' DFlashDraftModel with our drafter's weights and the stand-in target's frozen tensors."""
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.models.dflash.core import DFlashDraftModel

    d = case.dims
    config = DFlashSpeculatorConfig(
        # speculators encodes the number of DRAFT layers in the verifier-shaped layer config.
        transformer_layer_config=d.target_config(num_hidden_layers=d.draft_layers, attn=case.attn),
        draft_vocab_size=case.draft_vocab or d.vocab,  # full vocabulary: no t2d/d2t mapping
        block_size=case.block_size,
        aux_hidden_state_layer_ids=list(range(1, d.num_features + 1)),  # only its length matters here
        mask_token_id=case.mask_token_id,
    )
    model = DFlashDraftModel(config)
    head = inputs.lm_head_weight
    vocab_ids = case_vocab_ids(case, inputs)
    if vocab_ids is not None:  # speculators' own maps (its loader checks them), and its reduced heads
        from trainer.data.draft_vocab import vocab_maps

        d2t, t2d = vocab_maps(vocab_ids, d.vocab)
        model.load_vocab_mappings(t2d, d2t)
        head = head[t2d]
    state = {name: tensor.clone() for name, tensor in drafter.state_dict().items()}
    state["embed_tokens.weight"] = inputs.embed_weight.clone()
    state["lm_head.weight"] = head.clone()
    state["verifier_lm_head.weight"] = head.clone()
    state["verifier_norm.weight"] = inputs.verifier_norm_weight.clone()
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise AssertionError(f"weights speculators does not have: {result.unexpected_keys}")
    missing = [k for k in result.missing_keys if k not in ("t2d", "d2t")]
    if missing:
        raise AssertionError(f"speculators weights left unloaded (they would stay NaN): {missing}")
    return model.float().train()


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, original)


def run_ours(case: ParityCase, drafter: DFlashDrafter, inputs: Inputs, anchor_seed: int,
             context_includes_anchor: bool = False):
    """Our real training step: anchors from trainer.run.step.sample_step_anchors (a function of seed and
    step), then trainer.run.step.dflash_step. Returns loss, metrics and the anchors."""
    plan = StepPlan(
        feature_layer_ids=list(range(1, case.dims.num_features + 1)), logits_source="final",
        block_size=case.block_size, max_anchors=case.max_anchors, gamma=case.gamma, loss_kind=case.loss_kind,
        context_includes_anchor=context_includes_anchor, mask_token_id=case.mask_token_id,
        loss_weighting=case.weighting, dpace_alpha=case.dpace_alpha,
        draft_token_ids=case_vocab_ids(case, inputs),
    )
    batch = {"input_ids": inputs.input_ids, "position_ids": inputs.position_ids, "doc_ids": inputs.doc_ids,
             "loss_mask": inputs.loss_mask}
    anchors, anchor_valid = sample_step_anchors({k: v.cpu() for k, v in batch.items()}, plan, anchor_seed, step=1)
    target = StandInTarget(inputs, case.dims.rms_eps)
    loss, metrics = dflash_step(target, drafter, batch, anchors, anchor_valid, plan)
    return loss, metrics, anchors, anchor_valid


def speculators_forward_row(model, case: ParityCase, inputs: Inputs, row: int, anchors: Tensor,
                            anchor_valid: Tensor, loss_config=None):
    """speculators' forward on one packed row, with its anchor sampler forced to `anchors[row]`."""
    from speculators.models.dflash import core as speculators_core

    seq_len, block_size = case.seq_len, case.block_size

    def forced_anchors(loss_mask: Tensor, num_anchors: int, size: int) -> tuple[Tensor, Tensor]:
        # The forced anchors must be ones speculators' own sampler could draw: supervised, not in the
        # last B positions, and exactly num_anchors of them (padded with anchor_valid False).
        assert num_anchors == anchors.shape[1] and size == block_size
        chosen = anchors[row][anchor_valid[row]]
        assert bool(loss_mask[0, chosen].bool().all()) and bool((chosen < seq_len - block_size).all())
        return anchors[row].clone(), anchor_valid[row].clone()

    gamma = math.inf if case.gamma is None else case.gamma
    with patched(speculators_core, "select_anchors", forced_anchors):
        _, loss, metrics = model(
            hidden_states=inputs.features[row : row + 1],
            input_ids=inputs.input_ids[row : row + 1],
            loss_mask=inputs.loss_mask[row : row + 1],
            verifier_last_hidden_states=inputs.last_hidden[row : row + 1],
            document_ids=inputs.doc_ids[row : row + 1],
            position_ids=inputs.position_ids[row : row + 1],
            loss_config=loss_config or speculators_loss_config(case.loss_kind),
            gamma=gamma,
            max_anchors=case.max_anchors,
            per_position_loss_weight="dpace" if case.weighting == "dpace" else "fixed-exp-decay",
            dpace_alpha=case.dpace_alpha,
        )
    return loss, metrics


@dataclass
class ParityResult:
    case: ParityCase
    our_loss: float
    their_loss: float
    our_metrics: dict[str, Any]
    their_counts: dict[str, float]  # summed over rows: full_acc_{sum,total}, position_j_acc_{sum,total}, eal_*
    our_grads: dict[str, Tensor]
    their_grads: dict[str, Tensor]
    anchors: Tensor
    anchor_valid: Tensor

    def their_position_acc(self) -> list[float]:
        b = self.case.block_size
        return [self.their_counts[f"position_{j}_acc_sum"] / max(self.their_counts[f"position_{j}_acc_total"], 1.0)
                for j in range(1, b)]

    def their_acc(self) -> float:
        total = self.their_counts["full_acc_total"]
        return self.their_counts["full_acc_sum"] / total if total else 0.0

    def their_accepted_length(self) -> float:
        # speculators' eal is the mean accepted run per block PLUS the bonus token; our streak has no +1.
        total = self.their_counts["eal_total"]
        return self.their_counts["eal_sum"] / total if total else 0.0

    def max_grad_diffs(self) -> tuple[float, float]:
        """(max abs diff, max diff relative to that tensor's largest gradient) over every parameter."""
        worst_abs, worst_rel = 0.0, 0.0
        for name, ours in self.our_grads.items():
            diff = (ours - self.their_grads[name]).abs().max().item()
            worst_abs = max(worst_abs, diff)
            worst_rel = max(worst_rel, diff / max(self.their_grads[name].abs().max().item(), 1e-30))
        return worst_abs, worst_rel


def move_inputs(inputs: Inputs, device: torch.device) -> None:
    for name, value in vars(inputs).items():
        setattr(inputs, name, value.to(device))


def run_parity(case: ParityCase, *, cross_document_labels: bool = False,
               our_context_includes_anchor: bool = False, device: str = "cpu") -> ParityResult:
    """Both implementations on the case's inputs. `our_context_includes_anchor=True` runs OUR step with the
    v6 leak (blocks see their anchor's hidden state), to show the comparison catches a real defect.
    On a CUDA device our step takes its flex-attention path (a BlockMask); give the case
    attn="simple_flex_attention" for speculators' flex path (bench/gpu_parity.py)."""
    inputs = make_inputs(case, cross_document_labels=cross_document_labels)
    drafter = build_our_drafter(case)
    model = build_speculators_model(case, drafter, inputs)
    if device != "cpu":
        move_inputs(inputs, torch.device(device))
        drafter.to(device)
        model.to(device)

    loss, metrics, anchors, anchor_valid = run_ours(case, drafter, inputs, anchor_seed=case.seed + 2,
                                                    context_includes_anchor=our_context_includes_anchor)
    loss.backward()
    our_grads = {name: p.grad.detach().clone() for name, p in drafter.named_parameters()}

    n_rows = len(case.docs_per_row)
    loss_config = speculators_loss_config(case.loss_kind)
    their_loss, counts = 0.0, {}
    for row in range(n_rows):
        row_loss, row_metrics = speculators_forward_row(model, case, inputs, row, anchors, anchor_valid, loss_config)
        (row_loss / n_rows).backward()  # gradients accumulate into the mean over rows, like our loss
        their_loss += row_loss.item() / n_rows
        for key, value in row_metrics.items():
            if key.endswith(("_sum", "_total")) and not key.startswith("loss"):
                counts[key] = counts.get(key, 0.0) + float(value)
    params = dict(model.named_parameters())
    their_grads = {name: params[name].grad.detach().clone() for name in our_grads}
    return ParityResult(case, loss.item(), their_loss, metrics, counts, our_grads, their_grads, anchors.cpu(),
                        anchor_valid.cpu())


# Several random tiny configs: block sizes, anchor counts (some above the eligible positions, so padding
# anchors occur), 1-3 documents per row, 1-2 rows, gamma 4 / 7 / None or D-PACE, CE and KL, eager and SDPA attention
# on speculators' side, A*B below and above S (speculators gathers or rolls the targets), two model shapes.
SMALL_DIMS = ModelDims(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64, draft_layers=1, vocab=96,
                       num_features=3)
PARITY_CASES: list[ParityCase] = [
    ParityCase("b4-1doc-g4-ce-eager", 4, 6, (1,), 48, 4.0, "ce", "eager", seed=11),
    ParityCase("b8-2doc-g7-kl-sdpa", 8, 4, (2,), 64, 7.0, "kl", "sdpa", seed=12),
    ParityCase("b4-3doc-nogamma-ce-sdpa-rolled", 4, 12, (3,), 40, None, "ce", "sdpa", seed=13),
    ParityCase("b8-2doc-g4-kl-eager-padanchors", 8, 40, (2,), 48, 4.0, "kl", "eager", seed=14),
    ParityCase("b4-rows1+3doc-g7-ce-eager", 4, 5, (1, 3), 40, 7.0, "ce", "eager", seed=15),
    ParityCase("b8-rows3+2doc-nogamma-kl-sdpa", 8, 6, (3, 2), 72, None, "kl", "sdpa", seed=16),
    ParityCase("b6-2doc-g4-ce-sdpa-smalldims", 6, 5, (2,), 48, 4.0, "ce", "sdpa", seed=17, dims=SMALL_DIMS),
    ParityCase("b16-2doc-g7-kl-eager-smalldims", 16, 3, (2,), 80, 7.0, "kl", "eager", seed=18, dims=SMALL_DIMS),
    # D-PACE (speculators' current DFlash default; CE only): weights from the drafter's own confidence.
    ParityCase("b8-2doc-dpace-ce-sdpa", 8, 5, (2,), 64, None, "ce", "sdpa", seed=19, weighting="dpace"),
    ParityCase("b16-rows1+2doc-dpace-a0.2-ce-eager", 16, 3, (1, 2), 80, None, "ce", "eager", seed=20,
               dims=SMALL_DIMS, weighting="dpace", dpace_alpha=0.2),
    ParityCase("b4-3doc-dpace-a1-ce-sdpa-padanchors", 4, 30, (3,), 48, None, "ce", "sdpa", seed=21,
               weighting="dpace", dpace_alpha=1.0),
    # A reduced draft vocabulary (speculators' --draft-vocab-size, d2t/t2d): heads and teacher on its rows.
    ParityCase("b8-2doc-g4-ce-sdpa-vocab40", 8, 5, (2,), 64, 4.0, "ce", "sdpa", seed=22, draft_vocab=40),
    ParityCase("b8-rows2+1doc-dpace-ce-eager-vocab64", 8, 4, (2, 1), 64, None, "ce", "eager", seed=23,
               weighting="dpace", draft_vocab=64),
    ParityCase("b4-2doc-g7-kl-sdpa-vocab24", 4, 6, (2,), 48, 7.0, "kl", "sdpa", seed=24, draft_vocab=24),
]
