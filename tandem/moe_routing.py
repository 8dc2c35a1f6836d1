"""Mixture-of-experts routing, recorded while serving and replayed in training (R3, rollout routing
replay).

transformers' MoE blocks (Qwen2-MoE, Qwen3-MoE, OLMoE, ...) choose experts in a ``*TopKRouter``
module that returns ``(logits, weights, indices)`` for the ``[tokens, hidden]`` states it is given.
The engine records the indices of a forward (``RouteRecorder``); training replays them
(``replayed_routing``): each token goes through the experts its rollout used, with their weights
recomputed from the trained router's logits (so the router still learns). Without replay, a router
that moved since the rollout (or computes slightly differently) sends tokens to other experts, and
the trained log-probs are no longer those of the policy that sampled the tokens.

Layout, as SGLang returns ``meta_info.routed_experts``: one row per token fed through the model (the
prompt and every output token but the last), each ``layers x top_k`` expert ids, layer-major.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["RouteRecorder", "moe_routers", "replayed_routing", "routes_from_base64", "routes_to_base64"]


def routes_to_base64(routes: list[list[int]]) -> str:
    """SGLang's wire form of routes: the int32 expert ids, token-major, as base64."""
    return base64.b64encode(np.asarray(routes, dtype="<i4").tobytes()).decode("ascii")


def routes_from_base64(data: str, sequence_length: int) -> list[list[int]]:
    """``routes_to_base64``'s ids as rows for a sequence of ``sequence_length`` tokens (prompt and
    output): one per token but the last, the tokens fed through the model."""
    ids = np.frombuffer(base64.b64decode(data), dtype="<i4")
    rows = sequence_length - 1
    if rows < 1 or ids.size % rows:
        raise ValueError(f"routed_experts holds {ids.size} ids, not a whole row for each of {rows} tokens")
    return ids.reshape(rows, -1).tolist()


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's expert routers, in layer order; empty for a dense model."""
    return [module for module in model.modules() if type(module).__name__.endswith("TopKRouter")]


class RouteRecorder:
    """Keeps the expert ids every router chose in a forward run under ``recording``."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        self._captured: list[Tensor | None] | None = None
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(partial(self._keep, layer))

    def _keep(self, layer: int, module: nn.Module, args: Any, output: tuple[Tensor, Tensor, Tensor]) -> None:
        if self._captured is not None:
            self._captured[layer] = output[2]

    @contextlib.contextmanager
    def recording(self, on: bool = True) -> Iterator[list[Tensor]]:
        """Record the forward run inside; the yielded list then holds its ``[tokens, layers x top_k]``
        int32 routes (nothing when ``on`` is false or the model has no routers)."""
        if not (on and self.routers):
            yield []
            return
        routes: list[Tensor] = []
        self._captured = [None] * len(self.routers)
        try:
            yield routes
        finally:
            captured, self._captured = self._captured, None
        if all(ids is not None for ids in captured):
            routes.append(torch.cat([ids for ids in captured if ids is not None], dim=-1).to(torch.int32).cpu())


@contextlib.contextmanager
def replayed_routing(model: nn.Module, routes: Tensor | None) -> Iterator[None]:
    """Route the forward runs inside through ``routes``: ``[tokens, layers x top_k]`` expert ids for
    the flattened ``[batch x length]`` input, -1 in the rows of tokens routed as the router decides
    (padding, a sample's last token, samples without routes)."""
    routers = moe_routers(model)
    if routes is None or not routers:
        yield
        return
    per_layer = routes.view(routes.shape[0], len(routers), -1).to(torch.long)
    handles = [
        router.register_forward_hook(partial(_replay, per_layer[:, layer])) for layer, router in enumerate(routers)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _replay(
    recorded: Tensor, router: nn.Module, args: Any, output: tuple[Tensor, Tensor, Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    logits, _, chosen = output
    recorded = recorded.to(chosen.device)
    indices = torch.where(recorded[:, :1] >= 0, recorded, chosen)
    if getattr(router, "norm_topk_prob", False):
        # The softmax over all experts renormalised over the chosen ones, taken over the chosen logits
        # directly: a router that moved far may give them probabilities that underflow to 0.
        weights = torch.softmax(logits.gather(-1, indices), dim=-1, dtype=torch.float32)
    else:
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, indices)
    return logits, weights.to(logits.dtype), indices
