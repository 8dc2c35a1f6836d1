"""A CUSTOM_LOSS plugin's call, with slime's contract: ``f(args, batch, logits, sum_of_sample_mean)``.

slime hands a custom loss its micro-batch as per-sample lists over the response tokens
(``slime/backends/megatron_utils/loss.py``), ``[1, T, V]`` logits of the packed row, and a
``sum_of_sample_mean`` over the responses' tokens laid end to end; a slime loss computes its
log-probs with ``get_log_probs_and_entropy`` (tandem serves it at ``slime.backends.megatron_utils.loss``).
``slime_loss_batch`` builds that batch from tandem's packed micro-batch, so such a loss runs
unchanged. The per-sample lists, one tensor each, in micro-batch order:

- ``unconcat_tokens`` (prompt + response ids), ``total_lengths``, ``response_lengths``;
- ``loss_masks``, ``advantages``, ``log_probs`` (the old policy's, detached), ``ref_log_probs``,
  ``rollout_log_probs`` (behaviour), ``teacher_log_probs`` (None where a sample has none);
- ``rollout_mask_sums``: each sample's loss denominator (its rollout's trained tokens);
- ``supervised``: 1 on the tokens of samples trained by likelihood (corrected answers), which a
  custom loss must handle itself.

And, packed: ``tokens`` ``[1, T]`` and ``full_loss_masks`` ``[1, T]``. ``values`` and ``returns`` are
None (no critic), as is ``multimodal_train_inputs``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from learner.batching import PackedMicroBatch
from learner.plugins import Plugin
from learner.sample import Sample

__all__ = ["call_custom_loss", "response_spans", "slime_loss_batch"]


def response_spans(samples: Sequence[Sample], batch: PackedMicroBatch) -> list[tuple[int, int]]:
    """Each sample's response tokens in the packed row, ``(start, end)``, in micro-batch order."""
    cu = batch.cu_seqlens.tolist()
    return [(cu[k] + samples[i].prompt_length, cu[k + 1]) for k, i in enumerate(batch.sample_indices)]


def slime_loss_batch(
    samples: Sequence[Sample],
    batch: PackedMicroBatch,
    packed: dict[str, Tensor | None],
    rollout_mask_sums: Tensor,
) -> dict[str, Any]:
    """slime's custom-loss batch for ``batch`` (packed from ``samples``).

    Args:
        packed: tandem's per-token ``[T]`` tensors of the row: ``input_ids``, ``loss_mask``,
            ``advantages``, ``old_log_probs`` and ``supervised``; ``ref_log_probs`` and
            ``rollout_log_probs`` or None.
        rollout_mask_sums: ``[N]`` every sample's loss denominator, by position in ``samples``.
    """
    spans = response_spans(samples, batch)
    chosen = [samples[i] for i in batch.sample_indices]
    device = packed["loss_mask"].device if packed["loss_mask"] is not None else None

    def per_sample(name: str, *, detach: bool = False) -> list[Tensor] | None:
        values = packed[name]
        if values is None:
            return None
        values = values.detach() if detach else values
        return [values[start:end] for start, end in spans]

    teacher = [s.teacher_log_probs for s in chosen]
    input_ids = packed["input_ids"]
    loss_mask = packed["loss_mask"]
    assert input_ids is not None and loss_mask is not None
    return {
        "tokens": input_ids.unsqueeze(0),
        "unconcat_tokens": [torch.tensor(s.tokens, device=device) for s in chosen],
        "total_lengths": [s.total_length for s in chosen],
        "response_lengths": [s.response_length for s in chosen],
        "loss_masks": per_sample("loss_mask"),
        "full_loss_masks": loss_mask.unsqueeze(0),
        "advantages": per_sample("advantages"),
        "log_probs": per_sample("old_log_probs", detach=True),
        "ref_log_probs": per_sample("ref_log_probs"),
        "rollout_log_probs": per_sample("rollout_log_probs"),
        "teacher_log_probs": None
        if all(t is None for t in teacher)
        else [
            torch.tensor(t if t is not None else [0.0] * s.response_length, device=device)
            for s, t in zip(chosen, teacher, strict=True)
        ],
        "rollout_mask_sums": rollout_mask_sums[list(batch.sample_indices)].to(device),
        "supervised": per_sample("supervised"),
        "values": None,
        "returns": None,
        "multimodal_train_inputs": None,
    }


def call_custom_loss(
    plugin: Plugin,
    args: object,
    batch: dict[str, Any],
    logits: Tensor,
    sum_of_sample_mean: Callable[[Tensor], Tensor],
) -> tuple[Tensor, dict[str, float]]:
    """The plugin's ``(loss, metrics)`` for one micro-batch, checked: ``logits`` ``[1, T, V]``, and
    ``sum_of_sample_mean`` takes values over the batch's response tokens, concatenated.

    Raises:
        PluginError: the result is not a scalar tensor and a dict of numbers (or scalar tensors).
    """
    result = plugin.call(args, batch, logits, sum_of_sample_mean)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise plugin.error(f"returned {type(result).__name__}, not (loss, metrics)")
    loss, metrics = result
    if not isinstance(loss, Tensor) or loss.dim() != 0 or not isinstance(metrics, dict):
        raise plugin.error("returned a loss that is not a scalar tensor, or metrics that are not a dict")
    return loss, {name: float(value) for name, value in metrics.items()}
