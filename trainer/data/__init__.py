"""Training data: the embedded corpus and user files, tokenised, packed and batched deterministically."""

from trainer.data.corpus import embedded_documents
from trainer.data.datasets import (
    DataError,
    Document,
    PackedData,
    batch_for_step,
    chat_rendering,
    heldout_prompts,
    load_documents,
    pack_documents,
)

__all__ = [
    "DataError",
    "Document",
    "PackedData",
    "batch_for_step",
    "chat_rendering",
    "embedded_documents",
    "heldout_prompts",
    "load_documents",
    "pack_documents",
]
