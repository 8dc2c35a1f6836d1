"""Chat completions: prompt -> engine (n choices) -> OpenAI response or SSE stream -> conversation log."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from array import array
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from server.adapter_directory import BASE_ALONE, AdapterDirectory, Route, ServedAdapter
from server.auth import Identity
from server.cache_scope import cache_salt, engine_session_key
from server.choice import ChoiceState, TokenText
from server.conversation_log import ConversationLog, JournalWriteError
from server.detokenizer import decode_text
from server.engines.base import Engine, EngineError, SamplingParams, TokenChunk
from server.errors import ApiError, error_payload, journal_message
from server.prompt import PromptRenderer, template_message
from server.schemas import ChatCompletionRequest
from server.server_tools import ServerTools
from server.session_turns import Reply, SessionTurns, Turn
from server.sse import DONE, event
from server.tools import ToolReader, forced_schema, tool_call_deltas, tool_calls_json
from storage.records import CompletionRecord
from tandem.tool_calls import ToolCallParser, ToolOutput, conversation_with_tools, parser_for, renders_tools

logger = logging.getLogger(__name__)


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


@dataclass(slots=True)
class ChatCall:
    """One accepted request, ready for the engine."""

    id: str
    request: ChatCompletionRequest
    identity: Identity
    session_key: str | None
    cache_salt: str  # the tenant's prefix-cache namespace on the engines (server.cache_scope)
    conversation: list[dict[str, Any]]
    prompt_ids: list[int]
    rendered_ids: list[int]  # the template's plain rendering (prompt_ids may carry earlier replies as generated)
    sampling: list[SamplingParams]
    started: float
    created_at: float
    log_fields: dict[str, Any]
    route: Route = BASE_ALONE  # resolved once: a swap meanwhile changes the next request
    tools: ToolReader | None = None  # with tools: reads each choice's text into content and calls
    server_tools: frozenset[str] = frozenset()  # the gateway's own tools offered (server/server_tools.py)
    step: int = 0  # tool-calling turns the gateway ran before this one
    earlier_usage: tuple[int, int] = (0, 0)  # prompt and completion tokens of those turns
    states: list[ChoiceState] = field(default_factory=list)
    content_sent: list[int] = field(default_factory=list)  # with tools: content characters streamed per choice
    first_token_at: float | None = None

    @property
    def adapter(self) -> ServedAdapter | None:
        return self.route.adapter

    @property
    def token_budget(self) -> int:
        """The most tokens this request can use: its prompt and every choice's completion budget."""
        return len(self.prompt_ids) + sum(s.max_new_tokens for s in self.sampling)


async def _close(stream: AsyncIterator[TokenChunk]) -> None:
    if isinstance(stream, AsyncGenerator):
        await stream.aclose()


async def _merge(streams: list[AsyncIterator[TokenChunk]]) -> AsyncGenerator[tuple[int, TokenChunk], None]:
    """Chunks of all choices as they come, tagged with the choice index."""
    if len(streams) == 1:
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            await _close(streams[0])
        return
    queue: asyncio.Queue[tuple[int, TokenChunk | Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[TokenChunk]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, None))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        finally:
            await _close(stream)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ChatService:
    def __init__(
        self,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        log: ConversationLog,
        adapters: AdapterDirectory | None = None,
        *,
        tool_parser: str = "auto",
        server_tools: ServerTools | None = None,
    ) -> None:
        info = engine.model_info()
        self.engine = engine
        self.model_name = info.served_model_name
        self.renderer = PromptRenderer(tokenizer, info.context_length)
        end_ids = {*info.eos_token_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])}
        self.turns = SessionTurns(self.renderer.render_closed, lambda ids: decode_text(tokenizer, ids), end_ids)
        self.tokenizer = tokenizer
        self.token_text = TokenText(tokenizer)
        self.log = log
        self.adapters = adapters
        self.tool_parser: ToolCallParser = parser_for(tool_parser, self.renderer.chat_template)
        self._template_renders_tools = renders_tools(self.renderer.chat_template)
        self.server_tools = server_tools
        self._background: set[asyncio.Task[None]] = set()
        self._created = int(time.time())

    def models(self) -> dict[str, Any]:
        info = self.engine.model_info()
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "tandem",
            "max_model_len": info.context_length,
        }
        return {"object": "list", "data": [card]}

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                param="model",
                code="model_not_found",
            )

    async def accept(
        self,
        request: ChatCompletionRequest,
        identity: Identity,
        *,
        session_header: str | None,
        log_fields: dict[str, Any],
        continuing: ChatCall | None = None,
    ) -> ChatCall:
        """Validate against the model and render the prompt; raises ApiError for a bad request.
        ``continuing``: the turn whose gateway tool calls this request answers (same id and clock)."""
        started = time.perf_counter()
        self.check_model(request.model)
        offered: frozenset[str] = frozenset()
        if continuing is not None:
            offered = continuing.server_tools
        elif self.server_tools is not None:
            request, offered = self.server_tools.offer(request, identity)
        conversation = [template_message(m) for m in request.messages]
        template_tools = None
        if request.tools:
            conversation, template_tools = conversation_with_tools(
                conversation,
                [tool.model_dump(exclude_none=True) for tool in request.tools],
                template_renders=self._template_renders_tools,
                parser=self.tool_parser,
            )
        conversation, rendered_ids = await self.renderer.render_conversation(conversation, template_tools)
        metadata = request.metadata or {}
        session_key = session_header or metadata.get("session_id") or request.user
        prompt_ids = rendered_ids
        # A turn with tools is answered from its own rendering: its reply is read into calls, so the
        # next turn's history does not hold the reply's text as generated.
        if session_key and not request.tools:
            spliced = self.turns.splice((identity.tenant_id, session_key), conversation, rendered_ids)
            if spliced is not None and len(spliced) < self.renderer.context_length:
                prompt_ids = spliced
        max_new = self.renderer.max_new_tokens(len(prompt_ids), request.max_new_tokens)
        temperature = 1.0 if request.temperature is None else request.temperature
        top_p = 1.0 if request.top_p is None else request.top_p
        if top_p == 0:  # only the most likely token survives: greedy
            temperature, top_p = 0.0, 1.0
        base = SamplingParams(
            max_new_tokens=max_new,
            temperature=temperature,
            top_p=top_p,
            top_k=request.top_k if request.top_k else -1,
            stop=request.stop_list,
            seed=request.seed,
            top_logprobs=(request.top_logprobs or 0) if request.logprobs else 0,
            ignore_eos=request.ignore_eos,
            json_schema=forced_schema(request),
        )
        seeds = [None if request.seed is None else _wrap_int64(request.seed + i) for i in range(request.n)]
        call = ChatCall(
            id=continuing.id if continuing else f"chatcmpl-{uuid.uuid4().hex}",
            request=request,
            identity=identity,
            session_key=session_key,
            cache_salt=cache_salt(identity.tenant_id),
            conversation=conversation,
            prompt_ids=prompt_ids,
            rendered_ids=rendered_ids,
            sampling=[SamplingParams(**{**asdict(base), "seed": seed}) for seed in seeds],
            started=started,
            created_at=time.time(),
            log_fields=log_fields,
            route=self.adapters.resolve(identity.tenant_id, request.user, session_key) if self.adapters else BASE_ALONE,
            tools=ToolReader(request, self.tool_parser) if request.tools else None,
            server_tools=offered,
        )
        if continuing is not None:
            call.started, call.created_at, call.first_token_at = (
                continuing.started,
                continuing.created_at,
                continuing.first_token_at,
            )
            call.step = continuing.step + 1
            call.earlier_usage = self._usage_counts(continuing)
        call.states = [
            ChoiceState(i, self.tokenizer, request.stop_list, incremental=request.stream) for i in range(request.n)
        ]
        call.content_sent = [0] * request.n
        log_fields.update(
            completion_id=call.id,
            tenant_id=identity.tenant_id,
            prompt_tokens=len(prompt_ids),
            adapter_id=call.adapter.id if call.adapter else None,
            canary_id=call.route.canary_id,
        )
        return call

    def _generate(self, call: ChatCall) -> AsyncGenerator[tuple[int, TokenChunk], None]:
        streams = [
            self.engine.generate(
                call.prompt_ids,
                sampling,
                session_key=engine_session_key(call.cache_salt, call.session_key),
                cache_salt=call.cache_salt,
                request_id=f"{call.id}-{i}",
                # A buffered answer reaches nobody before it is complete, so a pool may retry it anywhere.
                stream=call.request.stream,
                adapter=call.adapter.ref if call.adapter else None,
                weight_version=call.route.weight_version,
            )
            for i, sampling in enumerate(call.sampling)
        ]
        return _merge(streams)

    def _add(self, call: ChatCall, index: int, chunk: TokenChunk) -> str:
        if call.first_token_at is None and chunk.token_ids:
            call.first_token_at = time.perf_counter()
        return call.states[index].add(chunk)

    # ---- non-streaming ----

    async def complete(self, call: ChatCall) -> dict[str, Any]:
        while True:
            chunks = self._generate(call)
            try:
                async for index, chunk in chunks:
                    self._add(call, index, chunk)
            finally:
                await chunks.aclose()
            aborted = next((s for s in call.states if s.aborted), None)
            if aborted is not None:
                raise ApiError(503, f"The engine aborted the request ({aborted.abort_message}); retry it.")
            outputs = self._tool_outputs(call)
            following = await self._run_server_tools(call, outputs)
            if following is None:
                break
            call = following
        await self.log.record_completion(self._record(call, "ok"))
        self._remember(call)
        return {
            **self._head(call, "chat.completion", call.states[0].weight_version),
            "choices": [
                {
                    "index": s.index,
                    "message": _message(output),
                    "logprobs": self._logprobs(call, s, 0, len(s.token_ids)),
                    "finish_reason": self._finish_reason(call, s, output),
                }
                for s, output in zip(call.states, outputs, strict=True)
            ],
            "usage": self._usage(call),
        }

    # ---- streaming ----

    async def open_stream(self, call: ChatCall) -> AsyncIterator[bytes]:
        """Start the engine and wait for every choice's first chunk, so that an overloaded or
        unavailable engine still gets an HTTP status; then stream the rest as SSE."""
        chunks = self._generate(call)
        primed: list[tuple[int, TokenChunk]] = []
        seen: set[int] = set()
        try:
            while len(seen) < len(call.states):
                index, chunk = await anext(chunks)
                primed.append((index, chunk))
                seen.add(index)
                if chunk.finish is not None and chunk.finish.type == "abort":
                    raise ApiError(503, f"The engine aborted the request ({chunk.finish.message}); retry it.")
        except BaseException:
            await chunks.aclose()
            raise
        return self._sse(call, primed, chunks)

    async def _sse(
        self,
        call: ChatCall,
        primed: list[tuple[int, TokenChunk]],
        chunks: AsyncGenerator[tuple[int, TokenChunk], None],
    ) -> AsyncIterator[bytes]:
        head = self._head(call, "chat.completion.chunk", primed[0][1].weight_version)
        # Events that are ready together go out in one write: a socket write per event is most of
        # the gateway's cost per streamed request.
        opening = [
            event({**head, "choices": [_delta(s.index, {"role": "assistant", "content": ""})]}) for s in call.states
        ]
        status = "cancelled"
        try:
            opening += [data for i, c in primed if (data := self._content_event(call, head, i, c)) is not None]
            yield b"".join(opening)
            while True:
                async for index, chunk in chunks:
                    if (data := self._content_event(call, head, index, chunk)) is not None:
                        yield data
                aborted = next((s for s in call.states if s.aborted), None)
                if aborted is not None:
                    raise EngineError(f"the engine aborted the request ({aborted.abort_message})", 503)
                outputs = self._tool_outputs(call)
                following = await self._run_server_tools(call, outputs)
                if following is None:
                    break
                await chunks.aclose()
                call, chunks = following, self._generate(following)
            status = "ok"
            await self.log.record_completion(self._record(call, status))
            self._remember(call)
        except EngineError as exc:
            status = "error"
            self._record_later(call, status)
            error = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}}
            yield event(error) + DONE
            return
        except JournalWriteError as exc:
            status = "unlogged"  # the answer streamed but was not kept: the client gets no finish event
            yield event(error_payload(503, journal_message(exc), code="log_unavailable")) + DONE
            return
        finally:
            await chunks.aclose()
            if status == "cancelled":  # the client went away mid-stream
                self._record_later(call, status)
        closing = [
            event({**head, "choices": [_delta(s.index, delta)]})
            for s, output in zip(call.states, outputs, strict=True)
            for delta in self._closing_deltas(call, s, output)
        ]
        closing += [
            event({**head, "choices": [_delta(s.index, {}, self._finish_reason(call, s, output))]})
            for s, output in zip(call.states, outputs, strict=True)
        ]
        if call.request.include_usage:
            closing.append(event({**head, "choices": [], "usage": self._usage(call)}))
        yield b"".join([*closing, DONE])

    def _content_event(self, call: ChatCall, head: dict[str, Any], index: int, chunk: TokenChunk) -> bytes | None:
        state = call.states[index]
        start = len(state.token_ids)
        text = self._add(call, index, chunk)
        if call.tools is not None:
            text = self._tool_content(call, state)
        logprobs = self._logprobs(call, state, start, len(state.token_ids)) if chunk.token_ids else None
        if not text and logprobs is None:
            return None
        return event({**head, "choices": [_delta(index, {"content": text}, None, logprobs)]})

    # ---- tool calls ----

    def _tool_content(self, call: ChatCall, state: ChoiceState) -> str:
        """The content that may be streamed now: text the reader knows is not a tool call."""
        assert call.tools is not None
        text = state.visible_text.lstrip()
        end = call.tools.content_end(text)
        sent = call.content_sent[state.index]
        if end <= sent:
            return ""
        call.content_sent[state.index] = end
        return text[sent:end]

    def _tool_outputs(self, call: ChatCall) -> list[ToolOutput]:
        """Each choice's content and tool calls; the calls are logged beside the raw tokens."""
        if call.tools is None:
            return [ToolOutput(s.visible_text, []) for s in call.states]
        outputs = [call.tools.read(s.visible_text) for s in call.states]
        for state, output in zip(call.states, outputs, strict=True):
            if output.calls:
                logger.info(
                    "tool calls",
                    extra={
                        "completion_id": call.id,
                        "choice": state.index,
                        "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in output.calls],
                    },
                )
        return outputs

    async def _run_server_tools(self, call: ChatCall, outputs: list[ToolOutput]) -> ChatCall | None:
        """The next turn when the gateway runs this turn's calls itself (logged as a step of its own);
        None when this turn is the answer."""
        if (
            self.server_tools is None
            or not self.server_tools.runs(outputs[0], call.server_tools)
            or call.states[0].finish_reason == "length"
            or call.step >= self.server_tools.max_steps
        ):
            return None
        await self.log.record_completion(self._record(call, "ok", step_only=True))
        results = await self.server_tools.run(outputs[0].calls, completion_id=call.id, step=call.step)
        request = self.server_tools.continuation(call.request, outputs[0], results)
        try:
            return await self.accept(
                request, call.identity, session_header=call.session_key, log_fields=call.log_fields, continuing=call
            )
        except ApiError as exc:  # the results do not fit the context, say: the calls are the answer
            logger.warning("tool loop ended early", extra={"completion_id": call.id, "error": exc.message})
            return None

    def _closing_deltas(self, call: ChatCall, state: ChoiceState, output: ToolOutput) -> list[dict[str, Any]]:
        """What a tool request's stream still owes a choice at its end: unsent content, then its calls."""
        if call.tools is None:
            return []
        sent = state.visible_text.lstrip()[: call.content_sent[state.index]]
        content = output.content or ""
        rest = content.removeprefix(sent) if content.startswith(sent) else ""
        return ([{"content": rest}] if rest else []) + tool_call_deltas(output.calls)

    @staticmethod
    def _finish_reason(call: ChatCall, state: ChoiceState, output: ToolOutput) -> str:
        return call.tools.finish_reason(output, state.finish_reason) if call.tools else state.finish_reason

    # ---- response parts and the log record ----

    def _head(self, call: ChatCall, kind: str, weight_version: str | None) -> dict[str, Any]:
        return {
            "id": call.id,
            "object": kind,
            "created": int(call.created_at),
            "model": self.model_name,
            "system_fingerprint": weight_version,
        }

    def _logprobs(self, call: ChatCall, state: ChoiceState, start: int, end: int) -> dict[str, Any] | None:
        if not call.request.logprobs:
            return None
        return {"content": self.token_text.entries(state, start, end), "refusal": None}

    @staticmethod
    def _usage_counts(call: ChatCall) -> tuple[int, int]:
        """Prompt and completion tokens of the request so far, the gateway's tool turns included."""
        prompt, completion = call.earlier_usage
        return prompt + len(call.prompt_ids), completion + sum(len(s.token_ids) for s in call.states)

    def _usage(self, call: ChatCall) -> dict[str, Any]:
        prompt, completion = self._usage_counts(call)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": call.states[0].cached_tokens},
        }
        return usage

    def _record(self, call: ChatCall, status: str, *, step_only: bool = False) -> CompletionRecord:
        """The log record of the call's turn; ``step_only``: a tool-calling turn the gateway ran, which
        the answer's record (the call's id) follows."""
        now = time.perf_counter()
        first = call.states[0]
        request = call.request
        completion_tokens = sum(len(s.token_ids) for s in call.states)
        replica = first.replica or self.engine.replica
        ttft_ms = None if call.first_token_at is None else (call.first_token_at - call.started) * 1000
        call.log_fields.update(
            completion_tokens=completion_tokens,
            cached_tokens=first.cached_tokens,
            ttft_ms=ttft_ms,
            outcome=status,
            replica=replica,
        )
        metadata = dict(request.metadata or {})
        if step_only or call.step:
            metadata.update(tool_loop=call.id, tool_step=str(call.step))
        return CompletionRecord(
            id=f"{call.id}-step{call.step}" if step_only else call.id,
            tenant_id=call.identity.tenant_id,
            model=self.model_name,
            request_messages=call.conversation,
            sampling_params={**asdict(call.sampling[0]), "n": request.n, "seed": request.seed},
            prompt_token_ids=call.prompt_ids,
            choices=[s.record() for s in call.states],
            weight_version=first.weight_version or self.engine.model_info().weight_version,
            engine_replica=replica,
            prompt_tokens=len(call.prompt_ids),
            cached_tokens=first.cached_tokens,
            completion_tokens=completion_tokens,
            latency_ms=(now - call.started) * 1000,
            ttft_ms=ttft_ms,
            created_at=call.created_at,
            finished_at=time.time(),
            stream=request.stream,
            status=status,  # type: ignore[arg-type]
            api_key_id=call.identity.api_key_id,
            end_user=request.user,
            session_key=call.session_key,
            metadata=metadata,
            adapter_id=call.adapter.id if call.adapter else None,
            canary_id=call.route.canary_id,
            canary_arm=_arm(call.route, first.weight_version),
        )

    def _remember(self, call: ChatCall) -> None:
        """Keep the turn so the session's next prompt can carry these replies as generated (not a turn
        with tools: its replies were read into calls, which the next request sends back instead)."""
        if call.session_key and call.tools is None:
            replies = tuple(Reply(s.visible_text, array("l", s.token_ids)) for s in call.states)
            turn = Turn(call.conversation, array("l", call.prompt_ids), array("l", call.rendered_ids), replies)
            self.turns.remember((call.identity.tenant_id, call.session_key), turn)

    def _record_later(self, call: ChatCall, status: str) -> None:
        # Called where the request task may be cancelled, so the write gets its own task.
        task = asyncio.create_task(self._write(self._record(call, status)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _write(self, record: CompletionRecord) -> None:
        try:
            await self.log.record_completion(record)
        except JournalWriteError as exc:
            logger.warning("could not log completion: %s", exc, extra={"completion_id": record.id})
        except Exception:
            logger.exception("could not log completion", extra={"completion_id": record.id})

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _message(output: ToolOutput) -> dict[str, Any]:
    calls = tool_calls_json(output.calls) if output.calls else None
    return {"role": "assistant", "content": output.content, "refusal": None, "tool_calls": calls}


def _delta(
    index: int, delta: dict[str, Any], finish_reason: str | None = None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def _arm(route: Route, served_version: str | None) -> Literal["canary", "control"] | None:
    """The canary side that answered: a base candidate's side whose replicas were all out of rotation
    was answered by the pool's weights, which is the control's answer."""
    if route.weight_version is not None and served_version not in (None, route.weight_version):
        return "control"
    return route.arm
