"""Evaluation before promotion: the eval set, scoring a checkpoint, and the gate between export and swap.

See ``docs/evaluation.md``. The names here import neither torch nor the database layer (the training
child reads ``EvalMethod``); ``learner.evaluation.scoring`` (torch, transformers) and
``learner.evaluation.stage`` (the round's stage, storage) are imported from their modules.
"""

from learner.evaluation.child import EvalFailed, run_eval_child
from learner.evaluation.config import LOGLIK_MARGIN, EvalConfig, EvalGate, EvalMethod
from learner.evaluation.eval_set import EvalSetError, is_held_out, read_eval_prompts, split_held_out
from learner.evaluation.gate import GateDecision, decide

__all__ = [
    "LOGLIK_MARGIN",
    "EvalConfig",
    "EvalFailed",
    "EvalGate",
    "EvalMethod",
    "EvalSetError",
    "GateDecision",
    "decide",
    "is_held_out",
    "read_eval_prompts",
    "run_eval_child",
    "split_held_out",
]
