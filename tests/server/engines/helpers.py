"""Reference outputs from plain transformers, to check engines against."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from server.engines.base import Engine, Finish, SamplingParams


@cache
def reference_model(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def greedy_reference(path: Path, prompt: list[int], new_tokens: int) -> list[int]:
    out = reference_model(path).generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def reference_logprobs(path: Path, prompt: list[int], output: list[int]) -> list[float]:
    logits = reference_model(path)(torch.tensor([prompt + output])).logits[0].log_softmax(-1)
    return [logits[len(prompt) - 1 + i, token].item() for i, token in enumerate(output)]


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    cached_tokens: int = 0
    finish: Finish | None = None


async def collect(engine: Engine, prompt: list[int], sampling: SamplingParams, **kwargs: object) -> Collected:
    result = Collected()
    async for chunk in engine.generate(prompt, sampling, **kwargs):  # type: ignore[arg-type]
        result.token_ids += chunk.token_ids
        result.logprobs += chunk.logprobs
        result.versions += [chunk.weight_version] * len(chunk.token_ids)
        result.cached_tokens = chunk.cached_tokens
        result.finish = chunk.finish
    return result


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
