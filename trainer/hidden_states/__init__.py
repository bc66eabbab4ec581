"""Offline target hidden states: run the target once over the training data, then train without its body.

`cache.py` is the on-disk format (sharded safetensors + manifest.json), `generate.py` writes it (resumable,
rank-strided under torchrun), `offline.py` is the stand-in target a run trains from.
"""
