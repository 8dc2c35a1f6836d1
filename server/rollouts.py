"""Rollouts for the learner: n fresh samples of one prompt from the serving weights, at low priority.

They share the engines with users, so two things keep them out of the way: at most
``rollout_max_concurrency`` rollout sequences are in the engines at once (the rest wait here), and
each is sent with ``ROLLOUT_PRIORITY``, so an engine that orders its queue (the local engine; SGLang
with ``--enable-priority-scheduling``) admits waiting user requests first. Rollouts are not user
conversations: nothing here is logged, and no session turn is remembered.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from transformers import PreTrainedTokenizerBase

from server.cache_scope import cache_salt, engine_session_key
from server.choice import ChoiceState
from server.engines.base import ROLLOUT_PRIORITY, Engine, SamplingParams
from server.errors import ApiError
from server.prompt import PromptRenderer, template_message
from server.schemas import INT64_MAX, INT64_MIN, Message, StopSequences, check_json_schema
from tandem.aio import gather_or_cancel
from tandem.moe_routing import routes_to_base64

__all__ = ["MAX_ROLLOUT_N", "RolloutRequest", "RolloutService"]

MAX_ROLLOUT_N = 64
# Rollouts reuse cached prefixes among themselves only, never a tenant's.
LEARNER_SALT = cache_salt("\x00learner")


class RolloutRequest(BaseModel):
    """One prompt, as token ids, chat messages or raw text, and how to sample ``n`` responses to it."""

    # An admin API: a misspelt field (max_new_tokens) is an error, not silently ignored.
    model_config = ConfigDict(extra="forbid")

    input_ids: list[int] | None = Field(
        None, min_length=1, description="the prompt's token ids, as the learner has them"
    )
    messages: list[Message] | None = Field(None, min_length=1, description="or chat messages, rendered like /v1")
    text: str | None = Field(
        None, min_length=1, description="or raw text, tokenized as SGLang's /generate does (no chat template)"
    )
    n: int = Field(1, ge=1, le=MAX_ROLLOUT_N)
    max_tokens: int | None = Field(None, ge=1, description="default: what the context has left")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="0 or -1 disables it")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="choice i uses seed + i")
    stop: StopSequences = None
    session_id: str | None = Field(None, max_length=256, description="routes like the user's session (cache reuse)")
    json_schema: str | None = Field(
        None, max_length=1 << 20, description="a JSON Schema (as text) the output must match, as SGLang's /generate"
    )
    return_routed_experts: bool = Field(
        False, description="MoE models: each choice's routed_experts, for routing replay (docs/megatron.md)"
    )

    @field_validator("json_schema")
    @classmethod
    def _schema_is_json(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                check_json_schema(json.loads(value))
            except (ValueError, AttributeError) as exc:
                raise ValueError(f"json_schema: {exc}") from None
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> RolloutRequest:
        if sum(form is not None for form in (self.input_ids, self.messages, self.text)) != 1:
            raise ValueError("give exactly one of input_ids, messages and text")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


class RolloutService:
    """Samples rollouts through the engine; ``max_concurrency`` bounds rollout sequences in it."""

    def __init__(
        self, engine: Engine, tokenizer: PreTrainedTokenizerBase, renderer: PromptRenderer, max_concurrency: int
    ) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self._engine = engine
        self._tokenizer = tokenizer
        self._renderer = renderer
        self._vocab = max(len(tokenizer), tokenizer.vocab_size)
        self._slots = asyncio.Semaphore(max_concurrency)
        self.max_concurrency = max_concurrency

    async def generate(self, request: RolloutRequest) -> dict[str, Any]:
        """``n`` samples of the prompt; each choice has its output ids, behaviour logprobs and weight spans.

        Raises:
            ApiError: 400 for a prompt the model cannot take; 503 when the engine aborted a sample.
            EngineError: the engine failed (its status says how).
        """
        prompt_ids = await self._prompt_ids(request)
        max_new = self._renderer.max_new_tokens(len(prompt_ids), request.max_tokens)
        base = SamplingParams(
            max_new_tokens=max_new,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k if request.top_k > 0 else -1,
            stop=request.stop_list,
            json_schema=request.json_schema,
            return_routed_experts=request.return_routed_experts,
        )
        seeds = [None if request.seed is None else _wrap_int64(request.seed + i) for i in range(request.n)]
        started = time.perf_counter()
        # On the first failure the other samples are cancelled: their engine requests end.
        states = await gather_or_cancel(
            [
                self._sample(i, prompt_ids, SamplingParams(**{**asdict(base), "seed": s}), request)
                for i, s in enumerate(seeds)
            ]
        )
        aborted = next((s for s in states if s.aborted), None)
        if aborted is not None:
            raise ApiError(503, f"The engine aborted a rollout sample ({aborted.abort_message}); retry it.")
        return {
            "model": self._engine.model_info().served_model_name,
            "prompt_ids": prompt_ids,
            "choices": [_choice(s) for s in states],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": sum(len(s.token_ids) for s in states),
            },
            "elapsed_s": time.perf_counter() - started,
        }

    async def _prompt_ids(self, request: RolloutRequest) -> list[int]:
        if request.messages is not None:
            _, ids = await self._renderer.render_conversation([template_message(m) for m in request.messages])
            return ids
        ids = request.input_ids or [] if request.text is None else self._tokenizer.encode(request.text)
        if not ids:
            raise ApiError(400, "the text encodes to no tokens", param="text")
        if min(ids) < 0 or max(ids) >= self._vocab:
            raise ApiError(400, f"input_ids must be token ids in [0, {self._vocab})", param="input_ids")
        if len(ids) >= self._renderer.context_length:
            raise ApiError(
                400,
                f"The prompt has {len(ids)} tokens but the model's context is {self._renderer.context_length}.",
                param="input_ids",
                code="context_length_exceeded",
            )
        return list(ids)

    async def _sample(
        self, index: int, prompt_ids: list[int], sampling: SamplingParams, request: RolloutRequest
    ) -> ChoiceState:
        state = ChoiceState(index, self._tokenizer, (), incremental=False)
        async with self._slots:
            # Buffered: nobody reads a rollout before it is complete, so a pool may retry it anywhere.
            chunks = self._engine.generate(
                prompt_ids,
                sampling,
                session_key=engine_session_key(LEARNER_SALT, request.session_id),
                cache_salt=LEARNER_SALT,
                stream=False,
                priority=ROLLOUT_PRIORITY,
            )
            async for chunk in chunks:
                state.add(chunk)
        return state


def _choice(state: ChoiceState) -> dict[str, Any]:
    return {
        "index": state.index,
        "output_ids": state.token_ids,
        "logprobs": state.logprobs,
        "text": state.visible_text,
        "finish_reason": state.finish_reason,
        "weight_versions": [{"version": s.version, "start": s.start, "end": s.end} for s in state.spans],
        "cached_tokens": state.cached_tokens,
        # SGLang's layout (base64 int32, a row of layers x top_k per token but the last); null: not asked.
        "routed_experts": None if state.routed_experts is None else routes_to_base64(state.routed_experts),
    }
