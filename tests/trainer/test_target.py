"""FrozenTarget on a tiny saved Qwen3: packed forward, layer offset, logits source, errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from trainer.target import FrozenTarget, TargetError
from trainer.target.embedded import build_embedded_tokenizer

NUM_LAYERS = 4
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # Tiny models: a second intra-op thread gains nothing and, on a busy 2-core machine (the test
    # suite in parallel), oversubscription makes every op many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def save_tiny_target(directory, tokenizer, extra_rows: int = 0, seed: int = 0):
    config = Qwen3Config(
        vocab_size=len(tokenizer) + extra_rows, hidden_size=32, intermediate_size=64, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    # Random init leaves the norms at 1; perturb them so a missing or doubled final norm shows.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.5 * torch.rand_like(param))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer():
    return build_embedded_tokenizer(small=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    return save_tiny_target(tmp_path_factory.mktemp("tiny"), tokenizer)


@pytest.fixture(scope="module")
def target(tiny_dir):
    return FrozenTarget.load(str(tiny_dir), CPU)


def plain_forward(target, ids: list[int]):
    """Reference: one document alone, with transformers' own causal mask and positions."""
    return target.model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)


def test_load_freezes_the_model_and_reads_sizes(target, tokenizer):
    assert not target.model.training
    assert all(not p.requires_grad for p in target.model.parameters())
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (NUM_LAYERS, 32, len(tokenizer))
    assert target.mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>")
    assert target.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert target.pad_token_id == tokenizer.convert_tokens_to_ids("<|pad|>")
    assert target.dtype == torch.float32 and len(target.fingerprint) == 64


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_forward_equals_each_document_alone(tiny_dir, implementation):
    target = FrozenTarget.load(str(tiny_dir), CPU)
    target.model.set_attn_implementation(implementation)  # sdpa takes a bool mask, eager an additive one
    assert target.model.config._attn_implementation == implementation
    documents = [[list(range(10, 15)), list(range(40, 47)), [5, 6, 7]], [list(range(60, 72)), [9, 8, 7, 6]]]
    seq_len, layer_ids = 17, [0, 2]
    input_ids = torch.full((2, seq_len), target.pad_token_id)
    position_ids = torch.zeros((2, seq_len), dtype=torch.long)
    doc_ids = torch.full((2, seq_len), -1)
    for row, docs in enumerate(documents):
        offset = 0
        for d, ids in enumerate(docs):
            input_ids[row, offset:offset + len(ids)] = torch.tensor(ids)
            position_ids[row, offset:offset + len(ids)] = torch.arange(len(ids))
            doc_ids[row, offset:offset + len(ids)] = d
            offset += len(ids)

    features, logits = target.forward_packed(input_ids, position_ids, doc_ids, layer_ids, "final")
    assert features.shape == (2, seq_len, 2 * 32) and logits.shape == (2, seq_len, target.vocab_size)
    assert torch.isfinite(features).all() and torch.isfinite(logits).all()  # padding rows too
    for row, docs in enumerate(documents):
        offset = 0
        for ids in docs:
            alone = plain_forward(target, ids)
            expected = torch.cat([alone.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
            span = slice(offset, offset + len(ids))
            torch.testing.assert_close(features[row, span], expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits[row, span], alone.logits[0], atol=1e-5, rtol=1e-5)
            offset += len(ids)


def test_feature_layer_id_i_is_hidden_states_i_plus_one(target):
    ids = [3, 14, 15, 92, 65, 35]
    alone = plain_forward(target, ids)
    zeros = torch.zeros(1, len(ids), dtype=torch.long)
    for layer in range(NUM_LAYERS - 1):
        features, _ = target.forward_packed(torch.tensor([ids]), torch.arange(len(ids))[None], zeros, [layer], "final")
        torch.testing.assert_close(features[0], alone.hidden_states[layer + 1][0], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(features[0], alone.hidden_states[layer][0], atol=1e-3)


def test_logits_source_intermediate_layer_uses_final_norm_and_lm_head(target):
    ids = [7, 1, 8, 2, 8, 1, 8]
    alone = plain_forward(target, ids)
    zeros = torch.zeros(1, len(ids), dtype=torch.long)
    positions = torch.arange(len(ids))[None]
    norm, head = target.model.model.norm, target.model.lm_head
    h = alone.hidden_states[2][0]  # output of decoder layer 1
    rms = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + target.model.config.rms_norm_eps)
    expected = (rms * norm.weight) @ head.weight.T
    _, logits = target.forward_packed(torch.tensor([ids]), positions, zeros, [0], 1)
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits[0], alone.logits[0], atol=1e-2)
    # The last layer's id names the model's own output.
    _, last = target.forward_packed(torch.tensor([ids]), positions, zeros, [0], NUM_LAYERS - 1)
    torch.testing.assert_close(last[0], alone.logits[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(TargetError):
        target.forward_packed(torch.tensor([ids]), positions, zeros, [0], NUM_LAYERS)


def test_embed_and_logits_are_the_frozen_tables(target):
    ids = torch.tensor([[1, 5, 9]])
    torch.testing.assert_close(target.embed(ids), target.model.model.embed_tokens.weight[ids])
    hidden = torch.randn(2, 3, 32)
    torch.testing.assert_close(target.logits(hidden), hidden @ target.model.lm_head.weight.T)


def test_fingerprint_is_stable_and_changes_with_the_weights(tiny_dir, tmp_path, tokenizer, target):
    assert FrozenTarget.load(str(tiny_dir), CPU).fingerprint == target.fingerprint
    other = save_tiny_target(tmp_path / "other", tokenizer, seed=1)
    assert FrozenTarget.load(str(other), CPU).fingerprint != target.fingerprint


def test_mask_token_falls_back_to_an_unused_row_else_errors(tmp_path, tokenizer):
    no_mask = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>")
    assert no_mask.mask_token_id is None
    padded = save_tiny_target(tmp_path / "padded", tokenizer, extra_rows=64)
    no_mask.save_pretrained(padded)
    target = FrozenTarget.load(str(padded), CPU)
    assert target.mask_token_id == len(no_mask) and target.vocab_size == len(no_mask) + 64

    exact = save_tiny_target(tmp_path / "exact", tokenizer)
    no_mask.save_pretrained(exact)
    with pytest.raises(TargetError, match="set mask_token_id"):
        FrozenTarget.load(str(exact), CPU)
    assert FrozenTarget.load(str(exact), CPU, mask_token_id=7).mask_token_id == 7


def test_bad_targets_give_one_line_errors(tmp_path, tiny_dir):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    shutil.copy(tiny_dir / "config.json", no_tokenizer / "config.json")
    not_causal = tmp_path / "not_causal"
    shutil.copytree(tiny_dir, not_causal)
    (not_causal / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    cases = {
        tmp_path / "missing": "does not exist",
        tmp_path / "file": "not a directory",
        tmp_path / "empty": "no config.json",
        no_tokenizer: "no tokenizer",
        not_causal: "cannot load",
    }
    for path, expected in cases.items():
        with pytest.raises(TargetError) as info:
            FrozenTarget.load(str(path), CPU)
        assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)
