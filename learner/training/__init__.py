"""Training a checkpoint in a child process: ``TrainingRequest`` in, ``TrainingOutcome`` out.

Above the backends it dispatches to (``learner.trainers``' torch backend, ``learner.megatron``) and
the in-training evaluation (``learner.evaluation``), so none of those imports it.
"""

from learner.training.child import FailureKind, TrainingOutcome, run_training_child
from learner.training_request import TrainingRequest

__all__ = ["FailureKind", "TrainingOutcome", "TrainingRequest", "run_training_child"]
