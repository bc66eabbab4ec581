"""Speculative-decoding evaluation: the draft-verify loop, the plain-decoding baseline, the report."""

from trainer.eval.speculative import (
    DFlashProposer,
    DraftProposer,
    EvalError,
    EvalReport,
    GenerationResult,
    evaluate,
    greedy_generate,
    speculative_generate,
)

__all__ = [
    "DFlashProposer",
    "DraftProposer",
    "EvalError",
    "EvalReport",
    "GenerationResult",
    "evaluate",
    "greedy_generate",
    "speculative_generate",
]
