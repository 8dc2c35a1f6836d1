"""A whole rollout function, in the style of slime's ``generate_rollout``: it takes its groups from
``data_source.get_samples``, generates with slime's default ``generate`` on slime's background loop,
and is also the eval function (``evaluation=True``), as ``--eval-function-path`` defaults to it."""

import asyncio

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.sglang_rollout import GenerateState, generate
from slime.utils.async_utils import run

CALLS = []


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    CALLS.append((rollout_id, evaluation))
    state = GenerateState(args)
    groups = data_source.get_samples(args.rollout_batch_size)

    async def generate_all():
        async with state.semaphore:
            await asyncio.gather(*(generate(args, s, dict(state.sampling_params)) for g in groups for s in g))

    run(generate_all())
    if evaluation:
        samples = [s for g in groups for s in g]
        rewards = [float(len(set(s.tokens[-s.response_length :]))) for s in samples]
        truncated = [s.status == s.Status.TRUNCATED for s in samples]
        return RolloutFnEvalOutput(data={"probe": {"rewards": rewards, "truncated": truncated, "samples": samples}})
    return RolloutFnTrainOutput(samples=groups, metrics={"rollout/groups": len(groups)})


async def reward_func(args, sample, **kwargs):
    return float(len(set(sample.tokens[-sample.response_length :]))) if sample.response_length else 0.0
