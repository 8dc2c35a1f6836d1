"""Rollout plugins for tests/learner/test_rollout.py, loaded by dotted path."""

from __future__ import annotations

from typing import Any

from learner.sample import Sample
from learner.slime_args import SlimeArgs


async def greedy_through_the_gateway(args: SlimeArgs, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One greedy sample per call, through the client the rollout hands over."""
    assert args.client is not None
    body = {
        "input_ids": sample.prompt_token_ids,
        "n": 1,
        "max_tokens": sampling_params["max_new_tokens"],
        "temperature": 0,
    }
    choice = (await args.client.post("/admin/rollouts", json=body)).json()["choices"][0]
    sample.response_token_ids = choice["output_ids"]
    sample.rollout_log_probs = choice["logprobs"]
    sample.status = Sample.Status.COMPLETED
    sample.metadata["generated_by"] = "plugin"
    return sample


async def two_canned(args: SlimeArgs, sample: Sample, sampling_params: dict[str, Any]) -> list[Sample]:
    return [
        Sample(prompt_token_ids=sample.prompt_token_ids, response_token_ids=[7], status=Sample.Status.COMPLETED),
        Sample(prompt_token_ids=sample.prompt_token_ids, response_token_ids=[8, 9], status=Sample.Status.TRUNCATED),
    ]


async def not_a_sample(args: SlimeArgs, sample: Sample, sampling_params: dict[str, Any]) -> str:
    return "oops"


def echo_rollout(
    args: SlimeArgs, rollout_id: int, data_source: list[Sample], evaluation: bool = False
) -> list[list[Sample]]:
    return [[Sample(prompt_token_ids=p.prompt_token_ids, response_token_ids=[rollout_id])] for p in data_source]
