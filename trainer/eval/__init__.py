"""Speculative-decoding evaluation: the draft-verify loop, the plain-decoding baseline, the teacher-forced
acceptance of the training objective on the same sequences, the report."""

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
from trainer.eval import dspark as _dspark  # noqa: F401 - registers DSpark's proposer with proposer_for
from trainer.eval.stops import chat_turn_end_token_id, stop_token_ids
from trainer.eval.teacher_forced import TeacherForcedReport, TrainingSemantics, teacher_forced_acceptance

__all__ = [
    "DFlashProposer",
    "DraftProposer",
    "EvalError",
    "EvalReport",
    "GenerationResult",
    "evaluate",
    "greedy_generate",
    "speculative_generate",
    "chat_turn_end_token_id",
    "stop_token_ids",
    "TeacherForcedReport",
    "TrainingSemantics",
    "teacher_forced_acceptance",
]
