"""Real speculative decoding with a DFlash drafter: the only ground truth of a drafter's quality.

Training accuracy is measured with teacher forcing under the training mask; a leaky mask (the anchor's
own hidden state in the context, SpecForge #533) scores high there and collapses here. This module runs
the draft-verify loop of z-lab/dflash (dflash/model.py, dflash_generate; ../shared/DFLASH.md "The
inference loop") and reports what serving would see:

    prefill  the target runs the prompt; the first new token comes from its last logit; the drafter's
             context is the selected target layers at the prompt positions.
    draft    block = [anchor, mask, ..., mask] at positions start..start+B-1, where the anchor is the last
             committed token (its target hidden state does not exist yet, so it is never context). One
             drafter pass over the NEW context (earlier context is in the drafter's KV cache) plus the
             block; slots 1..B-1 through the target's lm_head give the draft. The draft cache is cropped
             back to the context right away: block K/V never persist.
    verify   the target runs the B block tokens with its KV cache; the longest accepted prefix plus one
             token from the target (the bonus) are committed; the target cache goes back to the
             committed tokens (a crop; on a recurrent-state target the state saved before the pass and a
             replay of the committed tokens: trainer/eval/target_cache.py), and the verify pass's hidden
             states of the committed slots (anchor + accepted drafts) become the drafter's new context.

Numbers (see EvalReport): tau is the mean of (accepted + 1) over verify steps, as z-lab's benchmark
reports it. One deliberate difference: z-lab shortens the last block to fit max_new_tokens and counts
the tokens that survive the stop/length cut; here every verify step checks a full block and tau counts
its full acceptance, so tau measures the drafter alone (an oracle drafter scores exactly B whatever the
length); the cut only shows in `tokens_per_target_forward` and in the output.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, Field
from torch import Tensor, nn
from transformers import DynamicCache

from trainer.eval.context_length import ContextLengthReport, acceptance_by_context_length, draft_sliding_window
from trainer.eval.stops import stop_token_ids as default_stop_token_ids
from trainer.eval.target_cache import RollbackMode, TargetCache
from trainer.eval.teacher_forced import TeacherForcedReport, TrainingSemantics, teacher_forced_acceptance


class EvalError(ValueError):
    """Bad evaluation arguments (block size, prompts, temperature ...); the message is one line."""


@runtime_checkable
class DraftProposer(Protocol):
    """What the loop needs from a drafter: draft logits for one block.

    block_ids         [1, B]      the anchor then B-1 mask ids
    context_features  [1, C, k*H] raw concatenated target features of the C tokens verified since the
                                  previous call (all prompt tokens on the first call); C >= 1
    position_ids      [1, C+B]    positions of [new context..., block...]
    cache             a transformers DynamicCache holding the drafter's K/V of all earlier context; the
                      loop crops it back to the context length after the call
    returns           [1, B-1, V] logits for slots 1..B-1 (logits, not tokens: at temperature > 0 the
                      accept rule needs the draft distribution q)
    """

    def propose(self, block_ids: Tensor, context_features: Tensor, position_ids: Tensor, cache: DynamicCache) -> Tensor:
        ...


class DFlashProposer:
    """A DFlashDrafter on its frozen target: target embeddings in, target lm_head out."""

    def __init__(self, drafter: nn.Module, target: Any, vocab_ids: Tensor | None = None, served_as: Any = None) -> None:
        self.drafter = drafter
        self.target = target
        self.served_as = served_as  # trainer.model.served.ServedAs: the engine whose attention to build; None = ours
        self.dtype = next(drafter.parameters()).dtype
        self.vocab_ids = vocab_ids  # a reduced draft vocabulary: proposals only among these target ids
        self.mask_token_id = getattr(drafter, "mask_token_id", None)

    def num_proposals(self, block_size: int) -> int:
        """Draft tokens per verify step: slots 1..B-1 (slot 0 is the anchor, the previous step's bonus)."""
        return block_size - 1

    def propose(self, block_ids: Tensor, context_features: Tensor, position_ids: Tensor, cache: DynamicCache) -> Tensor:
        hidden = self.block_hidden(block_ids, context_features, position_ids, cache)[:, 1:].to(self.target.dtype)
        if self.vocab_ids is None:
            return self.target.logits(hidden)  # [1, B-1, V]
        # A draft vocabulary: its logits placed at their target ids, -inf elsewhere, so argmax and the
        # draft distribution q live in the target's vocabulary, as vLLM's d2t mapping serves them.
        draft = self.target.logits(hidden, self.vocab_ids)  # [1, B-1, Vd]
        full = draft.new_full((*draft.shape[:-1], self.target.vocab_size), float("-inf"))
        full[..., self.vocab_ids.to(draft.device)] = draft
        return full

    def block_hidden(self, block_ids: Tensor, context_features: Tensor, position_ids: Tensor,
                     cache: DynamicCache) -> Tensor:  # [1, B, H] the drafter's final-normed states of every slot
        block_embeds = self.target.embed(block_ids).to(self.dtype)  # [1, B, H] frozen target embeddings
        hidden = self.drafter(
            block_embeds,
            context_features.to(self.dtype),  # [1, C, k*H]; fc + hidden_norm happen inside the drafter
            position_ids,  # [1, C+B]
            attention_mask=None,  # one block over context strictly before its anchor: everything visible
            past_key_values=cache,
            use_cache=True,
            **({"served_as": self.served_as} if self.served_as is not None else {}),
        )  # [1, B, H]
        return hidden


class DFlash2Proposer(DFlashProposer):
    """A DFlash2Drafter: the candidate selector picks each slot's token among the unary top-K, walking from
    the anchor (z-lab's greedy `propose`; B-1 proposals from slots 1..B-1).

    Greedy only: the returned "logits" are the selector's scores at its K candidates and -inf elsewhere, so
    their argmax is the walk's token at every slot. Sampling would need the walk to follow the sampled
    tokens (z-lab's `select` at T > 0), which the loop's own sampling does not do."""

    greedy_only = True

    def propose(self, block_ids: Tensor, context_features: Tensor, position_ids: Tensor, cache: DynamicCache) -> Tensor:
        if block_ids.shape[1] != self.drafter.block_size:  # its convolutions count slots within a block
            raise EvalError(f"a DFlash2 drafter drafts blocks of {self.drafter.block_size} (it was trained so), "
                            f"not {block_ids.shape[1]}")
        # slots 1..B-1 propose (slot 0 is the anchor), as in DFlash: num_proposals is B-1
        hidden = self.block_hidden(block_ids, context_features, position_ids, cache)[:, 1:].to(self.target.dtype)
        unary = self.target.logits(hidden)[0]  # [B-1, V]
        selector = self.drafter.candidate_selector
        _tokens, candidates, scores = selector.greedy_walk(
            unary, hidden[0].to(self.dtype), int(block_ids[0, 0]))  # [B-1, K] each
        proposal = unary.new_full(unary.shape, float("-inf"))
        proposal.scatter_(1, candidates, scores.to(unary.dtype))
        return proposal[None]  # [1, B-1, V]


# Drafter classes whose proposer is defined in another module, which registers it when imported (trainer/eval/
# __init__.py imports them): that module builds on DFlashProposer, so this one cannot import it back.
_PROPOSERS: dict[type, Callable[..., DFlashProposer]] = {}


def register_proposer(drafter_class: type, proposer: Callable[..., DFlashProposer]) -> None:
    _PROPOSERS[drafter_class] = proposer


def proposer_for(drafter: nn.Module, target: Any, vocab_ids: Tensor | None = None, served_as: Any = None,
                 confidence_min: float | None = None) -> DFlashProposer:
    """The proposer of a drafter module, by its kind: DFlash2's selector walk, DSpark's Markov chain (with its
    confidence-scheduled drafting threshold, a decoding setting the module does not hold), or DFlash's slots."""
    from trainer.model.dflash2 import DFlash2Drafter

    for drafter_class, proposer in _PROPOSERS.items():
        if isinstance(drafter, drafter_class):
            return proposer(drafter, target, vocab_ids, served_as=served_as, confidence_min=confidence_min)
    if confidence_min is not None:
        raise EvalError("confidence-scheduled drafting (draft_confidence_min) needs a DSpark drafter")
    kind = DFlash2Proposer if isinstance(drafter, DFlash2Drafter) else DFlashProposer
    return kind(drafter, target, vocab_ids, served_as=served_as)


@dataclass
class GenerationResult:
    """One prompt's generation."""

    new_tokens: list[int]  # generated tokens only; ends at the first stop token (kept) or max_new_tokens
    target_forwards: int  # target passes, the prefill included
    wall_time_s: float  # prefill + decode, synchronised on CUDA
    acceptance_lengths: list[int] = field(default_factory=list)  # per verify step: accepted drafts + 1 (bonus)
    target_rollback: RollbackMode = "crop"  # how rejected drafts left the target's cache (trainer.eval.target_cache)
    state_replays: int = 0  # target forwards that re-ran committed tokens from a restored state (not counted above)
    context_lengths: list[int] = field(default_factory=list)  # per verify step: the anchor's position


class PromptLengthBucket(BaseModel):
    min_tokens: int
    max_tokens: int
    prompts: int
    verify_steps: int
    tau: float | None = Field(description="Pooled over the bucket's verify steps; null without any.")


def prompt_length_buckets(prompt_lengths: Sequence[int], results: Sequence[GenerationResult]) -> list[PromptLengthBucket]:
    """Buckets [1, 31], [32, 63], [64, 127], ...: long prompts give the drafter more context; a drafter
    trained on short documents shows it here."""
    buckets: dict[int, list[GenerationResult]] = {}
    for length, result in zip(prompt_lengths, results):
        low = 1 if length < 32 else 1 << (length.bit_length() - 1)
        buckets.setdefault(low, []).append(result)
    out = []
    for low in sorted(buckets):
        lengths = [a for r in buckets[low] for a in r.acceptance_lengths]
        out.append(PromptLengthBucket(
            min_tokens=low, max_tokens=31 if low == 1 else 2 * low - 1, prompts=len(buckets[low]),
            verify_steps=len(lengths), tau=sum(lengths) / len(lengths) if lengths else None,
        ))
    return out


class ServedEngineReport(BaseModel):
    """The speculative decoding of the same prompts with the drafter's attention built as one engine builds it."""

    engine: str
    same_semantics_as: list[str] = Field(default_factory=list, description="Other engines that decode identically.")
    tau: float
    verify_steps: int
    verify_steps_per_prompt: list[int] = Field(default_factory=list)
    tau_per_prompt: list[float | None] = Field(default_factory=list)
    per_position_acceptance: list[float] = Field(default_factory=list)
    lossless: bool | None = None
    serves_as_trained: bool = Field(description="The engine builds the drafter's attention as it trained.")


class EvalReport(BaseModel):
    """What `trainer eval` prints and what a run writes to eval.json."""

    tau: float = Field(
        description="Mean acceptance length: accepted draft tokens + 1 bonus token per verify step (z-lab's "
        "benchmark). 1.0 = the drafter never helps, block_size = every draft accepted. 0.0 if no verify "
        "step happened (every prompt stopped at its first token)."
    )
    per_position_acceptance: list[float] = Field(
        description="Slots 1..B-1: fraction of all verify steps in which that draft slot was accepted. "
        "Acceptance is a prefix, so slot k counts only when slots 1..k-1 were accepted too: the list never "
        "increases and sums to tau - 1."
    )
    per_position_acceptance_conditional: list[float | None] = Field(
        description="Slots 1..B-1: fraction accepted among the verify steps that reached the slot (slot k-1 "
        "accepted); null where no step reached it. Closest to a per-slot training accuracy."
    )
    acceptance_histogram: list[int] = Field(
        description="Entry i counts the verify steps with acceptance length i+1 (lengths 1..B)."
    )
    tokens_per_target_forward: float = Field(
        description="Output tokens / target forward passes (prefill included), after the stop and length "
        "cut. Plain greedy decoding scores 1.0."
    )
    time_per_token_spec_s: float = Field(description="Wall time per output token, speculative decoding.")
    time_per_token_greedy_s: float | None = Field(
        description="Wall time per output token, plain decoding of the target alone (argmax at T=0, sampling "
        "at T>0), measured in the same process on the same prompts. Null when not measured."
    )
    speedup: float | None = Field(
        description="time_per_token_greedy_s / time_per_token_spec_s; null when not measured."
    )
    lossless: bool | None = Field(
        description="At temperature 0: every prompt's output equals plain greedy decoding token for token. "
        "Null at T > 0 (sampled outputs are equal in distribution only) or when not checked. In bf16 a "
        "batched verify can flip near-tied argmaxes, which shows here as false."
    )
    lossless_mismatch_prompts: list[int] = Field(
        default_factory=list, description="Indices of the prompts whose output differed from greedy decoding."
    )
    target_rollback: RollbackMode = Field(
        "crop", description="How a rejected block left the target's cache: `crop` (attention K/V: exact), "
        "`state_history` (a recurrent state put back from the state the cache recorded after each verified "
        "position, transformers >= 5.25: no extra forward) or `state_replay` (the state saved before the verify "
        "pass is restored and the committed tokens re-run). Each way the decoding is the target's own."
    )
    state_replays: int = Field(
        0, description="Target forwards spent on those replays over all prompts (eval cost only: serving keeps "
        "per-position states instead; not in tokens_per_target_forward)."
    )
    prompts: int
    output_tokens: int = Field(description="Tokens generated by speculative decoding over all prompts.")
    verify_steps: int = Field(description="Verify passes over all prompts (tau's denominator).")
    block_size: int
    temperature: float
    max_new_tokens: int
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Tokens that end an answer: eos, generation_config eos ids and the "
        "chat template's end-of-turn token (generation stops where serving stops, at the end of the turn)."
    )
    prompt_lengths: list[int] = Field(default_factory=list, description="Tokens per prompt, in prompt order.")
    tau_per_prompt: list[float | None] = Field(
        default_factory=list, description="tau of each prompt (null where it had no verify step)."
    )
    verify_steps_per_prompt: list[int] = Field(default_factory=list)
    tau_by_prompt_length: list[PromptLengthBucket] = Field(
        default_factory=list, description="tau per prompt-length bucket (powers of two), pooled over verify steps."
    )
    teacher_forced: TeacherForcedReport | None = Field(
        None, description="The training objective's acceptance on the same decoded sequences "
        "(trainer.eval.teacher_forced); null when not measured."
    )
    acceptance_by_context_length: ContextLengthReport | None = Field(
        None, description="Verify steps by context length (the anchor's position), split at the drafter's "
        "sliding window (trainer.eval.context_length): acceptance within and beyond the window."
    )
    served_as: str = Field(
        "speculators", description="The serving engine whose drafter attention the decoding built "
        "(playbooks/serving/engines.yaml; `trainer eval --served-as`): speculators = vLLM = our training mask."
    )
    served_by_engine: dict[str, ServedEngineReport] | None = Field(
        None, description="A sliding-window drafter's run: the same prompts decoded as each engine whose window "
        "semantics differ from ours builds the drafter (null otherwise, or for `trainer eval`)."
    )


# --- one generation --------------------------------------------------------------------------------------


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions. A negative argument means 'remove that many' in every
    transformers version we support (5.x rejects positive values)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _features(hidden_states: Sequence[Tensor], feature_layer_ids: Sequence[int]) -> Tensor:
    # Layer id i is the output of decoder layer i, HF hidden_states[i + 1] (index 0 is the embeddings): the
    # same convention as FrozenTarget.forward_packed, so inference context matches training context.
    return torch.cat([hidden_states[i + 1] for i in feature_layer_ids], dim=-1)  # [1, S, k*H]


def _sample(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _pick(logits: Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """One token from [V] logits: argmax at T=0, else a sample of softmax(logits / T)."""
    if temperature == 0:
        return int(logits.argmax())
    return _sample(torch.softmax(logits.float() / temperature, dim=-1), generator)


def _stop_set(target: Any, stop_token_ids: Sequence[int] | None) -> set[int]:
    """stop_token_ids, else where serving stops: eos, generation_config eos ids and the chat turn's end."""
    if stop_token_ids is not None:
        return set(stop_token_ids)
    stops: set[int] = set()
    eos = getattr(target, "eos_token_id", None)
    if eos is not None:
        stops.add(eos)
    tokenizer = getattr(target, "tokenizer", None)
    if tokenizer is not None:
        stops |= set(default_stop_token_ids(tokenizer, getattr(target, "model", None)))
    return stops


def _device(target: Any) -> torch.device:
    return next(target.model.parameters()).device


def accept_greedy(draft_tokens: Tensor, target_logits: Tensor) -> tuple[int, int]:
    """Temperature 0. draft_tokens [B-1] for slots 1..B-1; target_logits [B, V] from verifying the block.

    Returns (accepted, bonus): how many leading drafts are kept and the target's token after them.
    """
    posterior = target_logits.argmax(dim=-1)  # [B]: posterior[j] is the target's token for slot j+1
    # Accept rule: draft slot j+1 is kept while it equals the target's own greedy choice for that position,
    # posterior[j], given everything before it (which, up to the first mismatch, is exactly what greedy
    # decoding would have produced). The first mismatch ends the block; the target's choice there (or after
    # the last slot, if all match) is the bonus token, so each verify commits at least one correct token.
    matches = (draft_tokens == posterior[:-1]).long()  # [B-1]
    accepted = int(matches.cumprod(dim=0).sum())
    return accepted, int(posterior[accepted])


def accept_rejection_sampling(
    draft_tokens: Tensor,  # [B-1] sampled from draft_probs
    draft_probs: Tensor,  # [B-1, V] q: softmax(draft logits / T)
    target_probs: Tensor,  # [B, V] p: softmax(target logits / T); row j is the distribution of slot j+1
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Temperature > 0: the standard speculative-sampling rule (Leviathan et al.; z-lab's _rejection_sample).

    Returns (accepted, bonus). The committed tokens are distributed exactly as sampling the target alone.
    """
    n_draft = draft_tokens.shape[0]
    slots = torch.arange(n_draft, device=draft_tokens.device)
    p = target_probs[slots, draft_tokens]  # [B-1] target probability of each drafted token
    q = draft_probs[slots, draft_tokens]  # [B-1] draft probability of each drafted token
    u = torch.rand(n_draft, generator=generator, device=draft_tokens.device, dtype=p.dtype)
    # Accept rule: keep draft d with probability min(1, p(d)/q(d)), i.e. u < p/q, written u*q < p so q = 0
    # cannot divide. Stop at the first rejection: later drafts were conditioned on a rejected token.
    accepted = int((u * q < p).long().cumprod(dim=0).sum())
    if accepted == n_draft:
        # Every draft survived: the bonus is a plain sample of the target after the last slot.
        return accepted, _sample(target_probs[n_draft], generator)
    # Rejected at slot `accepted`: resample from the residual max(0, p - q), renormalised. Accepting with
    # min(1, p/q) plus this residual makes the emitted token exactly p-distributed. If p == q the residual
    # is empty (that case cannot reject except by rounding); fall back to p.
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)  # [V]
    total = residual.sum()
    probs = residual / total if total > 0 else target_probs[accepted]
    return accepted, _sample(probs, generator)


@torch.no_grad()
def speculative_generate(
    drafter: DraftProposer | nn.Module,
    target: Any,
    prompt_ids: Sequence[int],
    *,
    feature_layer_ids: Sequence[int],
    block_size: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    generator: torch.Generator | None = None,
    record_states: bool = True,
) -> GenerationResult:
    """Draft-verify decoding of one prompt (batch 1) with KV caches for target and drafter.

    `target` is a FrozenTarget (uses .model, .embed, .logits, .mask_token_id, .eos_token_id, .dtype).
    `drafter` is a DFlashDrafter (wrapped in DFlashProposer) or any DraftProposer. stop_token_ids None:
    the target's eos; [] never stops early. block_size 1 is plain decoding through the same loop.
    `record_states=False`: a recurrent target rolls back by replay even where its cache records per-position
    states (trainer.eval.target_cache; for comparing the two).
    """
    proposer = proposer_for(drafter, target) if isinstance(drafter, nn.Module) else drafter
    if temperature > 0 and getattr(proposer, "greedy_only", False):
        raise EvalError(f"{type(proposer).__name__} proposes greedily only: evaluate at temperature 0")
    # Draft tokens per verify step: B-1 for DFlash (slots 1..B-1); B for a drafter whose slot 0 predicts too
    # (DSpark's sample_from_anchor). The verify block is the anchor then these drafts.
    proposals = num_proposals(proposer, block_size)
    if mask_token_id is None:
        mask_token_id = getattr(drafter, "mask_token_id", None)
        if mask_token_id is None:
            mask_token_id = target.mask_token_id
    stops = _stop_set(target, stop_token_ids)
    model = target.model
    device = _device(target)
    B = block_size
    n = len(prompt_ids)
    _sync(device)
    started = time.perf_counter()

    target_cache = TargetCache(model, verify_tokens=proposals + 1, record_states=record_states)
    draft_cache = DynamicCache()
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # [1, n]
    out = target_cache.forward(prompt, output_hidden_states=B > 1, logits_to_keep=1)
    target_forwards = 1
    tokens = list(prompt_ids) + [_pick(out.logits[0, -1], temperature, generator)]
    new_context = _features(out.hidden_states, feature_layer_ids) if B > 1 else None  # [1, n, k*H]
    acceptance_lengths: list[int] = []
    context_lengths: list[int] = []
    done = tokens[-1] in stops or max_new_tokens <= 1

    while not done:
        # Invariant: target cache and drafter context cover positions 0..start-1; the anchor (last committed
        # token, at `start`) has no hidden state yet, so it is only ever a block token, never context.
        start = len(tokens) - 1
        draft_block = torch.full((1, B), mask_token_id, dtype=torch.long, device=device)  # [1, B]
        draft_block[0, 0] = tokens[-1]
        # what the target verifies: the anchor, then the drafts (for DFlash the drafter's block, filled in)
        block = draft_block if proposals == B - 1 else draft_block.new_empty((1, proposals + 1))
        block[0, 0] = tokens[-1]
        draft_probs = None
        if B > 1:
            context_len = new_context.shape[1]
            positions = torch.arange(start - context_len, start + B, device=device)[None]  # [1, C+B]
            draft_logits = proposer.propose(draft_block, new_context, positions, draft_cache)[0]  # [P, V]
            _crop(draft_cache, start)  # drop the block's K/V; keep context 0..start-1
            if draft_logits.shape[0] < block.shape[1] - 1:  # a proposer that stopped drafting early this step
                block = block[:, : draft_logits.shape[0] + 1].clone()
            if temperature == 0:
                block[0, 1:] = draft_logits.argmax(dim=-1)
            else:
                draft_probs = torch.softmax(draft_logits.float() / temperature, dim=-1)  # [P, V]
                block[0, 1:] = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]

        target_cache.begin_verify()  # a recurrent state is recorded (or saved) here: no crop alone undoes it
        out = target_cache.forward(block, output_hidden_states=B > 1)  # positions start..start+P
        target_forwards += 1
        target_logits = out.logits[0]  # [P+1, V]: row j predicts the token at position start+j+1
        if B == 1:
            accepted, bonus = 0, _pick(target_logits[0], temperature, generator)
        elif temperature == 0:
            accepted, bonus = accept_greedy(block[0, 1:], target_logits)
        else:
            target_probs = torch.softmax(target_logits.float() / temperature, dim=-1)  # [B, V]
            accepted, bonus = accept_rejection_sampling(block[0, 1:], draft_probs, target_probs, generator)
        acceptance_lengths.append(accepted + 1)
        context_lengths.append(start)

        # Commit the accepted drafts and the bonus, cutting at the first stop token or at max_new_tokens.
        committed = block[0, 1 : 1 + accepted].tolist() + [bonus]
        produced = 0
        for token in committed:
            tokens.append(token)
            produced += 1
            if token in stops or len(tokens) - n >= max_new_tokens:
                done = True
                break
        # The target computed K/V (and a recurrent state) for the whole block; keep the anchor and the committed
        # drafts (positions start..start+produced-1): a crop, or on a recurrent target the saved state plus a
        # replay of those tokens. The newest token is the next anchor: not yet run through the target.
        target_cache.commit(block, start, produced)
        if B > 1:
            new_context = _features(out.hidden_states, feature_layer_ids)[:, :produced]  # [1, produced, k*H]

    _sync(device)
    return GenerationResult(
        new_tokens=tokens[n:],
        target_forwards=target_forwards,
        wall_time_s=time.perf_counter() - started,
        acceptance_lengths=acceptance_lengths,
        target_rollback=target_cache.rollback,
        state_replays=target_cache.replays,
        context_lengths=context_lengths,
    )


def num_proposals(drafter: Any, block_size: int) -> int:
    """Draft tokens a verify step holds for this drafter (a module or a proposer): block_size - 1 unless the
    proposer says otherwise."""
    counter = getattr(drafter, "num_proposals", None)
    if block_size <= 1 or isinstance(drafter, nn.Module) or counter is None:
        return block_size - 1
    return int(counter(block_size))


@torch.no_grad()
def greedy_generate(
    target: Any,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """The baseline: the target alone, one token per forward with a KV cache (argmax at T=0, else sampled).

    Same stop rule as speculative_generate: the first stop token is kept and ends the output.
    """
    stops = _stop_set(target, stop_token_ids)
    device = _device(target)
    _sync(device)
    started = time.perf_counter()
    cache = TargetCache(target.model)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # [1, n]
    new_tokens: list[int] = []
    forwards = 0
    while True:
        out = cache.forward(ids, logits_to_keep=1)  # positions continue where the cache ends
        forwards += 1
        token = _pick(out.logits[0, -1], temperature, generator)
        new_tokens.append(token)
        if token in stops or len(new_tokens) >= max_new_tokens:
            break
        ids = torch.tensor([[token]], dtype=torch.long, device=device)
    _sync(device)
    return GenerationResult(new_tokens=new_tokens, target_forwards=forwards, wall_time_s=time.perf_counter() - started)


# --- the evaluation -----------------------------------------------------------------------------------


def _generator(device: torch.device, seed: int) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _validate(prompts: Sequence[Sequence[int]], block_size: int, max_new_tokens: int, temperature: float,
              feature_layer_ids: Sequence[int]) -> None:
    if not prompts:
        raise EvalError("no prompts to evaluate on")
    if any(len(p) == 0 for p in prompts):
        raise EvalError("every prompt needs at least one token")
    if block_size < 1:
        raise EvalError(f"block size must be at least 1, got {block_size}")
    if max_new_tokens < 1:
        raise EvalError(f"max new tokens must be at least 1, got {max_new_tokens}")
    if not temperature >= 0:  # also rejects NaN
        raise EvalError(f"temperature must be >= 0, got {temperature}")
    if block_size > 1 and not feature_layer_ids:
        raise EvalError("feature_layer_ids is empty: the drafter needs at least one target layer")


def evaluate(
    drafter: DraftProposer | nn.Module,
    target: Any,
    prompts: Sequence[Sequence[int]],
    *,
    feature_layer_ids: Sequence[int],
    block_size: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] | None = None,
    measure_speedup: bool = True,
    check_lossless: bool | None = None,
    seed: int = 0,
    mask_token_id: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    teacher_forcing: TrainingSemantics | None = None,
    served_as: Any = None,
) -> EvalReport:
    """Speculative decoding on every prompt, against plain decoding of the same target.

    measure_speedup: also time plain decoding (after one untimed warm-up of both) for `speedup`.
    check_lossless (default: at T=0): run plain greedy decoding and compare outputs token for token.
    At T=0 with measure_speedup=False and check_lossless=False only the speculative loop runs (cheapest;
    what a frequent in-training tau needs). The drafter's train/eval mode is restored afterwards; the global
    RNG is untouched (sampling uses generators seeded with seed + prompt index).
    progress(done, total) is called after each prompt.
    teacher_forcing: also score the decoded sequences under the run's training semantics
    (trainer.eval.teacher_forced), so the training objective's acceptance sits next to the real tau.
    stop_token_ids None: stop where serving stops (eos, generation_config eos ids, the chat turn's end).
    served_as: an engine name or trainer.model.served.ServedAs: the drafter's attention is built as that engine
    builds it (None: speculators / vLLM, our training mask). A full-attention drafter decodes the same in all.
    """
    _validate(prompts, block_size, max_new_tokens, temperature, feature_layer_ids)
    from trainer.model.served import ServedAs, served_as as engine_row

    engine = served_as if isinstance(served_as, ServedAs) else engine_row(served_as)
    if served_as is None:
        pass  # the drafter's own attention: our training mask, speculators' / vLLM's
    elif isinstance(drafter, nn.Module):
        drafter = proposer_for(drafter, target, served_as=engine)
    elif isinstance(drafter, DFlashProposer):  # the same proposer (its kind and settings kept), as the engine builds it
        drafter = copy.copy(drafter)
        drafter.served_as = engine
    else:
        raise EvalError(f"--served-as needs a DFlash drafter; {type(drafter).__name__} builds its own attention")
    if check_lossless is None:
        check_lossless = temperature == 0
    check_lossless = check_lossless and temperature == 0
    run_baseline = measure_speedup or check_lossless
    device = _device(target)
    draft_module = drafter if isinstance(drafter, nn.Module) else getattr(drafter, "drafter", None)
    was_training = isinstance(draft_module, nn.Module) and draft_module.training
    if isinstance(draft_module, nn.Module):
        draft_module.eval()

    def spec(prompt: Sequence[int], max_new: int, seed_: int) -> GenerationResult:
        return speculative_generate(
            drafter, target, prompt, feature_layer_ids=feature_layer_ids, block_size=block_size,
            max_new_tokens=max_new, temperature=temperature, stop_token_ids=stop_token_ids,
            mask_token_id=mask_token_id, generator=_generator(device, seed_),
        )

    def plain(prompt: Sequence[int], max_new: int, seed_: int) -> GenerationResult:
        return greedy_generate(
            target, prompt, max_new_tokens=max_new, temperature=temperature, stop_token_ids=stop_token_ids,
            generator=_generator(device, seed_),
        )

    stops = sorted(_stop_set(target, stop_token_ids))
    stop_token_ids = stops
    try:
        if measure_speedup:  # first calls pay for allocator growth and kernel selection: keep them untimed
            spec(prompts[0], min(max_new_tokens, 2 * block_size), seed)
            plain(prompts[0], min(max_new_tokens, 2 * block_size), seed)
        spec_results: list[GenerationResult] = []
        base_results: list[GenerationResult] = []
        for index, prompt in enumerate(prompts):
            # Alternate the two per prompt so drift in machine load hits both measurements alike.
            spec_results.append(spec(prompt, max_new_tokens, seed + index))
            if run_baseline:
                base_results.append(plain(prompt, max_new_tokens, seed + index))
            if progress is not None:
                progress(index + 1, len(prompts))
        teacher_forced = None
        # The drafter module behind a DFlashProposer too; a reduced draft vocabulary scores in its own
        # head, which the teacher-forced replay does not model yet, so it is left out there.
        if (teacher_forcing is not None and isinstance(draft_module, nn.Module)
                and getattr(drafter, "vocab_ids", None) is None):
            # The decoded sequences themselves (at T=0 exactly the target's greedy continuation), so both
            # numbers see the same tokens.
            teacher_forced = teacher_forced_acceptance(
                draft_module, target, [(p, r.new_tokens) for p, r in zip(prompts, spec_results)], teacher_forcing,
                acceptance_lengths=[r.acceptance_lengths for r in spec_results],
            )
    finally:
        if was_training:
            draft_module.train()

    lengths = [length for result in spec_results for length in result.acceptance_lengths]
    steps = len(lengths)
    verify = num_proposals(drafter, block_size) + 1  # the longest acceptance: every draft plus the bonus
    # reached[k]: steps whose acceptance length is >= k+1, i.e. that accepted draft slot k (reached[0] = all).
    reached = [sum(1 for length in lengths if length >= k + 1) for k in range(verify)]
    output_tokens = sum(len(r.new_tokens) for r in spec_results)
    spec_time = sum(r.wall_time_s for r in spec_results) / output_tokens
    base_time = None
    if measure_speedup:
        base_time = sum(r.wall_time_s for r in base_results) / sum(len(r.new_tokens) for r in base_results)
    mismatches = (
        [i for i, (s, b) in enumerate(zip(spec_results, base_results)) if s.new_tokens != b.new_tokens]
        if check_lossless else []
    )
    return EvalReport(
        tau=sum(lengths) / steps if steps else 0.0,
        per_position_acceptance=[reached[k] / steps if steps else 0.0 for k in range(1, verify)],
        per_position_acceptance_conditional=[
            reached[k] / reached[k - 1] if reached[k - 1] else None for k in range(1, verify)
        ],
        acceptance_histogram=[sum(1 for length in lengths if length == k) for k in range(1, verify + 1)],
        tokens_per_target_forward=output_tokens / sum(r.target_forwards for r in spec_results),
        time_per_token_spec_s=spec_time,
        time_per_token_greedy_s=base_time,
        speedup=base_time / spec_time if base_time is not None and spec_time > 0 else None,
        lossless=(not mismatches) if check_lossless else None,
        lossless_mismatch_prompts=mismatches,
        target_rollback=spec_results[0].target_rollback,
        state_replays=sum(r.state_replays for r in spec_results),
        prompts=len(prompts),
        output_tokens=output_tokens,
        verify_steps=steps,
        block_size=block_size,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stops,
        prompt_lengths=[len(p) for p in prompts],
        tau_per_prompt=[
            sum(r.acceptance_lengths) / len(r.acceptance_lengths) if r.acceptance_lengths else None
            for r in spec_results
        ],
        verify_steps_per_prompt=[len(r.acceptance_lengths) for r in spec_results],
        tau_by_prompt_length=prompt_length_buckets([len(p) for p in prompts], spec_results),
        teacher_forced=teacher_forced,
        # null where a generation did not record the anchor of each verify step
        acceptance_by_context_length=acceptance_by_context_length(
            [c for r in spec_results for c in r.context_lengths], lengths, verify, draft_sliding_window(drafter),
        ) if len(lengths) == sum(len(r.context_lengths) for r in spec_results) else None,
        served_as=engine.engine,
    )


def evaluate_served_by_engine(drafter: nn.Module, ours: EvalReport,
                              decode_as: Callable[[Any], EvalReport]) -> dict[str, ServedEngineReport] | None:
    """A sliding-window drafter decoded as each engine of playbooks/serving/engines.yaml builds it: one decoding
    per distinct semantics (`ours` is the default's, speculators / vLLM), reported per engine. None for a
    full-attention drafter, which every engine serves as trained.

    decode_as(engine) runs `evaluate(..., served_as=engine)` on the same prompts.
    """
    from trainer.model.served import engine_names, served_as

    attention = getattr(drafter, "attention", None)
    if attention is None or not attention.slides:
        return None
    default = served_as(None)
    groups: dict[tuple[str, bool], list[Any]] = {}
    for name in engine_names(emulated_only=True):
        row = served_as(name)
        groups.setdefault(row.semantics(attention), []).append(row)
    out: dict[str, ServedEngineReport] = {}
    for semantics, rows in groups.items():
        report = ours if semantics == default.semantics(attention) else decode_as(rows[0])
        for row in rows:
            out[row.engine] = ServedEngineReport(
                engine=row.engine, same_semantics_as=[r.engine for r in rows if r is not row], tau=report.tau,
                verify_steps=report.verify_steps, verify_steps_per_prompt=report.verify_steps_per_prompt,
                tau_per_prompt=report.tau_per_prompt, per_position_acceptance=report.per_position_acceptance,
                lossless=report.lossless, serves_as_trained=row.serves_as_trained(attention),
            )
    return out
