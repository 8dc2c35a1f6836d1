"""The weights being served, their version and checkpoint path, and every way to replace them.

Checkpoints are read and deltas applied off the engine thread, while it keeps serving; the copy
into the model then runs on the engine thread between two steps, so no request sees half a swap.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from transformers import PreTrainedModel

from server.engines.local.torch_threads import off_engine_thread
from server.engines.local.weights import (
    WeightLoadError,
    check_bucket,
    check_compatible,
    copy_weights,
    read_state_dict,
    weight_checksums,
)
from server.weight_delta import WeightDelta

log = logging.getLogger("tandem.engine")

T = TypeVar("T")


class BetweenSteps(Protocol):
    """Runs a function on the engine thread between two steps and returns its result."""

    def __call__(self, fn: Callable[[], T]) -> Awaitable[T]: ...


class ServedWeights:
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        model_path: str,
        version: str,
        between_steps: BetweenSteps,
        on_swap: Callable[[], None],
    ) -> None:
        self._model = model
        self.model_path = model_path
        self.version = version
        self._between_steps = between_steps
        self._on_swap = on_swap
        self._swaps = 0  # swaps so far: a delta prepared before one must not be applied after it

    async def load_checkpoint(self, model_path: str, version: str) -> None:
        tensors = await off_engine_thread(read_state_dict, Path(model_path))
        check_compatible(self._model, tensors)
        await self._between_steps(lambda: self._swap(tensors, model_path, version))
        log.info("weights updated", extra={"model_path": model_path, "weight_version": version})

    async def apply_delta(self, delta: WeightDelta, model_path: str, version: str) -> None:
        """Apply a byte-level delta (``server.weight_delta``); ``model_path`` is the full checkpoint
        the weights then equal.

        Raises:
            OutOfOrderDelta: the delta was built against another version than the one serving.
            DeltaError: a corrupt delta, or one whose tensors do not fit the model (nothing changed).
        """
        delta.check_base(self.version)
        check_compatible(self._model, {name: torch.empty(e.shape, device="meta") for name, e in delta.tensors.items()})
        # The swap refuses if another swap changed the weights while these were computed.
        swaps = self._swaps
        params = self._model.state_dict()
        changed = await off_engine_thread(delta.apply, params.get)
        await self._between_steps(lambda: self._swap(changed, model_path, version, after=swaps))
        log.info(
            "weights updated from a delta",
            extra={"delta_path": str(delta.path), "weight_version": version, "tensors_changed": len(changed)},
        )

    async def load_tensors(self, tensors: dict[str, torch.Tensor], version: str) -> None:
        """Copy a whole set of weights handed over in memory; no checkpoint folder holds them, so the
        model path stays what it was."""
        check_compatible(self._model, tensors)
        await self._between_steps(lambda: self._swap(tensors, self.model_path, version))
        log.info("weights updated from tensors", extra={"weight_version": version, "tensors": len(tensors)})

    async def load_bucket(self, tensors: dict[str, torch.Tensor], version: str) -> None:
        """Copy part of the weights (one bucket of a distributed update); buckets loaded before stay
        loaded, as with SGLang."""
        check_bucket(self._model, tensors)
        await self._between_steps(lambda: self._swap(tensors, self.model_path, version))

    async def checksums(self) -> dict[str, dict[str, Any]]:
        """Per parameter: dtype, shape and the sha256 of its bytes, as served now (between two steps)."""
        return await self._between_steps(lambda: weight_checksums(self._model))

    def _swap(self, tensors: dict[str, torch.Tensor], model_path: str, version: str, after: int | None = None) -> None:
        if after is not None and after != self._swaps:
            raise WeightLoadError("the weights changed while the update was prepared; retry it")
        copy_weights(self._model, tensors)
        if self._model.device.type == "cuda":  # the sender may reuse its memory once we answer
            torch.cuda.synchronize(self._model.device)
        self.version = version
        self.model_path = model_path
        self._swaps += 1
        self._on_swap()
