"""``slime.rollout.sglang_rollout``: ``GenerateState`` and the default ``generate``, as plugins use them.

``GenerateState(args)`` holds the tokenizer of ``args.hf_checkpoint``, the default sampling
parameters under SGLang's names and a semaphore of ``args.sglang_server_concurrency``; like slime's
it is one object for one ``args`` (a new round's ``args`` gets a new one). ``generate`` is slime's
default generate function: one SGLang ``/generate`` call through the router, appended to the sample.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from learner.sample import Sample
from slime.utils.http_utils import post
from tandem.moe_routing import routes_from_base64

__all__ = ["GenerateState", "generate"]


@functools.cache
def _tokenizer(checkpoint: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(checkpoint)


class GenerateState:
    _current: GenerateState | None = None

    def __new__(cls, args: Any) -> GenerateState:
        current = cls._current
        if current is None or current.args is not args:
            current = super().__new__(cls)
            current._setup(args)
            cls._current = current
        return current

    def __init__(self, args: Any) -> None:
        """Set up once per ``args`` in ``__new__``: slime's is a singleton."""

    def _setup(self, args: Any) -> None:
        if not args.hf_checkpoint:
            raise ValueError(
                "GenerateState needs args.hf_checkpoint: the learner could not read the serving checkpoint"
            )
        self.args = args
        self.tokenizer = _tokenizer(str(args.hf_checkpoint))
        self.processor = None  # text-only models
        self.sampling_params: dict[str, Any] = {
            "temperature": args.rollout_temperature,
            "top_p": args.rollout_top_p,
            "top_k": args.rollout_top_k,
            "max_new_tokens": args.rollout_max_response_len,
            "stop": args.rollout_stop,
            "stop_token_ids": args.rollout_stop_token_ids,
            "skip_special_tokens": args.rollout_skip_special_tokens,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        }
        self._semaphores: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        self.reset()

    @property
    def semaphore(self) -> asyncio.Semaphore:
        """Bounds generate calls in flight, per event loop (each of a round's rollouts runs its own)."""
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.args.sglang_server_concurrency)
        return self._semaphores[loop]

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task[Any]] = set()
        self.aborted = False


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """slime's default generate: continue ``sample`` by one SGLang ``/generate`` call."""
    state = GenerateState(args)
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(f"sample status is {sample.status}: only pending or aborted samples generate")
    prompt_ids = sample.tokens or state.tokenizer.encode(sample.prompt, add_special_tokens=False)
    sampling_params["max_new_tokens"] -= sample.response_length
    if sampling_params["max_new_tokens"] <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    payload = {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True}
    if getattr(args, "use_rollout_routing_replay", False):
        payload["return_routed_experts"] = True
    headers = {"X-SMG-Routing-Key": sample.session_id} if sample.session_id else None
    output = await post(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate", payload, headers=headers)
    if not sample.tokens:
        sample.tokens = list(prompt_ids)
    items = output["meta_info"]["output_token_logprobs"]
    sample.append_response_tokens(
        args,
        tokens=[item[1] for item in items],
        log_probs=[item[0] for item in items],
        meta_info=output["meta_info"],
        text=output["text"],
    )
    if output["meta_info"].get("routed_experts"):
        # A row of layers x top_k expert ids per token but the last, replayed in training (R3).
        routes = output["meta_info"]["routed_experts"]
        sample.rollout_routed_experts = routes_from_base64(routes, len(sample.tokens))
    return sample
