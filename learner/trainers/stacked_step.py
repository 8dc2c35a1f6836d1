"""One optimizer step for many adapters at once: rows carry their adapter (``StackedLoRA``).

Every adapter's samples are packed together into the same micro-batches (one base forward for rows of
all adapters), and each adapter's loss is the one ``train_step`` would compute for its samples alone:
``micro_batch_loss`` over its own part of the packed row (a contiguous slice: samples are laid out
adapter by adapter and packing keeps the input order within a micro-batch), reduced with its own
step's sample and token counts. Gradients are clipped per adapter and every refusal names the
adapter, so the result for each adapter is its ``train_step`` result, in one pass.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from learner.batching import PackedMicroBatch, collate_micro_batch, pack_samples
from learner.sample import Sample
from learner.trainers.stacked_lora import StackedLoRA
from learner.trainers.step_loss import StepTotals, all_finite, micro_batch_loss, prepare_step, step_metrics
from learner.trainers.torch_backend import compute_log_probs, forward_logits, refuse_if_not_finite
from learner.trainers.train_config import TrainConfig, TrainingDiverged

__all__ = ["SlotBatch", "train_stacked_step"]


@dataclass(frozen=True, slots=True)
class SlotBatch:
    """One adapter's share of a step: its samples, their advantages and PPO's old log-probs (or None)."""

    samples: Sequence[Sample]
    advantages: Tensor | None = None
    old_log_probs: Sequence[Tensor] | None = None


def train_stacked_step(
    model: nn.Module,
    stack: StackedLoRA,
    optimizer: torch.optim.Optimizer,
    slots: Sequence[SlotBatch],
    config: TrainConfig,
    *,
    ref_model: nn.Module | None = None,
) -> list[dict[str, float]]:
    """``train_step`` for each slot's adapter (slot ``i`` of ``stack`` trains on ``slots[i]``), in one
    pass; the metrics per slot, as ``train_step`` reports them.

    Raises:
        TrainingDiverged: a slot's loss, gradient norm or weights are not finite (nothing is stepped,
            or, for the weights, the step is done): the message names the slot.
        ValueError: as ``train_step``, or per-token advantages (``config.token_level``).
    """
    if len(slots) != stack.slots:
        raise ValueError(f"{len(slots)} slot batches for a stack of {stack.slots} adapters")
    if config.token_level:
        raise ValueError("stacked adapter steps take per-sample advantages; train per-token ones one adapter at a time")
    inputs = [
        prepare_step(
            s.samples,
            config,
            has_ref_model=ref_model is not None,
            old_log_probs=s.old_log_probs,
            advantages=s.advantages,
        )
        for s in slots
    ]
    samples = [sample for s in slots for sample in s.samples]
    slot_of = [slot for slot, s in enumerate(slots) for _ in s.samples]
    first = [0]
    for s in slots:
        first.append(first[-1] + len(s.samples))
    started = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    totals = [StepTotals() for _ in slots]
    for micro_batch in pack_samples(samples, config.max_tokens_per_micro_batch):
        batch = collate_micro_batch(samples, micro_batch)
        ref_log_probs = None
        if ref_model is not None and config.loss.kl_loss_coef != 0:
            with torch.no_grad():
                ref_log_probs = compute_log_probs(ref_model, batch)
        with stack.rows(torch.tensor([slot_of[i] for i in micro_batch.sample_indices])):
            logits = forward_logits(model, batch)
        losses = []
        for slot, part, (start, end) in _slot_parts(batch, slot_of, first):
            loss, parts = micro_batch_loss(
                config,
                inputs[slot],
                slots[slot].samples,
                part,
                logits[start:end],
                ref_log_probs=None if ref_log_probs is None else ref_log_probs[start:end],
            )
            totals[slot].add(loss, parts)
            losses.append(loss)
        torch.stack(losses).sum().backward()
    read = [t.read() for t in totals]
    for slot, (loss_sum, _) in enumerate(read):
        refuse_if_not_finite(f"adapter {slot}'s loss", loss_sum, optimizer)
    max_norm = config.clip_grad if config.clip_grad is not None else math.inf
    norms = stack.clip_per_slot(max_norm).tolist()
    for slot, norm in enumerate(norms):
        refuse_if_not_finite(f"adapter {slot}'s grad_norm", norm, optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        if not all_finite(stack.parameters()):
            raise TrainingDiverged("an adapter weight became non-finite in the optimizer step")
    elapsed = time.perf_counter() - started
    return [
        step_metrics(s.samples, parts, norm, elapsed) for s, (_, parts), norm in zip(slots, read, norms, strict=True)
    ]


def _slot_parts(
    batch: PackedMicroBatch, slot_of: Sequence[int], first: Sequence[int]
) -> list[tuple[int, PackedMicroBatch, tuple[int, int]]]:
    """Each slot's part of ``batch``: ``(slot, its samples as a micro-batch of their own (indices into
    the slot's samples), its [start, end) in the packed row)``."""
    cu = batch.cu_seqlens.tolist()
    runs: list[tuple[int, int, int]] = []  # (slot, first position, end position) in sample_indices
    for position, index in enumerate(batch.sample_indices):
        if runs and runs[-1][0] == slot_of[index]:
            runs[-1] = (runs[-1][0], runs[-1][1], position + 1)
        else:
            runs.append((slot_of[index], position, position + 1))
    if len({slot for slot, _, _ in runs}) != len(runs):
        raise AssertionError("a slot's samples are not contiguous in the micro-batch: packing reordered them")
    parts = []
    for slot, k0, k1 in runs:
        start, end = cu[k0], cu[k1]
        part = PackedMicroBatch(
            input_ids=batch.input_ids[start:end],
            position_ids=batch.position_ids[start:end],
            loss_mask=batch.loss_mask[start:end],
            cu_seqlens=batch.cu_seqlens[k0 : k1 + 1] - start,
            sample_indices=tuple(i - first[slot] for i in batch.sample_indices[k0:k1]),
            temperature=None if batch.temperature is None else batch.temperature[start:end],
            supervised=None if batch.supervised is None else batch.supervised[start:end],
        )
        parts.append((slot, part, (start, end)))
    return parts
