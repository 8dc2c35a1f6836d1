"""One sampling step for a batch whose rows each have their own temperature, top-p, top-k and seed.

Logprobs follow SGLang: log_softmax(logits / temperature) over the full vocabulary, before top-k and
top-p, so what is logged matches what a trainer recomputes from the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engines.base import SamplingParams


@dataclass(slots=True)
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1]).expand_as(logits)
    drop = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays, also
    # when a tiny top_p rounds to 0 in float32.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


# Below this a temperature is greedy (as in SGLang): dividing by it would overflow the logits.
GREEDY_BELOW = 1e-5


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    allowed: torch.Tensor | None = None,
) -> Sampled:
    """Pick one token per row of ``logits`` [batch, vocab]; ``allowed`` [batch, vocab] (bool), if given,
    rules out every other token before anything else (a grammar's mask: the logprobs are the
    constrained distribution's, which is what the tokens were sampled from)."""
    logits = logits.float().cpu()  # [batch, vocab]: small; the per-row generators live on the CPU
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    temperature = torch.tensor([p.temperature for p in params])
    greedy = temperature < GREEDY_BELOW
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    logprobs = scaled.log_softmax(dim=-1)

    chosen = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        top_k = torch.tensor([p.top_k for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        filtered = scaled
        if bool(((top_k > 0) | (top_p < 1)).any()):
            filtered = _filter_top_k_top_p(scaled, top_k, top_p)
        probs = filtered.softmax(dim=-1)
        for row, generator in enumerate(generators):
            if not greedy[row]:
                chosen[row] = torch.multinomial(probs[row], 1, generator=generator)[0]

    token_logprobs = logprobs.gather(1, chosen[:, None])[:, 0]
    top: list[list[tuple[int, float]]] = [[] for _ in params]
    k = max(p.top_logprobs for p in params)
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        for row, p in enumerate(params):
            top[row] = list(
                zip(ids[row, : p.top_logprobs].tolist(), values[row, : p.top_logprobs].tolist(), strict=True)
            )
    return Sampled(chosen.tolist(), token_logprobs.tolist(), top)
