"""The in-process engine: a transformers causal LM driven by a continuous-batching loop.

One thread owns the model. Each turn of its loop runs queued commands (weight swap, pause, flush),
admits waiting requests (one prefill each, reusing the session's cached prefix), then decodes one
token for every running request in a single forward. Requests join and leave between steps, and
weights change only between steps, so a swap never fails a request; every chunk says which weight
version produced it.

Why not transformers' own continuous batching (``generate_batch``/``ContinuousBatchingManager``)?
It has no per-request seed, stop strings, top logprobs or weight-version tagging, and its prefix
sharing is not keyed by session, all of which this engine needs; the loop here is ~200 lines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, DynamicCache, PreTrainedModel

from server.engines.base import (
    DEFAULT_PRIORITY,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    Finish,
    ModelInfo,
    PauseMode,
    SamplingParams,
    TokenChunk,
)
from server.engines.local.fair_share import next_to_admit, preemption_victim
from server.engines.local.kv import BatchKV, RowKV
from server.engines.local.prefix_cache import PrefixCache
from server.engines.local.sampler import sample
from server.engines.local.sequence import Sequence, deliver
from server.engines.local.weights import (
    WeightLoadError,
    check_bucket,
    check_compatible,
    copy_weights,
    load_model,
    read_state_dict,
    weight_checksums,
)
from server.weight_delta import WeightDelta

log = logging.getLogger("tandem.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _eos_ids(model: PreTrainedModel, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


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
        prefix_cache_bytes: int = 256 << 20,
        torch_threads: int = 0,
        replica: str = "local-0",
    ) -> None:
        self.replica = replica
        self._model = model
        self._tokenizer = tokenizer
        self._model_path = model_path
        self._served_model_name = served_model_name
        self.weight_version = weight_version
        self._context_length = int(getattr(model.config, "max_position_embeddings", 2048))
        self._eos_ids = _eos_ids(model, tokenizer)
        self._max_batch = max_batch_size
        self._max_queued = max_queued_requests
        self._torch_threads = torch_threads
        self._prefix = PrefixCache(prefix_cache_bytes)

        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._in_flight = 0
        self._paused = False
        self._stopping = False
        self._swaps = 0  # weight swaps so far: a delta prepared before one must not be applied after it
        # Touched by the engine thread only.
        self._running: list[Sequence] = []
        self._batch = BatchKV()
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
        """Load the model off the event loop and start the engine thread."""
        if torch_threads:
            torch.set_num_threads(torch_threads)

        def load() -> tuple[PreTrainedModel, Any]:
            tokenizer = AutoTokenizer.from_pretrained(model_path)
            return load_model(model_path, device=device, dtype=DTYPES[dtype]), tokenizer

        model, tokenizer = await asyncio.to_thread(load)
        kwargs.setdefault("served_model_name", Path(model_path).name)
        return cls(model, tokenizer, model_path=str(model_path), torch_threads=torch_threads, **kwargs)

    # ---- the Engine interface (called on the event loop) ----

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model_path=self._model_path,
            served_model_name=self._served_model_name,
            weight_version=self.weight_version,
            context_length=self._context_length,
            eos_token_ids=tuple(sorted(self._eos_ids)),
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
    ) -> AsyncIterator[TokenChunk]:
        if not input_ids:
            raise EngineError("input_ids must not be empty", 400)
        if len(input_ids) >= self._context_length:
            raise EngineError(
                f"the prompt has {len(input_ids)} tokens but the model's context is {self._context_length}",
                400,
            )
        vocab = self._model.config.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise EngineError(f"token ids must be in [0, {vocab})", 400)
        seq = Sequence.create(
            request_id or uuid.uuid4().hex, input_ids, sampling, session_key, cache_salt, self._tokenizer, priority
        )
        with self._cond:
            if self._stopping:
                raise EngineUnavailable("the engine is shutting down")
            if self._in_flight >= self._max_queued:
                raise EngineOverloaded()
            self._in_flight += 1
            self._enqueue(seq)
            self._cond.notify()
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

    async def health(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._call(lambda: self._pause(mode))

    async def resume(self) -> None:
        def resume() -> None:
            self._paused = False

        await self._call(resume)

    async def update_weights(self, model_path: str, weight_version: str) -> None:
        tensors = await asyncio.to_thread(read_state_dict, Path(model_path))
        check_compatible(self._model, tensors)
        await self._call(lambda: self._swap(tensors, model_path, weight_version))
        log.info("weights updated", extra={"model_path": model_path, "weight_version": weight_version})

    async def update_weights_from_delta(self, delta: WeightDelta, model_path: str, weight_version: str) -> None:
        """Apply a byte-level delta (``server.weight_delta``) to the live weights.

        ``model_path`` is the full checkpoint the weights then equal: what ``model_info`` reports and
        what a rollback or a restarted replica loads.

        Raises:
            OutOfOrderDelta: the delta was built against another version than the one serving.
            DeltaError: a corrupt delta, or one whose tensors do not fit the model (nothing changed).
        """
        delta.check_base(self.weight_version)
        check_compatible(self._model, {name: torch.empty(e.shape, device="meta") for name, e in delta.tensors.items()})
        # The weights are read off the engine thread while it keeps serving; the swap then refuses
        # if another swap changed them in the meantime.
        swaps = self._swaps
        params = self._model.state_dict()
        changed = await asyncio.to_thread(delta.apply, params.get)
        await self._call(lambda: self._swap(changed, model_path, weight_version, after=swaps))
        log.info(
            "weights updated from a delta",
            extra={"delta_path": str(delta.path), "weight_version": weight_version, "tensors_changed": len(changed)},
        )

    async def update_weights_from_tensors(self, tensors: dict[str, torch.Tensor], weight_version: str) -> None:
        """Copy tensors handed over in memory (CUDA IPC or shared CPU memory) into the weights.

        The model path stays what it was: no checkpoint folder holds these weights.
        """
        check_compatible(self._model, tensors)
        await self._call(lambda: self._swap(tensors, self._model_path, weight_version))
        log.info("weights updated from tensors", extra={"weight_version": weight_version, "tensors": len(tensors)})

    async def update_weights_from_bucket(self, tensors: dict[str, torch.Tensor], weight_version: str) -> None:
        """Copy part of the weights (one bucket of a distributed update) in and label them ``weight_version``.

        Each tensor must have its parameter's shape and a dtype the served one holds exactly.
        Buckets loaded before stay loaded, as with SGLang; the model path stays what it was.
        """
        check_bucket(self._model, tensors)
        await self._call(lambda: self._swap(tensors, self._model_path, weight_version))

    @property
    def device(self) -> torch.device:
        return self._model.device

    async def weights_checksums(self) -> dict[str, dict[str, Any]]:
        """Per parameter: dtype, shape and the sha256 of its bytes, as served now (between two steps)."""
        return await self._call(lambda: weight_checksums(self._model))

    async def flush_cache(self) -> bool:
        await self._call(self._prefix.clear)
        return True

    async def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join)

    @property
    def in_flight(self) -> int:
        """Requests accepted and not yet finished (queued or running); the admin API's load."""
        return self._in_flight

    @property
    def running(self) -> int:
        """Requests in the decode batch now (finished ones leave it in the step that ends them)."""
        return len(self._running)

    def _enqueue(self, seq: Sequence) -> None:
        """Queue ``seq`` behind every waiting request of its priority or higher (call under the lock).

        Admission takes the queue from the front, so waiting lower-priority requests (rollouts) are
        admitted after it; running ones are never preempted.
        """
        waiting = self._waiting
        if not waiting or waiting[-1].priority >= seq.priority:  # the common case: all one priority
            waiting.append(seq)
            return
        position = next(i for i, queued in enumerate(waiting) if queued.priority < seq.priority)
        waiting.insert(position, seq)

    # ---- the engine thread ----

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between two steps."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise EngineUnavailable("the engine is not running")
            self._commands.append((fn, future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    def _has_work(self) -> bool:
        return bool(self._commands) or self._stopping or (not self._paused and bool(self._waiting or self._running))

    def _loop(self) -> None:
        if self._torch_threads:
            torch.set_num_threads(self._torch_threads)
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
                    self._abort_all(f"engine error: {exc}")
        self._abort_all("the engine is shutting down")

    def _step(self) -> None:
        with self._cond:
            victim = preemption_victim(self._waiting, self._running, self._max_batch)
            if victim is not None:
                self._retract(victim)
            admitted: list[Sequence] = []
            while self._waiting and len(self._running) + len(admitted) < self._max_batch:
                index = next_to_admit(self._waiting, [*self._running, *admitted])
                admitted.append(self._waiting[index])
                del self._waiting[index]
        for seq in admitted:
            if seq.cancelled:
                self._release()
                continue
            try:
                self._prefill(seq)
            except Exception as exc:  # one bad request must not take the batch down
                log.exception("prefill failed", extra={"request_id": seq.request_id})
                self._abort([seq], f"engine error: {exc}")
        self._drop_finished()
        if not self._running:
            return
        try:
            self._decode()
        except Exception as exc:
            log.exception("decode step failed; aborting the running requests")
            victims, self._running, self._batch = self._running, [], BatchKV()
            self._abort(victims, f"engine error: {exc}")
            return
        self._drop_finished()

    def _prefill(self, seq: Sequence) -> None:
        tokens = seq.tokens
        reuse, kv = 0, None
        # A retracted request (it has output already) re-prefills everything.
        if seq.prefix_key and not seq.output_ids:
            reuse, kv = self._prefix.take(seq.prefix_key, tokens)
            seq.cached_tokens = reuse
        cache = kv.to_cache() if kv is not None else DynamicCache(config=self._model.config)
        positions = torch.arange(reuse, len(tokens))
        out = self._model(
            input_ids=torch.tensor([tokens[reuse:]]),
            attention_mask=torch.ones((1, len(tokens)), dtype=torch.long),
            position_ids=positions[None],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._accept([seq], out.logits[:, -1])
        row = RowKV.from_cache(cache)
        if seq.done:
            self._remember_prefix(seq, row)
            self._release()
        else:
            self._batch.append_row(row)
            self._running.append(seq)

    def _decode(self) -> None:
        positions = self._batch.next_positions()
        mask = self._batch.grow_mask()
        out = self._model(
            input_ids=torch.tensor([[seq.output_ids[-1]] for seq in self._running]),
            attention_mask=mask,
            position_ids=positions,
            cache=self._batch.cache,
            use_cache=True,
        )
        self._accept(self._running, out.logits[:, -1])

    def _accept(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        sampled = sample(logits, [s.sampling for s in seqs], [s.generator for s in seqs])
        outputs = []
        for row, seq in enumerate(seqs):
            if seq.cancelled:
                continue
            finish = seq.accept(sampled.token_ids[row], self._eos_ids, self._context_length)
            seq.finish = finish
            outputs.append(
                (
                    seq,
                    TokenChunk(
                        token_ids=[sampled.token_ids[row]],
                        logprobs=[sampled.logprobs[row]],
                        weight_version=self.weight_version,
                        prompt_tokens=len(seq.input_ids),
                        cached_tokens=seq.cached_tokens,
                        top_logprobs=[sampled.top_logprobs[row]] if seq.sampling.top_logprobs else [],
                        finish=finish,
                    ),
                )
            )
        deliver(outputs)

    def _drop_finished(self) -> None:
        keep = []
        for index, seq in enumerate(self._running):
            if not seq.done:
                keep.append(index)
                continue
            if seq.finish is not None:
                self._remember_prefix(seq, self._batch.row(index))
            self._release()
        if len(keep) < len(self._running):
            self._batch.keep_rows(keep)
            self._running = [self._running[i] for i in keep]

    def _remember_prefix(self, seq: Sequence, row: RowKV) -> None:
        if seq.prefix_key and self._prefix.capacity_bytes and seq.finish and seq.finish.type != "abort":
            self._prefix.put(seq.prefix_key, seq.tokens, row)

    def _release(self) -> None:
        """One request has left the engine for good."""
        with self._cond:
            self._in_flight -= 1

    def _swap(
        self, tensors: dict[str, torch.Tensor], model_path: str, weight_version: str, after: int | None = None
    ) -> None:
        if after is not None and after != self._swaps:
            raise WeightLoadError("the weights changed while the update was prepared; retry it")
        copy_weights(self._model, tensors)
        if self._model.device.type == "cuda":  # the sender may reuse its memory once we answer
            torch.cuda.synchronize(self._model.device)
        self.weight_version = weight_version
        self._model_path = model_path
        self._swaps += 1
        # Cached prefixes hold keys/values of the old weights.
        self._prefix.clear()

    def _retract(self, index: int) -> None:
        """Send one running request back to the front of its priority in the queue (call under the
        lock); its KV is dropped and rebuilt from its prompt and output when it is admitted again."""
        seq = self._running.pop(index)
        self._batch.keep_rows([i for i in range(len(self._running) + 1) if i != index])
        position = next((i for i, queued in enumerate(self._waiting) if queued.priority <= seq.priority), None)
        self._waiting.insert(len(self._waiting) if position is None else position, seq)

    def _pause(self, mode: PauseMode) -> None:
        self._paused = True
        if mode == "abort":
            self._abort_all("generation was paused with mode=abort")
        elif mode == "retract":
            # Back to the front of the queue, KV dropped; re-prefilled under the weights of continue.
            with self._cond:
                self._waiting.extendleft(reversed(self._running))
            self._running, self._batch = [], BatchKV()

    def _abort_all(self, message: str) -> None:
        with self._cond:
            victims = self._running + list(self._waiting)
            self._waiting.clear()
        self._running, self._batch = [], BatchKV()
        self._abort(victims, message)

    def _abort(self, seqs: list[Sequence], message: str) -> None:
        for seq in seqs:
            if not seq.done:
                seq.finish = Finish("abort", message=message)
                seq.emit(
                    TokenChunk([], [], self.weight_version, len(seq.input_ids), seq.cached_tokens, finish=seq.finish)
                )
            self._release()
