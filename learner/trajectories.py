"""Agentic data generation: run a generate function (a tool rollout, a workflow, any slime generate
function) over a prompt set and write each resulting sample as a trajectory line.

A prompt line is ``{"messages": [...], "label": ...}`` (or ``{"prompt": "text"}``); a trajectory line
holds the conversation in OpenAI's message format (``messages``: the prompt and what the rollout
added, tool calls and results included), and for training the prompt and response token ids, the
loss mask, the behaviour log-probs, the reward and the status.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from learner.plugins import HookKind, load_plugin
from learner.sample import Sample
from learner.sglang_router import sglang_router
from learner.slime_args import slime_args


class PromptFileError(ValueError):
    """A prompt line that is not a JSON object with messages or a prompt (the message names the line)."""


def read_prompts(path: Path) -> list[Sample]:
    """The prompt samples of a JSONL file, in file order."""
    samples: list[Sample] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise PromptFileError(f"{path}:{number}: not JSON: {exc}") from None
        messages = item.get("messages") if isinstance(item, dict) else None
        if messages is None and isinstance(item, dict) and isinstance(item.get("prompt"), str):
            messages = [{"role": "user", "content": item["prompt"]}]
        if not isinstance(messages, list) or not messages:
            raise PromptFileError(f'{path}:{number}: give "messages" (a non-empty list) or "prompt" (a string)')
        label = item.get("label")
        samples.append(
            Sample(
                prompt_token_ids=[0],  # the generate function renders the messages itself
                prompt=messages,
                label=None if label is None else str(label),
                index=len(samples),
                group_index=len(samples),
                metadata={"messages": messages, "source": "generate"},
            )
        )
    return samples


def trajectory(sample: Sample) -> dict[str, Any]:
    """One output line: the conversation, the tokens with their mask and log-probs, the reward."""
    messages = sample.metadata.get("messages") or []
    if messages and messages[-1].get("role") != "assistant" and sample.response:
        messages = [*messages, {"role": "assistant", "content": sample.response}]
    return {
        "index": sample.index,
        "group_index": sample.group_index,
        "messages": messages,
        "prompt_token_ids": sample.prompt_token_ids,
        "response_token_ids": sample.response_token_ids,
        "loss_mask": sample.resolved_loss_mask(),
        "rollout_log_probs": sample.rollout_log_probs,
        "reward": sample.reward,
        "status": sample.status.value,
        "label": sample.label,
        "metadata": {k: v for k, v in sample.metadata.items() if k != "messages"},
    }


@dataclass(frozen=True)
class GenerateJob:
    server_url: str
    admin_key: str
    checkpoint: str  # the serving checkpoint: its tokenizer renders the prompts
    generate_path: str = "learner.tool_rollout:generate"
    reward_path: str | None = None
    samples_per_prompt: int = 1
    concurrency: int = 4
    sampling: tuple[tuple[str, Any], ...] = (("temperature", 1.0), ("max_new_tokens", 512))


def generate_trajectories(
    job: GenerateJob, prompts: list[Sample], on_done: Callable[[int], None] = lambda n: None
) -> Iterator[dict[str, Any]]:
    """Trajectory lines for every prompt (``samples_per_prompt`` rollouts each), as they finish."""
    generate = load_plugin(job.generate_path, HookKind.CUSTOM_GENERATE)
    reward = load_plugin(job.reward_path, HookKind.REWARD) if job.reward_path else None
    with sglang_router(job.server_url, job.admin_key, timeout=600) as (ip, port):
        args = slime_args(
            hf_checkpoint=job.checkpoint,
            sglang_router_ip=ip,
            sglang_router_port=port,
            n_samples_per_prompt=job.samples_per_prompt,
            server_url=job.server_url,
        )
        sampling = dict(job.sampling)

        async def one(prompt: Sample, seed: int) -> list[Sample]:
            fresh = copy.deepcopy(prompt)
            result = await generate.call(args, fresh, {**sampling, "sampling_seed": seed})
            made = result if isinstance(result, list) else [result]
            if reward is not None:
                for sample in made:
                    if sample.reward is None:
                        sample.reward = await reward.call(args, sample)
            return made

        async def run_all() -> list[dict[str, Any]]:
            bound = asyncio.Semaphore(job.concurrency)

            async def bounded(prompt: Sample, seed: int) -> list[dict[str, Any]]:
                async with bound:
                    lines = [trajectory(s) for s in await one(prompt, seed)]
                on_done(1)
                return lines

            per = job.samples_per_prompt
            jobs = [bounded(p, i * per + k) for i, p in enumerate(prompts) for k in range(per)]
            return [line for lines in await asyncio.gather(*jobs) for line in lines]

        yield from asyncio.run(run_all())
