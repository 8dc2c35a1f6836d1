"""Evaluation before promotion: the eval set, scoring a checkpoint, and the gate between export and swap.

See ``docs/evaluation.md``.
"""

from learner.evaluation.child import EvalFailed, run_eval_child
from learner.evaluation.config import LOGLIK_MARGIN, EvalConfig, EvalGate, EvalMethod
from learner.evaluation.eval_set import EvalSetError, is_held_out, read_eval_prompts, split_held_out
from learner.evaluation.gate import GateDecision, decide
from learner.evaluation.scoring import unscorable
from learner.evaluation.stage import Evaluation, evaluate_candidate, held_out_answers, load_eval_set

__all__ = [
    "LOGLIK_MARGIN",
    "EvalConfig",
    "EvalFailed",
    "EvalGate",
    "EvalMethod",
    "EvalSetError",
    "Evaluation",
    "GateDecision",
    "decide",
    "evaluate_candidate",
    "held_out_answers",
    "is_held_out",
    "load_eval_set",
    "read_eval_prompts",
    "run_eval_child",
    "split_held_out",
    "unscorable",
]
