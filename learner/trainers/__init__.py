"""Trainer backends: the torch backend, checkpoint export, and training in a child process.

The Megatron backend (its own issue) reuses ``learner.algorithms`` and the same child-process
contract (``TrainingRequest`` in, ``TrainingOutcome`` out).
"""

from learner.trainers.checkpoint import (
    CheckpointError,
    ExportResult,
    checkpoint_dtype,
    export_checkpoint,
    weights_sha256,
)
from learner.trainers.child import FailureKind, TrainingOutcome, run_training_child
from learner.trainers.request import TrainingRequest
from learner.trainers.torch_backend import (
    TrainConfig,
    TrainingDiverged,
    compute_advantages,
    compute_log_probs,
    compute_log_probs_and_entropy,
    response_log_probs,
    train_step,
)

__all__ = [
    "CheckpointError",
    "ExportResult",
    "FailureKind",
    "TrainConfig",
    "TrainingDiverged",
    "TrainingOutcome",
    "TrainingRequest",
    "checkpoint_dtype",
    "compute_advantages",
    "compute_log_probs",
    "compute_log_probs_and_entropy",
    "export_checkpoint",
    "response_log_probs",
    "run_training_child",
    "train_step",
    "weights_sha256",
]
