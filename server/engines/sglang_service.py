"""What `tandem engine` does behind its HTTP routes: one method per SGLang operation over a LocalEngine.

The routes (server.engines.sglang_routes) parse and answer HTTP; this service holds the engine, its
tokenizer and the trainer's update groups, and knows nothing of requests or responses.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from server.engines.base import DEFAULT_PRIORITY, AdapterRef, EngineError, PauseMode, SamplingParams, TokenChunk
from server.engines.distributed_receiver import BucketRequest, GroupRequest, UpdateGroups
from server.engines.local.engine import LocalEngine
from server.engines.local.torch_threads import off_engine_thread
from server.engines.sglang_protocol import finish_to_json, flag, sampling_from_json, spans_to_json
from server.engines.tensor_ipc import TensorPayloadError, deserialize_named_tensors
from server.weight_delta import WeightDelta
from tandem.moe_routing import routes_to_base64

# What /model_info announces this process can load weights from (SGLang itself has disk and tensor).
WEIGHT_SOURCES = ("disk", "delta", "tensor")


class GenerateResult:
    """Accumulates chunks into SGLang's ``{"text", "output_ids", "meta_info"}``."""

    def __init__(self, rid: str, tokenizer: Any, return_logprob: bool, top_logprobs: int) -> None:
        self.rid, self.tokenizer = rid, tokenizer
        self.return_logprob, self.top_logprobs = return_logprob, top_logprobs
        self.chunks: list[TokenChunk] = []
        self.output_ids: list[int] = []
        self.logprobs: list[list[Any]] = []
        self.top: list[list[list[Any]]] = []
        self.started = time.perf_counter()

    def add(self, chunk: TokenChunk) -> None:
        self.chunks.append(chunk)
        self.output_ids.extend(chunk.token_ids)
        if self.return_logprob:
            self.logprobs.extend([lp, tid, None] for lp, tid in zip(chunk.logprobs, chunk.token_ids, strict=True))
            if self.top_logprobs:
                self.top.extend([[lp, tid, None] for tid, lp in alts] for alts in chunk.top_logprobs)

    def to_json(self) -> dict[str, Any]:
        last = self.chunks[-1]
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": finish_to_json(last.finish, len(self.output_ids)),
            "prompt_tokens": last.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": last.cached_tokens,
            "weight_version": last.weight_version,
        }
        if last.routed_experts is not None:
            meta["routed_experts"] = routes_to_base64(last.routed_experts)
        if self.return_logprob:
            meta["output_token_logprobs"] = self.logprobs
            if self.top_logprobs:
                meta["output_top_logprobs"] = self.top
        if last.finish is not None:
            meta["weight_versions"] = spans_to_json(self.chunks)
            meta["e2e_latency"] = time.perf_counter() - self.started
        text = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        return {"text": text, "output_ids": self.output_ids, "meta_info": meta}


def parse_generate(body: Any, tokenizer: Any) -> tuple[list[int], SamplingParams]:
    """A /generate body's prompt and sampling; ValueError or TypeError for what this engine refuses."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    input_ids = body.get("input_ids")
    if input_ids is None and isinstance(body.get("text"), str):
        input_ids = tokenizer.encode(body["text"], add_special_tokens=False)
    if not isinstance(input_ids, list) or not all(isinstance(t, int) for t in input_ids):
        raise ValueError("input_ids must be one list of token ids (batches are not supported)")
    if body.get("logprob_start_len", -1) not in (-1, None):
        raise ValueError("input (prompt) logprobs are not supported; use logprob_start_len=-1")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise ValueError("sampling_params must be an object")
    if int(params.get("n", 1)) != 1:
        raise ValueError("sampling_params.n must be 1; send one request per sample")
    for name in ("stream", "return_logprob"):
        flag(body, name)  # a 400 for "false" and the like, before it would read as true
    top = int(body.get("top_logprobs_num") or 0) if body.get("return_logprob") else 0
    priority = body.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ValueError("priority must be an integer")
    sampling = sampling_from_json(params, top)
    return input_ids, replace(sampling, return_routed_experts=flag(body, "return_routed_experts"))


class NamedAdapters:
    """SGLang's loaded LoRA adapters by name (``/load_lora_adapter``), over the engine's adapter cache."""

    def __init__(self, engine: LocalEngine) -> None:
        self._engine = engine
        self._by_name: dict[str, AdapterRef] = {}

    async def load(self, name: str, path: str) -> None:
        """Read the folder now (a bad one is refused here, not at the first request) and name it."""
        adapter = AdapterRef(key=name, path=path)
        await self._engine.load_adapter(adapter)
        self._by_name[name] = adapter

    def unload(self, name: str) -> None:
        """Forget ``name``; requests already decoding with it finish with it.

        Raises:
            KeyError: no adapter of that name is loaded.
        """
        del self._by_name[name]
        self._engine.adapters.drop(name)

    def ref(self, name: str) -> AdapterRef:
        """Raises ValueError (a bad request) for a name that is not loaded."""
        if name not in self._by_name:
            raise ValueError(f"lora_path {name!r} is not a loaded adapter (POST /load_lora_adapter first)")
        return self._by_name[name]

    def paths(self) -> dict[str, str]:
        """SGLang's ``loaded_adapters``: name -> folder."""
        return {name: ref.path for name, ref in self._by_name.items()}


class EngineService:
    """The engine, its tokenizer and the trainer's weight update groups."""

    def __init__(self, engine: LocalEngine, tokenizer: Any) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.groups = UpdateGroups(engine.device)
        self.adapters = NamedAdapters(engine)

    @classmethod
    async def open(cls, open_engine: Callable[[], Awaitable[LocalEngine]]) -> EngineService:
        engine = await open_engine()
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, engine.model_info().model_path)
        return cls(engine, tokenizer)

    async def close(self) -> None:
        await self.engine.close()

    def model_info(self) -> dict[str, Any]:
        info = self.engine.model_info()
        return {
            "model_path": info.model_path,
            "tokenizer_path": info.model_path,
            "served_model_name": info.served_model_name,
            "weight_version": info.weight_version,
            "is_generation": True,
            "context_length": info.context_length,
            "weight_sources": list(WEIGHT_SOURCES),
        }

    def generate(self, body: Any, routing_header: str | None) -> tuple[GenerateResult, AsyncIterator[TokenChunk]]:
        """Start one /generate request: the result to fill, and the engine's chunks.

        Raises:
            ValueError, TypeError: the body asks for what this engine does not do.
        """
        input_ids, sampling = parse_generate(body, self.tokenizer)
        rid = str(body.get("rid") or uuid.uuid4().hex)
        result = GenerateResult(rid, self.tokenizer, flag(body, "return_logprob"), sampling.top_logprobs)
        # SGLang's routing key (what our gateway sends per session) keys the session prefix cache.
        session_key = body.get("routing_key") or routing_header or body.get("session_id")
        # Higher goes first, as with SGLang's --enable-priority-scheduling; none means the default.
        priority = body.get("priority")
        lora = body.get("lora_path")
        chunks = self.engine.generate(
            input_ids,
            sampling,
            session_key=session_key,
            cache_salt=body.get("cache_salt"),
            request_id=rid,
            priority=DEFAULT_PRIORITY if priority is None else priority,
            adapter=self.adapters.ref(lora) if lora is not None else None,
        )
        return result, chunks

    async def healthy(self) -> bool:
        """Alive and able to generate one token (SGLang's /health_generate)."""
        if not await self.engine.health():
            return False
        try:
            async for _ in self.engine.generate([0], SamplingParams(max_new_tokens=1, temperature=0)):
                pass
        except EngineError:
            return False
        return True

    async def load_from_disk(self, model_path: str, weight_version: str) -> None:
        await self.engine.update_weights(model_path, weight_version)

    async def load_from_delta(self, delta_path: str, model_path: str, weight_version: str) -> None:
        delta = await asyncio.to_thread(WeightDelta.open, Path(delta_path))
        await self.engine.update_weights_from_delta(delta, model_path, weight_version)

    async def load_from_tensor(self, payload: str, weight_version: str) -> None:
        named = await off_engine_thread(deserialize_named_tensors, payload)
        tensors = dict(named)
        if len(tensors) != len(named):
            raise TensorPayloadError("the payload names a tensor twice")
        await self.engine.update_weights_from_tensors(tensors, weight_version)

    async def join_group(self, body: dict[str, Any]) -> None:
        """Join the trainer's group (returns once all ranks joined); see server.engines.distributed_receiver."""
        await self.groups.join(GroupRequest.parse(body))

    async def load_from_distributed(self, body: dict[str, Any], weight_version: str) -> None:
        """One bucket broadcast from rank 0; the prefix cache is always flushed (``flush_cache`` is moot)."""
        tensors = await self.groups.receive(BucketRequest.parse(body))
        await self.engine.update_weights_from_bucket(tensors, weight_version)

    async def leave_group(self, group_name: str) -> None:
        await self.groups.leave(group_name)

    async def checksums(self) -> dict[str, Any]:
        version = self.engine.model_info().weight_version
        return {"weight_version": version, "tensors": await self.engine.weights_checksums()}

    async def pause(self, mode: PauseMode) -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def flush_cache(self) -> bool:
        return await self.engine.flush_cache()
