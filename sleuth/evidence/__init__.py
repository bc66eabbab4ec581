"""Extractors: read observed (and reference) values from a run's config, checkpoint header and source.

Nothing here imports torch or the analysed code: configs are dicts, checkpoints are read through their
safetensors header only, and source is parsed with `ast`, never imported or executed.
"""
