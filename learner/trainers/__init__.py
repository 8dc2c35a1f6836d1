"""The torch trainer backend and what every backend shares: the training config, the loss of a
step, checkpoint export. ``learner.training`` runs a backend in a child process."""

from learner.trainers.checkpoint import (
    CheckpointError,
    ExportResult,
    checkpoint_dtype,
    export_checkpoint,
    weights_sha256,
)
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
    "TrainConfig",
    "TrainingDiverged",
    "checkpoint_dtype",
    "compute_advantages",
    "compute_log_probs",
    "compute_log_probs_and_entropy",
    "export_checkpoint",
    "response_log_probs",
    "train_step",
    "weights_sha256",
]
