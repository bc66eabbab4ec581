"""Target fidelity: the packed forward is measured against the model's own, the packing way is chosen by
that measurement, and a run refuses to train on a target it cannot reproduce unless told to.

gpt-oss is the hard case: its forward builds its per-layer masks without the positions, so the
"positions" way silently drops its sliding window (and packs documents into each other); only the
{layer type: mask} way reproduces it. The references are the model's own forward on each document alone.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.tiny_targets import SLIDING_WINDOW, save_family_target
from trainer.run.rundir import RunDir, RunError
from trainer.target import FrozenTarget
from trainer.target.fidelity import check_lengths, choose_packing, longest_window, measure, token_stream

CPU = torch.device("cpu")
RUN = dict(
    data="embedded", steps=1, batch_size=2, seq_len=48, draft_layers=2, block_size=4, max_anchors=2,
    eval_every=None, eval_prompts=1, eval_max_new_tokens=4, warmup_steps=0, checkpoint_every=1,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    from trainer.target.embedded import build_embedded_tokenizer

    return build_embedded_tokenizer(small=True)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, tokenizer):
    return save_family_target("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), tokenizer)


@pytest.fixture(scope="module")
def stream(tokenizer):
    from trainer.data.datasets import load_documents

    return token_stream([d.input_ids for d in load_documents("embedded", tokenizer, split="heldout")], 48)


def test_longest_window_reads_every_kind_of_window():
    from transformers import Gemma2Config, Llama4TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    assert longest_window(LlamaConfig()) is None
    assert longest_window(Qwen2Config(sliding_window=64, use_sliding_window=False)) is None  # switched off
    assert longest_window(MistralConfig(sliding_window=64)) == 64  # every layer
    assert longest_window(Gemma2Config(sliding_window=32, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])) == 32
    assert longest_window(Gemma2Config(sliding_window=32, num_hidden_layers=2, layer_types=["full_attention"] * 2)) is None
    assert longest_window(Llama4TextConfig(attention_chunk_size=16, num_hidden_layers=4)) == 16


def test_check_document_is_longer_than_the_window_and_fills_the_row(gpt_oss_dir):
    target = FrozenTarget.load(str(gpt_oss_dir), CPU)
    lead, document = check_lengths(target, seq_len=48)
    assert lead + document >= 48 and document > SLIDING_WINDOW
    lead, document = check_lengths(target, seq_len=8)  # a row shorter than the window: the document is not
    assert document >= SLIDING_WINDOW + 16


def test_positions_alone_drop_gpt_oss_window_and_the_check_picks_layer_masks(gpt_oss_dir, stream):
    target = FrozenTarget.load(str(gpt_oss_dir), CPU)
    lead = 6
    hidden, logits = measure(target, stream[:lead], stream[lead:], "positions")
    assert hidden > 0.1 and logits > 0.01  # measured 1.9 and 0.28: far outside float32 noise
    record = choose_packing(target, stream, lead)
    assert record.packing == target.packing == "layer_masks" and record.passed
    assert max(record.max_abs_hidden_diff, record.max_abs_logit_diff) < 1e-5
    assert record.tried["positions"]["max_abs_hidden_diff"] == pytest.approx(hidden)
    forced = choose_packing(target, stream, lead, packing="positions")
    assert not forced.passed and forced.packing == "positions" and forced.tried == {}


def packed_batch(pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two packed rows of 24: two documents each, then padding."""
    documents = [[list(range(10, 25)), list(range(40, 47))], [list(range(60, 72)), [9, 8, 7, 6]]]
    seq_len = 24
    input_ids = torch.full((2, seq_len), pad_token_id)
    position_ids = torch.zeros((2, seq_len), dtype=torch.long)
    doc_ids = torch.full((2, seq_len), -1)
    for row, docs in enumerate(documents):
        offset = 0
        for d, ids in enumerate(docs):
            input_ids[row, offset:offset + len(ids)] = torch.tensor(ids)
            position_ids[row, offset:offset + len(ids)] = torch.arange(len(ids))
            doc_ids[row, offset:offset + len(ids)] = d
            offset += len(ids)
    return input_ids, position_ids, doc_ids


def test_every_packing_way_gives_the_same_rows_on_a_plain_target(tmp_path, tokenizer):
    """On Llama (no window) all three ways compute the same packed batch, padding rows included; so do the
    documents end to end in one row ("varlen"'s layout: its kernels are CUDA-only, its layout is not)."""
    target = FrozenTarget.load(str(save_family_target("llama", tmp_path / "llama", tokenizer)), CPU)
    input_ids, position_ids, doc_ids = packed_batch(target.pad_token_id)
    real = doc_ids >= 0
    hidden, logits = target._varlen(input_ids, position_ids, doc_ids)
    reference_hidden, reference_logits = target._per_document(input_ids, position_ids, doc_ids)
    torch.testing.assert_close(logits, reference_logits, atol=1e-5, rtol=1e-5)
    for h, reference in zip(hidden, reference_hidden, strict=True):
        torch.testing.assert_close(h, reference, atol=1e-5, rtol=1e-5)
    assert not logits[~real].any()  # padding stays zero
    outputs = {}
    for mode in ("positions", "layer_masks", "per_document"):
        target.packing = mode
        features, logits = target.forward_packed(input_ids, position_ids, doc_ids, [0, 2], "final")
        assert torch.isfinite(features).all() and torch.isfinite(logits).all()
        outputs[mode] = (features[real], logits[real])
    for mode in ("layer_masks", "per_document"):
        torch.testing.assert_close(outputs[mode][0], outputs["positions"][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outputs[mode][1], outputs["positions"][1], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_run_refuses_a_target_it_cannot_reproduce_and_records_an_allowed_one(gpt_oss_dir, tmp_path):
    from trainer.config import build_config
    from trainer.run.loop import train

    forced = build_config(extra={**RUN, "target": str(gpt_oss_dir), "target_packing": "positions"})
    refused = RunDir(tmp_path / "runs" / "refused")
    with pytest.raises(RunError) as info:
        train(refused, forced, preset=None, device="cpu", progress=False)
    message = str(info.value)
    assert "\n" not in message and "allow_target_fidelity_failure" in message and "tolerance 0.001" in message
    assert not refused.path.exists()  # refused before anything was written

    allowed = RunDir(tmp_path / "runs" / "allowed")
    train(allowed, forced.model_copy(update={"allow_target_fidelity_failure": True}), preset=None, device="cpu",
          progress=False)
    record = json.loads((allowed.path / "run.json").read_text())["target_fidelity"]
    assert record["passed"] is False and record["packing"] == "positions"
    assert record["max_abs_hidden_diff"] > record["tolerance"] == 1e-3

    auto = RunDir(tmp_path / "runs" / "auto")
    train(auto, forced.model_copy(update={"target_packing": "auto"}), preset=None, device="cpu", progress=False)
    record = json.loads((auto.path / "run.json").read_text())["target_fidelity"]
    assert record["passed"] is True and record["packing"] == "layer_masks" and record["tokens"] > SLIDING_WINDOW


def test_without_cuda_and_fla_recurrent_targets_stay_per_document(tmp_path, tokenizer, stream):
    """"varlen" hands document boundaries to flash-linear-attention's kernels; on CPU transformers' PyTorch
    fallbacks refuse them rather than let a recurrent state run across a boundary, auto never tries the way,
    and asking for it is one line."""
    from trainer.target.frozen import TargetError, varlen_available

    assert not varlen_available(CPU)
    target = FrozenTarget.load(str(save_family_target("qwen3_5", tmp_path / "qwen3_5", tokenizer)), CPU)
    with pytest.raises(ValueError, match="can't keep packed sequences apart"):
        target._varlen(*packed_batch(target.pad_token_id))
    record = choose_packing(target, stream, 6)
    assert record.packing == "per_document" and record.passed and "varlen" not in record.tried
    with pytest.raises(TargetError, match="need a CUDA device and the fla package"):
        choose_packing(target, stream, 6, packing="varlen")
