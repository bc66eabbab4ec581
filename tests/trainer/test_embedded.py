"""The embedded target: cache location, deterministic trained build, atomic and idempotent install."""

from __future__ import annotations

import json
import math
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoConfig, Qwen3ForCausalLM

from trainer.data import embedded_documents
from trainer.target import (
    FrozenTarget,
    TargetError,
    build_embedded_target,
    embedded_target_dir,
    ensure_embedded_target,
)
from trainer.target import embedded

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # Tiny models: a second intra-op thread gains nothing and, on a busy 2-core machine (the test
    # suite in parallel), oversubscription makes every op many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def mean_heldout_loss(model, tokenizer, documents: int = 24) -> float:
    """Reference: each held-out document alone, plain next-token cross entropy, mean over tokens."""
    total, count = 0.0, 0
    with torch.no_grad():
        for text in embedded_documents("heldout")[:documents]:
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
            logits = model(input_ids=ids).logits[0, :-1]
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            total -= log_probs.gather(1, ids[0, 1:, None]).sum().item()
            count += ids.shape[1] - 1
    return total / count


@pytest.fixture(scope="module")
def two_small_builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("builds")
    return [build_embedded_target(root / name, steps=60, progress=False, small=True) for name in ("a", "b")]


def test_cache_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    assert embedded_target_dir() == tmp_path / "targets" / "embedded-v1"
    monkeypatch.delenv("DFLASH_CACHE_DIR")
    assert embedded_target_dir().parts[-3:] == ("dflash-trainer", "targets", "embedded-v1")


def test_small_build_is_deterministic(two_small_builds):
    a, b = two_small_builds
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert not list(a.parent.glob(".*building*"))  # nothing half-built left next to the targets


def test_small_build_loads_like_any_model_and_learned_the_corpus(two_small_builds):
    path = two_small_builds[0]
    target = FrozenTarget.load(str(path), CPU)
    tokenizer = target.tokenizer
    assert type(target.model).__name__ == "Qwen3ForCausalLM" and target.num_layers >= 8
    assert target.mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>") == tokenizer.mask_token_id
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token == "<|pad|>"
    chat = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4."}]
    encoded = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    answer = [i for i, m in zip(encoded["input_ids"], encoded["assistant_masks"]) if m]
    assert tokenizer.decode(answer) == "4.<|im_end|>"

    torch.manual_seed(0)
    untrained = Qwen3ForCausalLM(AutoConfig.from_pretrained(path)).eval()
    before, after = mean_heldout_loss(untrained, tokenizer), mean_heldout_loss(target.model, tokenizer)
    assert before > math.log(len(tokenizer)) - 1.0
    assert after < before - 1.5, (before, after)


def fake_build(calls):
    def build_into(workdir, *, steps, progress, recipe):
        calls.append(workdir)
        (workdir / "config.json").write_text("{}")
        (workdir / embedded.BUILD_MARKER).write_text(json.dumps({"steps": steps}))
    return build_into


def test_ensure_builds_once_then_reuses(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(embedded, "_build_into", fake_build(calls))
    dest = embedded_target_dir()
    assert ensure_embedded_target(progress=False) == dest
    assert ensure_embedded_target(progress=False) == dest
    assert len(calls) == 1 and embedded.is_complete_build(dest)


def test_an_interrupted_build_never_leaves_a_loadable_target(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    dest = embedded_target_dir()

    def killed(workdir, **_):
        (workdir / "config.json").write_text("{}")  # half-written, then the build dies
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "_build_into", killed)
    with pytest.raises(KeyboardInterrupt):
        ensure_embedded_target(progress=False)
    assert not dest.exists() and not list(dest.parent.glob(".*building*"))

    # A half-written directory at the destination (e.g. copied by hand) and a stale temporary one
    # from a killed process are both replaced by a complete build.
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")
    stale = dest.parent / f".{dest.name}.building-dead"
    stale.mkdir()
    calls = []
    monkeypatch.setattr(embedded, "_build_into", fake_build(calls))
    assert ensure_embedded_target(progress=False) == dest
    assert len(calls) == 1 and embedded.is_complete_build(dest) and not stale.exists()


def test_load_embedded_goes_through_the_cache(monkeypatch, tmp_path, two_small_builds):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    dest = embedded_target_dir()
    shutil.copytree(two_small_builds[0], dest)
    monkeypatch.setattr(embedded, "_build_into", lambda *a, **k: pytest.fail("must reuse the complete build"))
    target = FrozenTarget.load("embedded", CPU)
    assert target.path == dest
    assert target.fingerprint == FrozenTarget.load(str(two_small_builds[0]), CPU).fingerprint


def test_an_unwritable_cache_is_a_one_line_target_error(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(blocker))
    with pytest.raises(TargetError, match="DFLASH_CACHE_DIR"):
        ensure_embedded_target(progress=False)


def test_concurrent_ensures_build_once(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    calls = []
    quick = fake_build(calls)

    def slow_build(workdir, **kwargs):
        time.sleep(0.3)  # long enough for the second caller to arrive while the first builds
        quick(workdir, **kwargs)

    monkeypatch.setattr(embedded, "_build_into", slow_build)
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: ensure_embedded_target(progress=False), range(2)))
    assert paths == [embedded_target_dir()] * 2 and len(calls) == 1
