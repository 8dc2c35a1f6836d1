"""The state of one request inside the local engine, and how it decides to stop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import llguidance
import torch

from server.detokenizer import Decoder, IncrementalDetokenizer
from server.engines.base import Finish, SamplingParams, TokenChunk
from server.engines.local.lora import Adapter


@dataclass(slots=True)
class Sequence:
    request_id: str
    input_ids: list[int]
    sampling: SamplingParams
    # The prefix cache's key: the session inside its cache salt (server.cache_scope), so two
    # tenants sending the same session key never reach each other's cached prompt, and inside its
    # adapter, whose keys and values differ from the base's.
    prefix_key: tuple[str, str, str] | None
    cache_salt: str  # the fairness key too: admission takes turns between salts (tenants)
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokenChunk]
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    finish: Finish | None = None
    cancelled: bool = False
    priority: int = 0  # admission order only: higher is admitted first, running requests stay
    adapter: Adapter | None = None
    matcher: llguidance.LLMatcher | None = None  # the JSON schema's grammar state (server.engines.local.grammar)
    # With sampling.return_routed_experts: [tokens, layers x top_k] expert ids of every forward so far.
    routes: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        request_id: str,
        input_ids: list[int],
        sampling: SamplingParams,
        session_key: str | None,
        cache_salt: str | None,
        tokenizer: Decoder,
        priority: int = 0,
        adapter: Adapter | None = None,
        matcher: llguidance.LLMatcher | None = None,
    ) -> Sequence:
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        # Stop strings are matched on text, so only those requests pay for detokenizing.
        detokenizer = IncrementalDetokenizer(tokenizer) if sampling.stop else None
        loop = asyncio.get_running_loop()
        return cls(
            request_id,
            list(input_ids),
            sampling,
            (cache_salt or "", adapter.key if adapter else "", session_key) if session_key else None,
            cache_salt or "",
            loop,
            asyncio.Queue(),
            generator,
            detokenizer,
            priority=priority,
            adapter=adapter,
            matcher=matcher,
        )

    @property
    def done(self) -> bool:
        return self.finish is not None or self.cancelled

    @property
    def tokens(self) -> list[int]:
        return self.input_ids + self.output_ids

    def accept(self, token_id: int, eos_token_ids: frozenset[int], context_length: int) -> Finish | None:
        """Record a sampled token and return why the request ends, if it does."""
        self.output_ids.append(token_id)
        sampling = self.sampling
        if token_id in sampling.stop_token_ids or (not sampling.ignore_eos and token_id in eos_token_ids):
            return Finish("stop", matched=token_id)
        if self.matcher is not None:
            self.matcher.consume_token(token_id)
            if self.matcher.is_stopped():  # the JSON is complete: nothing but end-of-sequence may follow
                return Finish("stop", matched=token_id)
        if self.detokenizer is not None:
            before = len(self.detokenizer.text)
            if self.detokenizer.push([token_id]):
                longest = max(len(s) for s in sampling.stop)
                window = self.detokenizer.text[max(before - longest + 1, 0) :]
                for stop in sampling.stop:
                    if stop in window:
                        return Finish("stop", matched=stop)
        if (
            len(self.output_ids) >= sampling.max_new_tokens
            or len(self.input_ids) + len(self.output_ids) >= context_length
        ):
            return Finish("length")
        return None

    def emit(self, chunk: TokenChunk) -> None:
        """Hand a chunk to the request's event loop (called from the engine thread)."""
        deliver([(self, chunk)])

    def abort(self, message: str, weight_version: str) -> None:
        """End the request with an abort chunk, unless it has ended already."""
        if self.done:
            return
        self.finish = Finish("abort", message=message)
        self.emit(
            TokenChunk(
                [],
                [],
                weight_version,
                len(self.input_ids),
                self.cached_tokens,
                finish=self.finish,
                adapter=self.adapter.key if self.adapter else None,
            )
        )


def _put_all(outputs: list[tuple[Sequence, TokenChunk]]) -> None:
    for seq, chunk in outputs:
        seq.queue.put_nowait(chunk)


def deliver(outputs: list[tuple[Sequence, TokenChunk]]) -> None:
    """Hand the chunks of one step to their event loops, with one wake-up per loop, not per token."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sequence, TokenChunk]]] = {}
    for seq, chunk in outputs:
        by_loop.setdefault(seq.loop, []).append((seq, chunk))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_put_all, items)
