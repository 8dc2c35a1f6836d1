"""Log-probs of the target tokens (with gradient) and the entropy (without) from ``[T, V]`` logits,
a chunk of rows at a time.

The plain form, ``log_softmax(logits.float()).gather(...)``, keeps a float32 ``[T, V]`` tensor for
the backward pass and writes a dense float32 gradient before casting it to the logits' dtype: with a
150k vocabulary that is 5 GB per 8k tokens, several times over, and on an H200 the loss took as long
as a tenth of a 1.5B model's step. Here the forward keeps only each row's log-sum-exp, and the
backward rebuilds ``softmax`` chunk by chunk, writing the gradient once in the logits' dtype:
``d log p(y) / d x_v = [v = y] - p_v``. Values equal the plain form's (same float32 math per row).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from learner.algorithms.losses import entropy_from_log_probs

__all__ = ["target_log_probs"]

CHUNK_ELEMENTS = 1 << 27  # float32 working set per chunk: 512 MB


def _chunks(logits: Tensor) -> list[slice]:
    rows = max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    return [slice(start, start + rows) for start in range(0, logits.shape[0], rows)]


class _TargetLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor]:
        log_z = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        entropy = torch.zeros_like(log_z)
        for rows in _chunks(logits):
            x = logits[rows].float()
            log_z[rows] = torch.logsumexp(x, dim=-1)
            if with_entropy:
                entropy[rows] = entropy_from_log_probs(x - log_z[rows, None])  # not in place: x may be the logits
        log_probs = logits.gather(-1, targets[:, None])[:, 0].float() - log_z
        ctx.save_for_backward(logits, targets, log_z)
        ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx: Any, grad_log_probs: Tensor, _grad_entropy: Tensor) -> tuple[Tensor, None, None]:
        logits, targets, log_z = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for rows in _chunks(logits):
            weight = grad_log_probs[rows, None].float()
            chunk = (logits[rows].float() - log_z[rows, None]).exp_().mul_(-weight)  # -p_v * g
            grad[rows] = chunk.scatter_add_(-1, targets[rows, None], weight)  # + g at the target
        return grad, None, None


def target_log_probs(logits: Tensor, targets: Tensor, *, with_entropy: bool = False) -> tuple[Tensor, Tensor]:
    """``([T] log p(targets[t]), [T] entropy)`` in float32 from ``[T, V]`` logits of any float dtype.

    The log-probs carry the gradient; the entropy never does (zeros unless ``with_entropy``). An
    entropy loss needs ``entropy_from_logits`` instead.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [T, V] and targets [T], got {tuple(logits.shape)} and {tuple(targets.shape)}")
    return _TargetLogProbs.apply(logits, targets, with_entropy)
