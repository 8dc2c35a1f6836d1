"""Forward passes against the model: prefill one request (reusing its session's cached prefix),
decode one token for the whole batch, and hand each request the token sampled for it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from server.engines.base import EngineError, TokenChunk
from server.engines.local.grammar import GrammarCache, MaskFiller
from server.engines.local.kv import BatchKV, RowKV
from server.engines.local.lora import BatchLora
from server.engines.local.prefix_cache import PrefixCache
from server.engines.local.sampler import sample
from server.engines.local.sequence import Sequence, deliver
from tandem.moe_routing import RouteRecorder


def _eos_ids(model: PreTrainedModel, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class ModelRunner:
    """Runs on the engine thread; ``weight_version`` names the weights each chunk came from."""

    def __init__(
        self, model: PreTrainedModel, tokenizer: Any, prefix: PrefixCache, weight_version: Callable[[], str]
    ) -> None:
        self._model = model
        self._prefix = prefix
        self._weight_version = weight_version
        self._lora = BatchLora(model)
        self._device = next(model.parameters()).device  # inputs go where the weights are (cpu, cuda)
        self.context_length = int(getattr(model.config, "max_position_embeddings", 2048))
        self.eos_ids = _eos_ids(model, tokenizer)
        vocab_size = int(model.config.vocab_size)
        self.grammars = GrammarCache(tokenizer, vocab_size, sorted(self.eos_ids))
        self._masks = MaskFiller(vocab_size)
        self._routes = RouteRecorder(model)

    def check_prompt(self, input_ids: list[int]) -> None:
        """Refuse a prompt the model cannot take, before it is queued."""
        if not input_ids:
            raise EngineError("input_ids must not be empty", 400)
        if len(input_ids) >= self.context_length:
            raise EngineError(
                f"the prompt has {len(input_ids)} tokens but the model's context is {self.context_length}",
                400,
            )
        vocab = self._model.config.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise EngineError(f"token ids must be in [0, {vocab})", 400)

    def prefill(self, seq: Sequence) -> RowKV:
        """Run ``seq``'s uncached tokens, sample its next token, and return its KV."""
        tokens = seq.tokens
        reuse, kv = 0, None
        # A retracted request (it has output already) re-prefills everything; one recording its routes
        # too, as a cached prefix holds no routes.
        record = seq.sampling.return_routed_experts
        if seq.prefix_key and not seq.output_ids and not record:
            reuse, kv = self._prefix.take(seq.prefix_key, tokens)
            seq.cached_tokens = reuse
        cache = kv.to_cache() if kv is not None else DynamicCache(config=self._model.config)
        positions = torch.arange(reuse, len(tokens), device=self._device)
        allowed = self._masks.start([seq.matcher])
        self._lora.set_rows([seq.adapter])
        with self._routes.recording(record) as routes:
            out = self._model(
                input_ids=torch.tensor([tokens[reuse:]], device=self._device),
                attention_mask=torch.ones((1, len(tokens)), dtype=torch.long, device=self._device),
                position_ids=positions[None],
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        seq.routes = routes
        self._accept([seq], out.logits[:, -1], allowed)
        return RowKV.from_cache(cache)

    def decode(self, seqs: list[Sequence], batch: BatchKV) -> None:
        """One token for every row of ``batch`` (row i is ``seqs[i]``) in a single forward."""
        positions = batch.next_positions()
        mask = batch.grow_mask()
        allowed = self._masks.start([seq.matcher for seq in seqs])  # computed while the forward runs
        self._lora.set_rows([seq.adapter for seq in seqs])
        with self._routes.recording(any(seq.sampling.return_routed_experts for seq in seqs)) as routes:
            out = self._model(
                input_ids=torch.tensor([[seq.output_ids[-1]] for seq in seqs], device=self._device),
                attention_mask=mask,
                position_ids=positions,
                cache=batch.cache,
                use_cache=True,
            )
        for row, step_routes in enumerate(routes[0] if routes else ()):
            if seqs[row].sampling.return_routed_experts:
                seqs[row].routes.append(step_routes[None])
        self._accept(seqs, out.logits[:, -1], allowed)

    def _accept(self, seqs: list[Sequence], logits: torch.Tensor, allowed: Future[torch.Tensor | None]) -> None:
        sampled = sample(logits, [s.sampling for s in seqs], [s.generator for s in seqs], allowed.result())
        version = self._weight_version()
        outputs = []
        for row, seq in enumerate(seqs):
            if seq.cancelled:
                continue
            finish = seq.accept(sampled.token_ids[row], self.eos_ids, self.context_length)
            seq.finish = finish
            chunk = TokenChunk(
                token_ids=[sampled.token_ids[row]],
                logprobs=[sampled.logprobs[row]],
                weight_version=version,
                prompt_tokens=len(seq.input_ids),
                cached_tokens=seq.cached_tokens,
                top_logprobs=[sampled.top_logprobs[row]] if seq.sampling.top_logprobs else [],
                finish=finish,
                adapter=seq.adapter.key if seq.adapter else None,
                routed_experts=torch.cat(seq.routes).tolist() if finish and seq.routes else None,
            )
            outputs.append((seq, chunk))
        deliver(outputs)

    def close(self) -> None:
        self._masks.close()

    def remember_prefix(self, seq: Sequence, row: RowKV) -> None:
        """Keep a finished session turn's KV for the session's next turn."""
        if seq.prefix_key and self._prefix.capacity_bytes and seq.finish and seq.finish.type != "abort":
            self._prefix.put(seq.prefix_key, seq.tokens, row)
