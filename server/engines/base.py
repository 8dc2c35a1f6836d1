"""The engine interface the gateway talks to: token ids in, token chunks out.

Two backends implement it: the in-process local engine and an HTTP client for SGLang's native API
(which `tandem engine` also answers), so the gateway never cares which one it drives.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from server.weight_delta import WeightDelta

PauseMode = Literal["abort", "retract", "in_place"]
FinishType = Literal["stop", "length", "abort"]

# Scheduling priority of a request: higher goes first (SGLang's default order). User traffic runs at
# the default; the learner's rollouts below it, so queued user requests are admitted before them.
DEFAULT_PRIORITY = 0
ROLLOUT_PRIORITY = -1


class EngineError(Exception):
    """The engine could not serve a request; ``status`` is the HTTP status to report."""

    def __init__(self, message: str, status: int = 500, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class EngineOverloaded(EngineError):
    def __init__(self, message: str = "the engine queue is full; retry later") -> None:
        super().__init__(message, 429, retryable=True)


class EngineUnavailable(EngineError):
    def __init__(self, message: str = "no engine is ready") -> None:
        super().__init__(message, 503, retryable=True)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-request sampling; temperature 0 means greedy."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0
    ignore_eos: bool = False
    # A JSON Schema (as text) the output must match, enforced token by token (SGLang's json_schema).
    json_schema: str | None = None
    # Record the experts an MoE model routed each token to (tandem.moe_routing), for routing replay.
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 (off) or positive")


@dataclass(slots=True, frozen=True)
class AdapterRef:
    """A LoRA adapter to serve a request with: ``key`` (its version id) names it in caches, ``path``
    is its PEFT folder, ``scope`` whom it serves (a pool places a scope's requests together, so a
    new version of its adapter lands where the old one was); empty: the key places them."""

    key: str
    path: str
    scope: str = ""


@dataclass(slots=True, frozen=True)
class Finish:
    type: FinishType
    matched: int | str | None = None
    message: str | None = None


@dataclass(slots=True)
class TokenChunk:
    """New output tokens of one request, all produced by the same weight version.

    ``top_logprobs`` has one list of (token id, logprob) per token when asked for, else is empty.
    ``finish`` is set on the last chunk of a request (which may carry no tokens).
    ``replica`` names the server that produced it, when a pool chose one; ``adapter`` the LoRA
    adapter (its key) the tokens were decoded with, None for the base weights alone.
    """

    token_ids: list[int]
    logprobs: list[float]
    weight_version: str
    prompt_tokens: int
    cached_tokens: int
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: Finish | None = None
    replica: str | None = None
    adapter: str | None = None
    # On the last chunk, when asked for: per token fed through the model, its layers x top_k experts.
    routed_experts: list[list[int]] | None = None


@dataclass(slots=True, frozen=True)
class ModelInfo:
    model_path: str
    served_model_name: str
    weight_version: str
    context_length: int
    eos_token_ids: tuple[int, ...]


class Engine(Protocol):
    """One serving replica."""

    replica: str

    def model_info(self) -> ModelInfo: ...

    def generate(
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
        weight_version: str | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """``cache_salt`` namespaces prefix-cache reuse (``server.cache_scope``): a request reuses only
        prefixes cached under the same salt, so tenants cannot read each other's prompts through it.
        ``adapter``: decode with this LoRA adapter over the serving weights. ``weight_version``: the
        base weights to answer with while a base canary splits a pool (None: the pool's own); an
        engine with one set of weights answers with those, and each chunk names them."""
        ...

    async def health(self) -> bool: ...

    async def pause(self, mode: PauseMode = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, model_path: str, weight_version: str) -> None: ...

    async def update_weights_from_delta(self, delta: WeightDelta, model_path: str, weight_version: str) -> None:
        """Apply ``delta`` to the serving weights; ``model_path`` is the whole checkpoint they then equal
        (a server that cannot apply deltas loads it from disk instead)."""
        ...

    async def flush_cache(self) -> bool: ...

    async def close(self) -> None: ...
