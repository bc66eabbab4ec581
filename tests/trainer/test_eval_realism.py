"""Eval realism (issue 13 item 4) and the teacher-forced acceptance next to tau (issue 16):
generation stops where serving stops, chat prompts are user turns, tau per prompt length, and the
training objective's acceptance on the decoded sequences, checked against a naive per-anchor loop."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from trainer.data.datasets import heldout_prompts
from trainer.eval.speculative import DFlashProposer, GenerationResult, _stop_set, evaluate, prompt_length_buckets
from trainer.eval.stops import chat_turn_end_token_id, stop_token_ids
from trainer.eval.teacher_forced import TrainingSemantics, teacher_forced_acceptance
from trainer.model.drafter import DFlashDrafter
from trainer.target.frozen import FrozenTarget

VOCAB = 8
MASK_ID = VOCAB - 1
FEATURES = [0, 2]
WORDS = ["what", "is", "two", "plus", "three", "five", "the", "capital", "of", "france", "paris", "?", "."]
SPECIAL = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + ["\n", " ", "user", "assistant", "system"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n| "), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    path = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)  # through from_pretrained, as a target's tokenizer is loaded


def test_the_chat_templates_turn_end_is_a_stop_token(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert chat_turn_end_token_id(tokenizer) == im_end
    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=[0, 7]))
    assert stop_token_ids(tokenizer, model) == sorted({tokenizer.eos_token_id, 7, im_end})
    target = SimpleNamespace(eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer, model=model)
    assert _stop_set(target, None) == {0, 7, im_end}
    assert _stop_set(target, []) == set()  # an explicit list still wins


def test_a_tokenizer_without_chat_template_stops_at_eos_only(tokenizer):
    plain = SimpleNamespace(chat_template=None, eos_token_id=0)
    assert chat_turn_end_token_id(plain) is None and stop_token_ids(plain) == [0]


def test_chat_prompts_are_user_turns_cycling_through_each_document(tokenizer, tmp_path):
    rows = []
    for i in range(3):
        rows.append({"messages": [
            {"role": "user", "content": "what is two plus three ?"}, {"role": "assistant", "content": "five ."},
            {"role": "user", "content": "the capital of france ?"}, {"role": "assistant", "content": "paris ."},
        ]})
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = heldout_prompts(str(data), tokenizer, 3)
    generation_prompt = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert all(p[-len(generation_prompt):] == generation_prompt for p in prompts)
    first_turn = tokenizer.apply_chat_template(rows[0]["messages"][:1], add_generation_prompt=True, tokenize=False)
    second_turn = tokenizer.apply_chat_template(rows[0]["messages"][:3], add_generation_prompt=True, tokenize=False)
    first, second = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (first_turn, second_turn))
    assert prompts == [first, second, first]  # one per document: turn 0, turn 1, turn 0


def test_tau_per_prompt_length_bucket():
    results = [GenerationResult([1], 1, 0.0, lengths) for lengths in ([2, 4], [1], [3, 3, 3])]
    buckets = prompt_length_buckets([10, 40, 50], results)
    assert [(b.min_tokens, b.max_tokens, b.prompts, b.verify_steps, b.tau) for b in buckets] == [
        (1, 31, 1, 2, 3.0), (32, 63, 2, 4, 2.5)]


# --- teacher-forced acceptance against a naive per-anchor loop -------------------------------------------


def tiny_target(path: Path) -> FrozenTarget:
    # A vocabulary of 8 makes a random drafter right about one slot in eight: counts worth comparing.
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.3,
                         tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = SimpleNamespace(eos_token_id=None, pad_token_id=0, mask_token_id=MASK_ID, chat_template=None)
    return FrozenTarget(model.requires_grad_(False), tokenizer, path, "t", mask_token_id=MASK_ID)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> FrozenTarget:
    return tiny_target(tmp_path_factory.mktemp("tiny"))


def drafter_for(target: FrozenTarget, block_size: int) -> DFlashDrafter:
    torch.manual_seed(1)
    return DFlashDrafter.from_target_config(target.model.config, num_layers=2, num_features=len(FEATURES),
                                            block_size=block_size, mask_token_id=MASK_ID).eval()


@torch.no_grad()
def naive_counts(drafter, target, prompt, new_tokens, block_size):
    """Every generated position p anchors one block, drafted exactly as the serving loop drafts it: context
    = target features of tokens 0..p-1 (a fresh forward of that prefix), block [token p, mask, ...]."""
    ids = list(prompt) + list(new_tokens)
    full = target.model(input_ids=torch.tensor([ids]))
    target_argmax = full.logits[0].argmax(-1)  # [S]
    proposer = DFlashProposer(drafter, target)
    correct, labels = [0] * (block_size - 1), [0] * (block_size - 1)
    for p in range(len(prompt), len(ids) - 1):
        prefix = target.model(input_ids=torch.tensor([ids[:p]]), output_hidden_states=True)
        features = torch.cat([prefix.hidden_states[i + 1] for i in FEATURES], dim=-1)
        block = torch.full((1, block_size), MASK_ID)
        block[0, 0] = ids[p]
        draft = proposer.propose(block, features, torch.arange(p + block_size)[None], DynamicCache())[0].argmax(-1)
        for j in range(1, block_size):
            if p + j - 1 <= len(ids) - 1 and p + j <= len(ids) - 1:
                labels[j - 1] += 1
                correct[j - 1] += int(draft[j - 1] == target_argmax[p + j - 1])
    return correct, labels


def test_teacher_forced_position_accuracy_equals_a_naive_per_anchor_loop(target):
    block_size = 4
    drafter = drafter_for(target, block_size)
    sequences = [([5, 1, 4, 6, 2], [1, 2, 3, 4, 5, 6, 0, 1, 2, 3]), ([3, 2, 1], [0, 6, 5, 4])]
    semantics = TrainingSemantics(FEATURES, "final", False, block_size, MASK_ID)
    report = teacher_forced_acceptance(drafter, target, sequences, semantics)
    correct, labels = [0] * 3, [0] * 3
    for prompt, new in sequences:
        c, n = naive_counts(drafter, target, prompt, new, block_size)
        correct, labels = [a + b for a, b in zip(correct, c)], [a + b for a, b in zip(labels, n)]
    assert report.position_acc == pytest.approx([c / n for c, n in zip(correct, labels)])
    expected, survive = 1.0, 1.0
    for acc in report.position_acc:
        survive *= acc
        expected += survive
    assert report.acceptance == pytest.approx(expected)
    assert len(report.acceptance_per_prompt) == 2 and report.blocks == 9 + 3  # anchors n..S-2 per sequence
    assert sum(correct) > 3  # the comparison is not between two lists of zeros


def test_evaluate_reports_teacher_forced_next_to_tau_and_a_leaky_context_scores_differently(target):
    drafter = drafter_for(target, 4)
    common = dict(feature_layer_ids=FEATURES, block_size=4, max_new_tokens=24, measure_speedup=False,
                  stop_token_ids=[])
    honest = evaluate(drafter, target, [[5, 1, 4, 6], [1, 2, 3]],
                      teacher_forcing=TrainingSemantics(FEATURES, "final", False, 4, MASK_ID), **common)
    assert honest.teacher_forced is not None and len(honest.tau_per_prompt) == 2
    # Serving semantics: at the anchors serving used, the training objective's prefix IS the acceptance.
    tf = honest.teacher_forced
    assert tf.verify_steps_compared > 0
    assert tf.at_verify_per_prompt == tf.tau_at_verify_per_prompt and tf.at_verify == tf.tau_at_verify
    assert tf.verify_steps_above == tf.verify_steps_below == 0
    # At T=0 the decoded tokens are the target's argmax: serving's labels are the training labels, every slot.
    assert tf.label_agreement == 1.0 and tf.label_slots > 0
    assert honest.prompt_lengths == [4, 3] and honest.stop_token_ids == []
    leaky = evaluate(drafter, target, [[5, 1, 4, 6], [1, 2, 3]],
                     teacher_forcing=TrainingSemantics(FEATURES, 1, True, 4, MASK_ID), **common)
    assert leaky.tau == honest.tau  # serving does not change with the training semantics
    assert leaky.teacher_forced.logits_source == "1" and leaky.teacher_forced.context_includes_anchor
    assert leaky.teacher_forced.position_acc != honest.teacher_forced.position_acc
    # layer 1's logits are not the model's output: those labels are not the served tokens everywhere
    assert leaky.teacher_forced.label_agreement < 1.0
    assert leaky.teacher_forced.label_slots == honest.teacher_forced.label_slots


# --- a real run records everything sleuth reads ---------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from trainer.config import build_config
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir
    from trainer.target.embedded import build_embedded_target

    root = tmp_path_factory.mktemp("realism")
    target_path = build_embedded_target(root / "target", small=True, steps=1, progress=False)
    config = build_config(extra=dict(
        target=str(target_path), steps=2, batch_size=2, seq_len=64, draft_layers=1, block_size=4, max_anchors=4,
        eval_every=2, eval_prompts=2, eval_max_new_tokens=8, warmup_steps=0, log_every=1,
    ))
    train(RunDir(root / "runs" / "r"), config, preset=None, device="cpu", progress=False)
    return root / "runs" / "r"


def test_a_run_records_teacher_forced_acceptance_the_mask_count_and_the_rendering(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    eval_row = [r for r in rows if "tau" in r][-1]
    assert {"tau", "tau_per_prompt", "tf_acceptance", "tf_acceptance_per_prompt", "tf_at_verify",
            "tf_tau_at_verify", "tf_at_verify_per_prompt", "tf_tau_at_verify_per_prompt", "tf_verify_steps_above",
            "tf_verify_steps_below", "tf_label_agreement", "tf_label_slots"} <= set(eval_row)
    assert len(eval_row["tau_per_prompt"]) == len(eval_row["tf_acceptance_per_prompt"]) == 2
    report = json.loads((run_dir / "eval.json").read_text())
    assert report["teacher_forced"]["acceptance"] >= 1.0 and report["tau_by_prompt_length"]
    assert report["prompts"] == {"chat_template_sha256": None, "chat_template_kwargs": {}}  # embedded text data
    # The drafter's rotary settings as its module applies them (sleuth's dflash.rope_served_as_trained).
    drafter = json.loads((run_dir / "run.json").read_text())["drafter"]
    target_config = json.loads((Path(json.loads((run_dir / "run.json").read_text())["target"]["path"]) / "config.json").read_text())
    assert drafter["rotary_dim"] == drafter["head_dim"] and drafter["rope_parameters"]["partial_rotary_factor"] == 1.0
    assert drafter["rope_parameters"]["rope_theta"] == target_config["rope_parameters"]["rope_theta"]
    assert report["stop_token_ids"]  # eos and <|im_end|> at least
    data = json.loads((run_dir / "run.json").read_text())["data"]
    assert data["mask_token_count"] == 0 and data["chat_template_sha256"] is None
