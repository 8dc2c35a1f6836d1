"""`tandem engine`: any Engine behind the subset of SGLang's native HTTP API the gateway uses.

Same paths, fields and shapes as SGLang 0.5.23, so one HTTP client drives both this process and a
real SGLang server: /generate, /model_info, /health, /health_generate, /update_weights_from_disk,
/update_weights_from_tensor, /pause_generation, /continue_generation, /flush_cache, and the
distributed sync (/init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group, /begin_weight_update, /end_weight_update).

Two additions SGLang does not have, announced in /model_info's ``weight_sources``:
/update_weights_from_delta (a byte-level delta against the serving version, ``server.weight_delta``)
and GET /weights_checksum (every parameter's sha256, to prove two copies of the weights are equal).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from transformers import AutoTokenizer

from server.engines.base import DEFAULT_PRIORITY, EngineError, SamplingParams, TokenChunk
from server.engines.distributed_receiver import BucketRequest, GroupRequest, UpdateGroups
from server.engines.local.engine import LocalEngine
from server.engines.local.weights import WeightLoadError
from server.engines.sglang_protocol import finish_to_json, flag, sampling_from_json, spans_to_json
from server.engines.tensor_ipc import TensorPayloadError, deserialize_named_tensors
from server.weight_delta import DeltaError, OutOfOrderDelta, WeightDelta

# What /model_info announces this process can load weights from (SGLang itself has disk and tensor).
WEIGHT_SOURCES = ("disk", "delta", "tensor")


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _error(message: str, status: int = 400) -> Response:
    return _json({"error": {"message": message}}, status)


def _updated(version: str) -> str:
    return f"Succeeded to update model weights to {version}."


class _Result:
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
        if self.return_logprob:
            meta["output_token_logprobs"] = self.logprobs
            if self.top_logprobs:
                meta["output_top_logprobs"] = self.top
        if last.finish is not None:
            meta["weight_versions"] = spans_to_json(self.chunks)
            meta["e2e_latency"] = time.perf_counter() - self.started
        text = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        return {"text": text, "output_ids": self.output_ids, "meta_info": meta}


def _parse_generate(body: Any, tokenizer: Any) -> tuple[list[int], SamplingParams, dict[str, Any]]:
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
    return input_ids, sampling_from_json(params, top), body


def create_engine_app(open_engine: Callable[[], Awaitable[LocalEngine]]) -> FastAPI:
    """The app; ``open_engine`` runs at start-up, and the engine is closed at shutdown."""
    engine: LocalEngine
    tokenizer: Any
    groups: UpdateGroups

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nonlocal engine, tokenizer, groups
        engine = await open_engine()
        groups = UpdateGroups(engine.device)
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, engine.model_info().model_path)
        yield
        await engine.close()

    app = FastAPI(title="tandem engine", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            input_ids, sampling, body = _parse_generate(orjson.loads(await request.body()), tokenizer)
        except (ValueError, TypeError, orjson.JSONDecodeError) as exc:
            return _error(str(exc))
        rid = str(body.get("rid") or uuid.uuid4().hex)
        result = _Result(rid, tokenizer, flag(body, "return_logprob"), sampling.top_logprobs)
        # SGLang's routing key (what our gateway sends per session) keys the session prefix cache.
        session_key = body.get("routing_key") or request.headers.get("x-smg-routing-key") or body.get("session_id")
        # Higher goes first, as with SGLang's --enable-priority-scheduling; none means the default.
        priority = body.get("priority")
        chunks = engine.generate(
            input_ids,
            sampling,
            session_key=session_key,
            cache_salt=body.get("cache_salt"),
            request_id=rid,
            priority=DEFAULT_PRIORITY if priority is None else priority,
        )
        try:
            first = await anext(chunks)
        except EngineError as exc:
            return _error(str(exc), exc.status)
        result.add(first)
        if not flag(body, "stream"):
            async for chunk in chunks:
                result.add(chunk)
            return _json(result.to_json())

        async def events() -> AsyncIterator[bytes]:
            yield b"data: " + orjson.dumps(result.to_json()) + b"\n\n"
            async for chunk in chunks:
                result.add(chunk)
                yield b"data: " + orjson.dumps(result.to_json()) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/model_info")
    async def model_info() -> Response:
        info = engine.model_info()
        return _json(
            {
                "model_path": info.model_path,
                "tokenizer_path": info.model_path,
                "served_model_name": info.served_model_name,
                "weight_version": info.weight_version,
                "is_generation": True,
                "context_length": info.context_length,
                "weight_sources": list(WEIGHT_SOURCES),
            }
        )

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        if not await engine.health():
            return Response(status_code=503)
        chunks = engine.generate([0], SamplingParams(max_new_tokens=1, temperature=0))
        try:
            async for _ in chunks:
                pass
        except EngineError:
            return Response(status_code=503)
        return Response(status_code=200)

    async def update(body: dict[str, Any], load: Callable[[], Awaitable[None]], done: str) -> Response:
        """Run one weight update (or group change) the SGLang way: success flag and message, 200 or 400."""
        try:
            if body.get("abort_all_requests"):
                await engine.pause("abort")
                await engine.resume()
            await load()
        except OutOfOrderDelta as exc:
            return _json({"success": False, "message": str(exc)}, 409)
        except (WeightLoadError, DeltaError, TensorPayloadError, OSError, EngineError) as exc:
            return _json({"success": False, "message": str(exc)}, 400)
        return _json({"success": True, "message": done})

    async def update_body(request: Request, *required: str) -> dict[str, Any] | Response:
        try:
            body = orjson.loads(await request.body() or b"{}")
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            return _json({"success": False, "message": "the body must be a JSON object"}, 400)
        missing = [key for key in required if not isinstance(body.get(key), str) or not body[key]]
        if missing:
            return _json({"success": False, "message": f"{', '.join(missing)} required (strings)"}, 400)
        return body

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = await update_body(request, "model_path")
        if isinstance(body, Response):
            return body
        path = body["model_path"]
        version = str(body.get("weight_version") or path)
        return await update(body, lambda: engine.update_weights(path, version), _updated(version))

    @app.post("/update_weights_from_delta")
    async def update_weights_from_delta(request: Request) -> Response:
        """tandem's own: ``delta_path`` against the serving version; ``model_path`` the full checkpoint it
        leads to (reported afterwards). 409 when the delta's base is not the serving version."""
        body = await update_body(request, "delta_path", "model_path", "weight_version")
        if isinstance(body, Response):
            return body
        version = body["weight_version"]

        async def load() -> None:
            delta = await asyncio.to_thread(WeightDelta.open, Path(body["delta_path"]))
            await engine.update_weights_from_delta(delta, body["model_path"], version)

        return await update(body, load, _updated(version))

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> Response:
        """SGLang's fields: one payload per tensor-parallel rank (this process is one rank)."""
        body = await update_body(request)
        if isinstance(body, Response):
            return body
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or len(payloads) != 1 or not isinstance(payloads[0], str):
            message = "serialized_named_tensors must hold one payload (this engine is one tensor-parallel rank)"
            return _json({"success": False, "message": message}, 400)
        version = str(body.get("weight_version") or engine.model_info().weight_version)

        async def load() -> None:
            named = await asyncio.to_thread(deserialize_named_tensors, payloads[0])
            tensors = dict(named)
            if len(tensors) != len(named):
                raise TensorPayloadError("the payload names a tensor twice")
            await engine.update_weights_from_tensors(tensors, version)

        return await update(body, load, _updated(version))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> Response:
        """Join the trainer's group (returns once all ranks joined); see server.engines.distributed_receiver."""
        body = await update_body(request)
        if isinstance(body, Response):
            return body
        return await update(body, lambda: groups.join(GroupRequest.parse(body)), "Joined the group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> Response:
        """One bucket broadcast from rank 0; the prefix cache is always flushed (``flush_cache`` is moot)."""
        body = await update_body(request)
        if isinstance(body, Response):
            return body
        version = str(body.get("weight_version") or engine.model_info().weight_version)

        async def load() -> None:
            tensors = await groups.receive(BucketRequest.parse(body))
            await engine.update_weights_from_bucket(tensors, version)

        return await update(body, load, _updated(version))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> Response:
        body = await update_body(request, "group_name")
        if isinstance(body, Response):
            return body
        return await update({}, lambda: groups.leave(body["group_name"]), "Left the group.")

    @app.post("/begin_weight_update")
    @app.post("/end_weight_update")
    async def weight_update_session() -> Response:
        """SGLang 0.5.23 wants distributed updates between these two; this engine needs no session."""
        return _json({"success": True, "message": "ok"})

    @app.get("/weights_checksum")
    async def weights_checksum() -> Response:
        return _json(
            {"weight_version": engine.model_info().weight_version, "tensors": await engine.weights_checksums()}
        )

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body = orjson.loads(await request.body() or b"{}")
        mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
        if mode not in ("abort", "retract", "in_place"):
            return _error("mode must be one of abort, retract, in_place")
        await engine.pause(mode)
        return _json({"message": "Generation paused successfully."})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        await engine.resume()
        return _json({"message": "Generation continued successfully."})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await engine.flush_cache():
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running.\n", status_code=400)

    return app
