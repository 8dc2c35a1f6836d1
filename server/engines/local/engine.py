"""The in-process engine: a transformers causal LM driven by a continuous-batching loop.

One thread owns the model. Each turn of its loop runs queued commands (weight swap, pause, flush),
admits waiting requests (one prefill each, reusing the session's cached prefix), then decodes one
token for every running request in a single forward. Requests join and leave between steps, and
weights change only between steps, so a swap never fails a request; every chunk says which weight
version produced it.

The parts, one concept each: ``scheduler`` (queue, fair admission, retraction, in-flight count),
``model_runner`` (prefill, decode, sampling), ``served_weights`` (every way to swap weights), the
KV batch (``kv``) and the session prefix cache (``prefix_cache``). ``LocalEngine`` is the facade: it
owns the engine thread and its command queue, and answers the Engine interface.

Why not transformers' own continuous batching (``generate_batch``/``ContinuousBatchingManager``)?
It has no per-request seed, stop strings, top logprobs or weight-version tagging, and its prefix
sharing is not keyed by session, all of which this engine needs; the loop and its parts here are a
few hundred lines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from transformers import AutoTokenizer, PreTrainedModel

from server.engines.base import (
    DEFAULT_PRIORITY,
    AdapterRef,
    EngineError,
    EngineUnavailable,
    ModelInfo,
    PauseMode,
    SamplingParams,
    TokenChunk,
)
from server.engines.local.grammar import GrammarError
from server.engines.local.int8_linear import int8_linears
from server.engines.local.lora import Adapter, AdapterCache
from server.engines.local.model_runner import ModelRunner
from server.engines.local.packed_linear import pack_linears
from server.engines.local.prefix_cache import PrefixCache
from server.engines.local.scheduler import Scheduler
from server.engines.local.sequence import Sequence
from server.engines.local.served_weights import ServedWeights
from server.engines.local.torch_threads import off_engine_thread
from server.engines.local.weights import load_model
from server.weight_delta import WeightDelta

log = logging.getLogger("tandem.engine")

T = TypeVar("T")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LocalEngine:
    """Serve one model in this process; see the module docstring for how the loop works."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        *,
        model_path: str,
        served_model_name: str,
        weight_version: str = "default",
        max_batch_size: int = 16,
        max_queued_requests: int = 256,
        max_prefill_tokens: int = 128,
        prefix_cache_bytes: int = 256 << 20,
        adapter_cache_bytes: int = 256 << 20,
        torch_threads: int = 0,
        packed_linears: bool = True,
        linear_weights: Literal["float", "int8"] = "float",
        replica: str = "local-0",
    ) -> None:
        self.replica = replica
        self._model = model
        on_cpu = model.device.type == "cpu"
        self._int8 = linear_weights == "int8" and on_cpu  # server.engines.local.int8_linear
        # The rows oneDNN packs the linear weights for; 0: they stay plain (off, int8, or not on the CPU).
        self._pack_rows = max_batch_size if packed_linears and on_cpu and not self._int8 else 0
        self._tokenizer = tokenizer
        self._served_model_name = served_model_name
        self._torch_threads = torch_threads
        self._prefix = PrefixCache(prefix_cache_bytes)
        self.adapters = AdapterCache(adapter_cache_bytes)
        self._weights = ServedWeights(
            model,
            model_path=model_path,
            version=weight_version,
            between_steps=self._call,
            on_swap=self._prefix.clear,  # cached prefixes hold keys/values of the old weights
        )
        self._runner = ModelRunner(model, tokenizer, self._prefix, lambda: self._weights.version)

        self._cond = threading.Condition()  # reentrant: the scheduler takes it too
        self._scheduler = Scheduler(
            self._cond, max_batch=max_batch_size, max_queued=max_queued_requests, max_prefill_tokens=max_prefill_tokens
        )
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._paused = False
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"engine-{replica}", daemon=True)
        self._thread.start()

    @classmethod
    async def open(
        cls,
        model_path: Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        torch_threads: int = 0,
        **kwargs: Any,
    ) -> LocalEngine:
        """Load the model off the event loop and start the engine thread (``torch_threads``: its torch
        threads; 0 = torch's default)."""

        def load() -> tuple[PreTrainedModel, Any]:
            tokenizer = AutoTokenizer.from_pretrained(model_path)
            return load_model(model_path, device=device, dtype=DTYPES[dtype]), tokenizer

        model, tokenizer = await off_engine_thread(load)
        kwargs.setdefault("served_model_name", Path(model_path).name)
        return cls(model, tokenizer, model_path=str(model_path), torch_threads=torch_threads, **kwargs)

    # ---- the Engine interface (called on the event loop) ----

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model_path=self._weights.model_path,
            served_model_name=self._served_model_name,
            weight_version=self._weights.version,
            context_length=self._runner.context_length,
            eos_token_ids=tuple(sorted(self._runner.eos_ids)),
        )

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        session_key: str | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
        stream: bool = True,  # a transport hint for HTTP backends; in-process chunks cost nothing
        priority: int = DEFAULT_PRIORITY,
        adapter: AdapterRef | None = None,
        weight_version: str | None = None,  # one set of weights here: whatever serves answers
    ) -> AsyncIterator[TokenChunk]:
        self._runner.check_prompt(input_ids)
        loaded = await self.load_adapter(adapter) if adapter is not None else None
        matcher = None
        if sampling.json_schema is not None:
            try:  # a new schema compiles in about a millisecond; a cached one is copied
                matcher = await asyncio.to_thread(self._runner.grammars.matcher, sampling.json_schema)
            except GrammarError as exc:
                raise EngineError(str(exc), 400) from exc
        seq = Sequence.create(
            request_id or uuid.uuid4().hex,
            input_ids,
            sampling,
            session_key,
            cache_salt,
            self._tokenizer,
            priority,
            adapter=loaded,
            matcher=matcher,
        )
        with self._cond:
            if self._stopping:
                raise EngineUnavailable("the engine is shutting down")
            self._scheduler.submit(seq)
        try:
            while True:
                chunk = await seq.queue.get()
                yield chunk
                if chunk.finish is not None:
                    return
        finally:
            if seq.finish is None:
                seq.cancelled = True
                with self._cond:
                    self._cond.notify()

    async def load_adapter(self, adapter: AdapterRef) -> Adapter:
        """``adapter`` in the cache; a miss reads its folder on a worker thread, while the engine
        thread keeps decoding everyone else."""
        return await off_engine_thread(self.adapters.get, adapter.key, Path(adapter.path), self._model)

    async def health(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._call(lambda: self._pause(mode))

    async def resume(self) -> None:
        def resume() -> None:
            self._paused = False

        await self._call(resume)

    async def update_weights(self, model_path: str, weight_version: str) -> None:
        await self._weights.load_checkpoint(model_path, weight_version)

    async def update_weights_from_delta(self, delta: WeightDelta, model_path: str, weight_version: str) -> None:
        """Apply a byte-level delta to the live weights (``ServedWeights.apply_delta``)."""
        await self._weights.apply_delta(delta, model_path, weight_version)

    async def update_weights_from_tensors(self, tensors: dict[str, torch.Tensor], weight_version: str) -> None:
        """Copy tensors handed over in memory (CUDA IPC or shared CPU memory) into the weights."""
        await self._weights.load_tensors(tensors, weight_version)

    async def update_weights_from_bucket(self, tensors: dict[str, torch.Tensor], weight_version: str) -> None:
        """Copy part of the weights (one bucket of a distributed update) in and label them ``weight_version``.

        Each tensor must have its parameter's shape and a dtype the served one holds exactly.
        """
        await self._weights.load_bucket(tensors, weight_version)

    @property
    def device(self) -> torch.device:
        return self._model.device

    async def weights_checksums(self) -> dict[str, dict[str, Any]]:
        return await self._weights.checksums()

    async def flush_cache(self) -> bool:
        await self._call(self._prefix.clear)
        return True

    async def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join)
        self._runner.close()

    @property
    def in_flight(self) -> int:
        """Requests accepted and not yet finished (queued or running); the admin API's load."""
        return self._scheduler.in_flight

    @property
    def running(self) -> int:
        """Requests in the decode batch now (finished ones leave it in the step that ends them)."""
        return len(self._scheduler.running)

    # ---- the engine thread ----

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between two steps."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise EngineUnavailable("the engine is not running")
            self._commands.append((fn, future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    def _has_work(self) -> bool:
        return bool(self._commands) or self._stopping or (not self._paused and self._scheduler.has_work())

    def _loop(self) -> None:
        if self._torch_threads:
            torch.set_num_threads(self._torch_threads)
        if self._pack_rows:  # here: packing runs torch kernels (server.engines.local.torch_threads)
            pack_linears(self._model, rows_hint=self._pack_rows)
        if self._int8:
            int8_linears(self._model)
        with torch.inference_mode():
            while True:
                with self._cond:
                    self._cond.wait_for(self._has_work)
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                for fn, future in commands:
                    try:
                        future.set_result(fn())
                    except Exception as exc:  # handed to the caller, the loop goes on
                        future.set_exception(exc)
                if self._paused:
                    continue
                try:
                    self._step()
                except Exception as exc:
                    log.exception("engine step failed; aborting the running requests")
                    self._abort(self._scheduler.take_all(), f"engine error: {exc}")
        self._abort(self._scheduler.take_all(), "the engine is shutting down")

    def _step(self) -> None:
        """Prefill what the scheduler admits, then decode one token for the whole batch."""
        scheduler, runner = self._scheduler, self._runner
        for seq in scheduler.schedule():
            try:
                row = runner.prefill(seq)
            except Exception as exc:  # one bad request must not take the batch down
                log.exception("prefill failed", extra={"request_id": seq.request_id})
                self._abort([seq], f"engine error: {exc}")
                continue
            if seq.done:
                runner.remember_prefix(seq, row)
                scheduler.release()
            else:
                scheduler.add_running(seq, row)
        scheduler.drop_finished(runner.remember_prefix)
        if not scheduler.running:
            return
        try:
            runner.decode(scheduler.running, scheduler.batch)
        except Exception as exc:
            log.exception("decode step failed; aborting the running requests")
            self._abort(scheduler.take_running(), f"engine error: {exc}")
            return
        scheduler.drop_finished(runner.remember_prefix)

    def _pause(self, mode: PauseMode) -> None:
        self._paused = True
        if mode == "abort":
            self._abort(self._scheduler.take_all(), "generation was paused with mode=abort")
        elif mode == "retract":
            # Re-prefilled under the weights that serve at resume.
            self._scheduler.retract_all()

    def _abort(self, seqs: list[Sequence], message: str) -> None:
        for seq in seqs:
            seq.abort(message, self._weights.version)
            self._scheduler.release()
