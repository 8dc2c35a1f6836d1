"""The HTTP side of `tandem engine`: SGLang's native paths, thin handlers over an EngineService.

Handlers parse the body, call one service method and shape the answer as SGLang does (weight
updates: ``{"success", "message"}`` with 200, 400 or 409).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Annotated, Any, cast, get_args

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from server.engines.base import EngineError, PauseMode
from server.engines.local.weights import WeightLoadError
from server.engines.sglang_protocol import flag
from server.engines.sglang_service import EngineService, GenerateResult
from server.engines.tensor_ipc import TensorPayloadError
from server.weight_delta import DeltaError, OutOfOrderDelta

router = APIRouter()


async def _service(request: Request) -> EngineService:
    service: EngineService = request.app.state.engine_service  # set by the app's lifespan
    return service


ServiceDep = Annotated[EngineService, Depends(_service)]


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _error(message: str, status: int = 400) -> Response:
    return _json({"error": {"message": message}}, status)


def _updated(version: str) -> str:
    return f"Succeeded to update model weights to {version}."


def _event(result: GenerateResult) -> bytes:
    return b"data: " + orjson.dumps(result.to_json()) + b"\n\n"


@router.post("/generate")
async def generate(request: Request, service: ServiceDep) -> Response:
    try:
        body = orjson.loads(await request.body())
        result, chunks = service.generate(body, request.headers.get("x-smg-routing-key"))
    except (ValueError, TypeError, orjson.JSONDecodeError) as exc:
        return _error(str(exc))
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
        yield _event(result)
        async for chunk in chunks:
            result.add(chunk)
            yield _event(result)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@router.get("/model_info")
async def model_info(service: ServiceDep) -> Response:
    return _json(service.model_info())


@router.get("/health")
@router.get("/health_generate")
async def health(service: ServiceDep) -> Response:
    return Response(status_code=200 if await service.healthy() else 503)


async def _update(
    service: EngineService, body: dict[str, Any], load: Callable[[], Awaitable[None]], done: str
) -> Response:
    """Run one weight update (or group change) the SGLang way: success flag and message, 200 or 400."""
    try:
        if body.get("abort_all_requests"):
            await service.pause("abort")
            await service.resume()
        await load()
    except OutOfOrderDelta as exc:
        return _json({"success": False, "message": str(exc)}, 409)
    except (WeightLoadError, DeltaError, TensorPayloadError, OSError, EngineError) as exc:
        return _json({"success": False, "message": str(exc)}, 400)
    return _json({"success": True, "message": done})


async def _update_body(request: Request, *required: str) -> dict[str, Any] | Response:
    """The body as an object with ``required`` non-empty strings, or the 400 to answer instead."""
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


def _named_version(service: EngineService, body: dict[str, Any]) -> str:
    """The version an update names, or (none named) the serving one, as SGLang keeps it."""
    return str(body.get("weight_version") or service.model_info()["weight_version"])


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, service: ServiceDep) -> Response:
    body = await _update_body(request, "model_path")
    if isinstance(body, Response):
        return body
    path = body["model_path"]
    version = str(body.get("weight_version") or path)
    return await _update(service, body, partial(service.load_from_disk, path, version), _updated(version))


@router.post("/update_weights_from_delta")
async def update_weights_from_delta(request: Request, service: ServiceDep) -> Response:
    """tandem's own: ``delta_path`` against the serving version; ``model_path`` the full checkpoint it
    leads to (reported afterwards). 409 when the delta's base is not the serving version."""
    body = await _update_body(request, "delta_path", "model_path", "weight_version")
    if isinstance(body, Response):
        return body
    version = body["weight_version"]
    delta_path, model_path = body["delta_path"], body["model_path"]
    load = partial(service.load_from_delta, delta_path, model_path, version)
    return await _update(service, body, load, _updated(version))


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request, service: ServiceDep) -> Response:
    """SGLang's fields: one payload per tensor-parallel rank (this process is one rank)."""
    body = await _update_body(request)
    if isinstance(body, Response):
        return body
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or len(payloads) != 1 or not isinstance(payloads[0], str):
        message = "serialized_named_tensors must hold one payload (this engine is one tensor-parallel rank)"
        return _json({"success": False, "message": message}, 400)
    version = _named_version(service, body)
    return await _update(service, body, partial(service.load_from_tensor, payloads[0], version), _updated(version))


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request, service: ServiceDep) -> Response:
    body = await _update_body(request)
    if isinstance(body, Response):
        return body
    return await _update(service, body, partial(service.join_group, body), "Joined the group.")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request, service: ServiceDep) -> Response:
    body = await _update_body(request)
    if isinstance(body, Response):
        return body
    version = _named_version(service, body)
    return await _update(service, body, partial(service.load_from_distributed, body, version), _updated(version))


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request, service: ServiceDep) -> Response:
    body = await _update_body(request, "group_name")
    if isinstance(body, Response):
        return body
    return await _update(service, {}, partial(service.leave_group, body["group_name"]), "Left the group.")


@router.post("/begin_weight_update")
@router.post("/end_weight_update")
async def weight_update_session() -> Response:
    """SGLang 0.5.23 wants distributed updates between these two; this engine needs no session."""
    return _json({"success": True, "message": "ok"})


@router.get("/weights_checksum")
async def weights_checksum(service: ServiceDep) -> Response:
    return _json(await service.checksums())


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, service: ServiceDep) -> Response:
    body = orjson.loads(await request.body() or b"{}")
    name, path = (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
    if not isinstance(name, str) or not isinstance(path, str):
        return _error("load_lora_adapter needs lora_name and lora_path")
    try:
        await service.adapters.load(name, path)
    except EngineError as exc:
        return _json({"success": False, "error_message": str(exc)}, exc.status)
    return _json({"success": True, "error_message": "", "loaded_adapters": service.adapters.paths()})


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request, service: ServiceDep) -> Response:
    body = orjson.loads(await request.body() or b"{}")
    name = body.get("lora_name") if isinstance(body, dict) else None
    try:
        service.adapters.unload(str(name))
    except KeyError:
        return _json({"success": False, "error_message": f"no adapter named {name!r} is loaded"}, 400)
    return _json({"success": True, "error_message": "", "loaded_adapters": service.adapters.paths()})


@router.post("/pause_generation")
async def pause_generation(request: Request, service: ServiceDep) -> Response:
    body = orjson.loads(await request.body() or b"{}")
    mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
    if mode not in get_args(PauseMode):
        return _error("mode must be one of abort, retract, in_place")
    await service.pause(cast(PauseMode, mode))  # checked just above
    return _json({"message": "Generation paused successfully."})


@router.post("/continue_generation")
async def continue_generation(service: ServiceDep) -> Response:
    await service.resume()
    return _json({"message": "Generation continued successfully."})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(service: ServiceDep) -> Response:
    if await service.flush_cache():
        return PlainTextResponse("Cache flushed.\n")
    return PlainTextResponse("Cache not flushed: requests are running.\n", status_code=400)
