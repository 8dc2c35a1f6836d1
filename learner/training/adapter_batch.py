"""Many adapters trained in one child process and one training pass: ``TrainingRequest``s that differ
only in their samples, advantages, output folder and starting adapter, in; one ``TrainingOutcome``
per request, out.

The child loads the base once, hooks a ``StackedLoRA`` slot per request into it and steps them all
together (``train_stacked_step``: rows carry their adapter), then exports each slot as its request's
adapter folder. Each slot's result is the one its request would give alone (same loss, per-adapter
clipping, elementwise AdamW) up to float rounding and the random initialisation of a fresh adapter.

A failure in the pass (a crash, a timeout, one adapter diverging) fails every request in it: the
caller runs those alone (``run_training_child``), where one scope's failure stays its own.

    python -m learner.training.adapter_batch REQUEST.json   (run by ``run_adapter_batch``)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

from learner.child_process import run_child, write_outcome
from learner.trainers.stacked_lora import StackedLoRA, spec_of_folder
from learner.trainers.stacked_step import SlotBatch, train_stacked_step
from learner.trainers.torch_backend import TrainingDiverged, response_log_probs
from learner.training.child import TrainingOutcome, load_for_training, reference_model
from learner.training_request import AdapterSpec, TrainingRequest

__all__ = ["batch_misfit", "run_adapter_batch"]

# What may differ between the requests of one pass (the adapter's starting folder lives in ``adapter``).
_PER_REQUEST = {"out_dir", "samples", "advantages", "adapter"}


def batch_misfit(requests: Sequence[TrainingRequest]) -> str | None:
    """Why ``requests`` cannot train in one pass (None: they can): each must train an adapter on the
    torch backend without periodic evaluation, and all must agree on everything but their samples,
    advantages, output folder and starting adapter."""
    if not requests:
        return "no requests"
    first = requests[0]
    for request in requests:
        if request.adapter is None or request.config.backend != "torch" or request.eval_every:
            return "only adapters on the torch backend without periodic evaluation train in one pass"
        shared = {f.name for f in dataclasses.fields(request)} - _PER_REQUEST
        if any(getattr(request, name) != getattr(first, name) for name in shared):
            return "the requests differ in more than their samples, advantages, output and starting adapter"
        if _shape(request.adapter) != _shape(first.adapter):  # type: ignore[arg-type]
            return "the requests' adapters differ in rank, alpha, dropout or target modules"
        stored = request.adapter.init_dir
        try:
            if stored is not None and _shape(spec_of_folder(stored)) != _shape(request.adapter):
                return f"{stored} was trained with another rank, alpha, dropout or target modules"
        except (OSError, ValueError, KeyError) as exc:
            return f"{stored}: not a readable adapter ({exc})"
    return None


def _shape(spec: AdapterSpec) -> tuple[object, ...]:
    return (spec.rank, float(spec.alpha), spec.dropout, tuple(sorted(spec.target_modules)))


# parent side


def run_adapter_batch(requests: Sequence[TrainingRequest]) -> list[TrainingOutcome]:
    """Train every request's adapter in one child; one outcome per request, all failed alike if the
    pass failed. Never raises for a failed run.

    Raises:
        ValueError: the requests cannot share a pass (``batch_misfit``).
    """
    misfit = batch_misfit(requests)
    if misfit is not None:
        raise ValueError(misfit)
    payload = json.dumps([json.loads(r.to_json()) for r in requests])
    timeout_s = requests[0].timeout_s * len(requests)  # the pass does the work of all of them
    run = run_child("learner.training.adapter_batch", payload, timeout_s=timeout_s, what="adapter training")
    if run.outcome is None:
        return [TrainingOutcome("failed", error=run.error, failure=run.failure)] * len(requests)
    return [TrainingOutcome.from_dict(outcome) for outcome in run.outcome["outcomes"]]


# child side


def _train(requests: Sequence[TrainingRequest]) -> list[TrainingOutcome]:
    first = requests[0]
    torch.manual_seed(first.seed)
    if first.num_threads is not None:
        torch.set_num_threads(first.num_threads)
    model = load_for_training(first.base_model_dir, first.device)
    ref_model = reference_model(first)
    stack = StackedLoRA(model, first.adapter, len(requests))  # type: ignore[arg-type]  # checked by batch_misfit
    for slot, request in enumerate(requests):
        if request.adapter is not None and request.adapter.init_dir is not None:
            stack.load_slot(slot, request.adapter.init_dir)
    optimizer = torch.optim.AdamW(stack.parameters(), lr=first.learning_rate, weight_decay=first.weight_decay)
    slots = []
    for slot, request in enumerate(requests):
        old_log_probs = None
        if request.num_steps > 1 and not request.config.use_rollout_logprobs:
            with stack.rows(slot):  # PPO's ratio is against each adapter before the first step
                old_log_probs = response_log_probs(model, request.samples, request.config.max_tokens_per_micro_batch)
        advantages = None if request.advantages is None else torch.tensor(request.advantages, dtype=torch.float32)
        slots.append(SlotBatch(request.samples, advantages, old_log_probs))
    metrics: list[list[dict[str, float]]] = [[] for _ in requests]
    for _ in range(first.num_steps):
        for slot, step in enumerate(
            train_stacked_step(model, stack, optimizer, slots, first.config, ref_model=ref_model)
        ):
            metrics[slot].append(step)
    return [
        TrainingOutcome(
            "succeeded",
            checkpoint=stack.export_slot(slot, request.out_dir, request.base_model_dir),
            metrics=tuple(metrics[slot]),
        )
        for slot, request in enumerate(requests)
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: python -m learner.training.adapter_batch REQUEST.json\n")
        return 2
    request_path = Path(argv[1])
    requests = [TrainingRequest.from_json(json.dumps(r)) for r in json.loads(request_path.read_text())]
    try:
        outcomes = _train(requests)
    except TrainingDiverged as exc:
        outcomes = [TrainingOutcome("failed", error=f"TrainingDiverged: {exc}", failure="diverged")] * len(requests)
    except Exception as exc:
        detail = "".join(traceback.format_exception(exc))
        failed = TrainingOutcome("failed", error=f"{type(exc).__name__}: {exc}\n{detail}", failure="error")
        outcomes = [failed] * len(requests)
    write_outcome(request_path, {"outcomes": [o.to_dict() for o in outcomes]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
