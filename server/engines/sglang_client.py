"""An Engine that drives one server speaking SGLang's native API (real SGLang or `tandem engine`).

Token in, token out over ``/generate`` with ``input_ids``; streamed events carry cumulative
``output_ids`` and logprobs (SGLang's default), so each event's new tail becomes one TokenChunk.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from server.engines.base import (
    DEFAULT_PRIORITY,
    AdapterRef,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    ModelInfo,
    PauseMode,
    SamplingParams,
    TokenChunk,
)
from server.engines.sglang_adapters import ResidentAdapters
from server.engines.sglang_protocol import finish_from_json, sampling_to_json
from server.weight_delta import WeightDelta
from tandem.moe_routing import routes_from_base64


def _context_length_from_config(model_path: str) -> int:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    return int(config.get("max_position_embeddings") or 0)


class SGLangClient:
    """``timeout_s`` bounds a whole request; ``stall_timeout_s`` the silence between two reads, so a
    replica that stops answering mid-stream is noticed long before the request would time out."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 600.0,
        stall_timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        replica: str | None = None,
        max_loaded_adapters: int = 8,
    ) -> None:
        self.url = url.rstrip("/")
        self.replica = replica or self.url
        self._timeout = aiohttp.ClientTimeout(
            total=timeout_s, sock_connect=connect_timeout_s, sock_read=stall_timeout_s
        )
        # For calls that may legitimately stay silent for long: one-piece replies, weight loads.
        self._silent_timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._info: ModelInfo | None = None
        self.weight_sources: frozenset[str] = frozenset({"disk"})
        self.adapters = ResidentAdapters(self._post, max_loaded=max_loaded_adapters)

    @classmethod
    async def open(cls, url: str, **kwargs: Any) -> SGLangClient:
        client = cls(url, **kwargs)
        await client.refresh_model_info()
        return client

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, json_serialize=lambda o: orjson.dumps(o).decode()
            )
        return self._session

    async def refresh_model_info(self) -> ModelInfo:
        data = await self._get_json("/model_info")
        path = str(data.get("model_path", ""))
        context = int(data.get("context_length") or 0) or await self._served_context_length()
        context = context or _context_length_from_config(path)
        # What the server loads weights from: `tandem engine` says; SGLang does not (disk, for us).
        self.weight_sources = frozenset(data.get("weight_sources") or ("disk",))
        self._info = ModelInfo(
            model_path=path,
            served_model_name=str(data.get("served_model_name") or Path(path).name),
            weight_version=str(data.get("weight_version", "default")),
            context_length=context,
            eos_token_ids=(),
        )
        return self._info

    async def ranks(self) -> int:
        """How many ranks this server joins a weight-update group with: SGLang's tensor-parallel size
        (/server_info); `tandem engine`, which has no /server_info, is one rank."""
        try:
            async with self._http().get(self.url + "/server_info") as response:
                if response.status == 404:
                    return 1
                if response.status != 200:
                    raise EngineUnavailable(f"{self.url}/server_info answered {response.status}")
                return int(orjson.loads(await response.read()).get("tp_size") or 1)
        except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError) as exc:
            raise EngineUnavailable(f"{self.url} did not say its tensor-parallel size: {exc}") from exc

    async def _served_context_length(self) -> int:
        """SGLang's /model_info has no context length; its /v1/models cards do (max_model_len)."""
        try:
            cards = (await self._get_json("/v1/models")).get("data") or []
            return int(cards[0].get("max_model_len") or 0) if cards else 0
        except (EngineError, AttributeError, TypeError, ValueError):
            return 0

    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise EngineUnavailable(f"{self.url} has not answered /model_info yet")
        return self._info

    async def _get_json(self, path: str) -> dict[str, Any]:
        try:
            async with self._http().get(self.url + path) as response:
                if response.status != 200:
                    raise EngineUnavailable(f"{self.url}{path} answered {response.status}")
                return dict(orjson.loads(await response.read()))
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise EngineUnavailable(f"{self.url} is unreachable: {exc}") from exc

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            # Loading weights can take minutes without a byte on the wire: no stall timeout here.
            async with self._http().post(self.url + path, json=body, timeout=self._silent_timeout) as response:
                raw = await response.read()
                data = orjson.loads(raw) if raw and response.content_type == "application/json" else {}
                if response.status != 200 or data.get("success") is False:
                    raise EngineError(f"{self.url}{path} failed ({response.status}): {_message(data, raw)}", 502)
                return dict(data)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EngineUnavailable(f"{self.url} is unreachable: {exc}") from exc

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        session_key: str | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
        stream: bool = True,
        priority: int = DEFAULT_PRIORITY,
        adapter: AdapterRef | None = None,
        weight_version: str | None = None,  # one server, one set of weights: whatever serves answers
    ) -> AsyncGenerator[TokenChunk, None]:
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_to_json(sampling),
            "return_logprob": True,
            "stream": stream,
        }
        if sampling.top_logprobs:
            body["top_logprobs_num"] = sampling.top_logprobs
        if sampling.return_routed_experts:  # SGLang servers need --enable-return-routed-experts
            body["return_routed_experts"] = True
        if request_id:
            body["rid"] = request_id
        if session_key:
            body["routing_key"] = session_key
        if cache_salt:  # SGLang matches cached prefixes only within one salt
            body["cache_salt"] = cache_salt
        if priority != DEFAULT_PRIORITY:
            # Honoured by servers started with --enable-priority-scheduling --default-priority-value 0
            # (managed CPU servers are); others ignore it. User requests keep their body unchanged.
            body["priority"] = priority
        headers = {"X-SMG-Routing-Key": session_key} if session_key else None
        if adapter is None:
            async for chunk in self._generate(body, headers, stream):
                yield chunk
            return
        async with self.adapters.using(adapter) as name:
            async for chunk in self._generate({**body, "lora_path": name}, headers, stream):
                chunk.adapter = adapter.key
                yield chunk

    async def _generate(
        self, body: dict[str, Any], headers: dict[str, str] | None, stream: bool
    ) -> AsyncGenerator[TokenChunk, None]:
        # A one-piece reply is silent until complete: only the whole-request timeout applies to it.
        timeout = self._timeout if stream else self._silent_timeout
        try:
            async with self._http().post(
                self.url + "/generate", json=body, headers=headers, timeout=timeout
            ) as response:
                if response.status != 200:
                    raw = await response.read()
                    raise _status_error(response.status, _message(_try_json(raw), raw))
                if not stream:
                    for chunk in _chunks_from_final(_parse_event(await response.read(), self.url)):
                        yield chunk
                    return
                seen, finished = 0, False
                async for line in response.content:  # read to the end ([DONE]) so the connection is reused
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = _chunk_from_event(_parse_event(line[6:], self.url), seen)
                    seen += len(chunk.token_ids)
                    finished = chunk.finish is not None
                    yield chunk
                if not finished:
                    raise EngineUnavailable(f"{self.url} ended the stream before the request finished")
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EngineUnavailable(f"{self.url} failed during generate: {exc or type(exc).__name__}") from exc
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise EngineError(f"{self.url} sent a malformed reply: {exc}", 502, retryable=True) from exc

    async def health(self) -> bool:
        try:
            async with self._http().get(self.url + "/health_generate", timeout=aiohttp.ClientTimeout(total=20)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})

    async def update_weights(self, model_path: str, weight_version: str) -> None:
        await self._post("/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version})
        await self.refresh_model_info()

    async def update_weights_from_delta(self, delta: WeightDelta, model_path: str, weight_version: str) -> None:
        """The delta where the server applies deltas (`tandem engine`) and serves its base; otherwise
        (SGLang has no delta API, or the replica serves another version) the whole checkpoint from disk."""
        if "delta" not in self.weight_sources or self.model_info().weight_version != delta.base_version:
            await self.update_weights(model_path, weight_version)
            return
        body = {"delta_path": str(delta.path), "model_path": model_path, "weight_version": weight_version}
        await self._post("/update_weights_from_delta", body)
        await self.refresh_model_info()

    async def update_weights_from_tensor(self, payload: str, weight_version: str) -> None:
        """SGLang's update_weights_from_tensor with one rank's payload (``server.engines.tensor_ipc``).

        Real SGLang 0.5.23 also wants it between begin_weight_update and end_weight_update.
        """
        body = {"serialized_named_tensors": [payload], "weight_version": weight_version, "flush_cache": True}
        await self._post("/update_weights_from_tensor", body)
        await self.refresh_model_info()

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._post("/destroy_weights_update_group", {"group_name": group_name})

    async def flush_cache(self) -> bool:
        try:
            async with self._http().post(self.url + "/flush_cache") as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _try_json(raw: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def _message(data: dict[str, Any], raw: bytes) -> str:
    error = data.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(data.get("message") or raw[:200].decode(errors="replace"))


def _status_error(status: int, message: str) -> EngineError:
    if status == 429:
        return EngineOverloaded(message)
    if status in (502, 503, 504):
        return EngineUnavailable(message)
    return EngineError(message, 400 if status == 400 else 502)


def _parse_event(raw: bytes, url: str) -> dict[str, Any]:
    """One ``/generate`` reply or stream event; a reply we cannot read is the replica's fault."""
    try:
        event = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise EngineError(f"{url} sent a malformed reply: {raw[:120]!r}", 502, retryable=True) from exc
    if (
        not isinstance(event, dict)
        or not isinstance(event.get("output_ids"), list)
        or not isinstance(event.get("meta_info", {}), dict)
    ):
        if isinstance(event, dict) and "error" in event:
            raise EngineError(_message(event, raw), 502)
        raise EngineError(f"{url} sent a reply without output_ids and meta_info: {raw[:120]!r}", 502, retryable=True)
    return event


def _logprobs(meta: dict[str, Any], key: str, start: int) -> list[Any]:
    return list(meta.get(key) or [])[start:]


def _chunk_from_event(event: dict[str, Any], seen: int) -> TokenChunk:
    meta = event.get("meta_info", {})
    top = _logprobs(meta, "output_top_logprobs", seen)
    output_ids = list(event.get("output_ids", []))
    routes = meta.get("routed_experts")
    return TokenChunk(
        token_ids=output_ids[seen:],
        logprobs=[float(entry[0]) for entry in _logprobs(meta, "output_token_logprobs", seen)],
        weight_version=str(meta.get("weight_version", "default")),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        top_logprobs=[[(int(alt[1]), float(alt[0])) for alt in alts or []] for alts in top],
        finish=finish_from_json(meta.get("finish_reason")),
        routed_experts=routes_from_base64(routes, int(meta.get("prompt_tokens", 0)) + len(output_ids))
        if routes
        else None,
    )


def _chunks_from_final(event: dict[str, Any]) -> list[TokenChunk]:
    """Split a finished reply into one chunk per weight-version span, so attribution survives."""
    whole = _chunk_from_event(event, 0)
    spans = event.get("meta_info", {}).get("weight_versions") or []
    if len(spans) <= 1:
        return [whole]
    chunks = []
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        chunks.append(
            TokenChunk(
                token_ids=whole.token_ids[start:end],
                logprobs=whole.logprobs[start:end],
                weight_version=str(span["version"]),
                prompt_tokens=whole.prompt_tokens,
                cached_tokens=whole.cached_tokens,
                top_logprobs=whole.top_logprobs[start:end],
            )
        )
    chunks[-1].finish, chunks[-1].routed_experts = whole.finish, whole.routed_experts
    return chunks
