"""The saved layer config's sliding layers against their window (speculators' saved-config path check)."""

from __future__ import annotations

from sleuth.probes.adapters.speculators import _window_problems


def _config(**layer):
    return {"transformer_layer_config": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                         **layer}}


def test_sliding_layers_with_their_window_are_fine():
    assert _window_problems(_config(sliding_window=2048, use_sliding_window=True)) == []
    assert _window_problems({"transformer_layer_config": {"layer_types": ["full_attention"] * 2}}) == []


def test_sliding_layers_without_a_window_are_named():
    (dropped,) = _window_problems(_config(sliding_window=None, use_sliding_window=False))
    assert "2 of 3 layers sliding_attention with sliding_window None" in dropped
    assert _window_problems(_config(sliding_window=2048, use_sliding_window=False))
    assert _window_problems(_config(sliding_window=0, use_sliding_window=True))
