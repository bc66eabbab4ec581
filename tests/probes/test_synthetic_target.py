"""The probe's synthetic target on disk (sleuth/probes/adapters/synthetic.py): the Qwen3.5 / 3.6 text layout a
trainer's own loaders read, and the scratch directories the adapters write it to."""

from __future__ import annotations

import gc

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from sleuth.probes.adapters.synthetic import owned_scratch, write_target_dir
from sleuth.probes.target import make_target, rms_norm


def test_a_qwen3_5_target_stores_its_norm_in_the_one_plus_w_convention(tmp_path):
    target = make_target(8, 0)
    where = write_target_dir(target, tmp_path / "q35", family="qwen3_5")
    config = AutoConfig.from_pretrained(where)
    assert config.model_type == "qwen3_5_text" and config.num_hidden_layers == 8
    assert config.head_dim == target.head_dim != target.hidden_size // target.num_heads
    tensors = load_file(str(where / "model.safetensors"))
    stored = tensors["model.norm.weight"]
    x = torch.randn(3, target.hidden_size)
    # x * (1 + stored) is the target's own norm: a reader of the convention gets the same teacher
    reread = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + target.rms_norm_eps) * (1 + stored)
    assert torch.allclose(reread, rms_norm(x, target.norm_weight), atol=1e-5)
    assert not torch.allclose(stored, target.norm_weight)
    assert torch.equal(tensors["lm_head.weight"], target.lm_head_weight)
    # a depth-only config for a layer-id rule
    assert AutoConfig.from_pretrained(write_target_dir(target, tmp_path / "d", num_layers=36,
                                                       family="qwen3_5")).num_hidden_layers == 36


def test_an_adapters_scratch_goes_with_its_owner():
    class Owner:
        pass

    owner = Owner()
    path = owned_scratch(owner, "sleuth-test-")
    (path / "file").write_text("x")
    assert path.is_dir()
    del owner
    gc.collect()
    assert not path.exists()
