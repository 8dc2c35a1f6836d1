"""A multi-agent generate in the style of slime's multi_agent example: a solver answers, a critic
answers the solver, both trained; one rollout (one ``rollout_id``) shared by the two samples. Scored
by a group reward model (``--group-rm``) that ranks a group's samples."""

import copy
import itertools

from slime.utils.http_utils import post

_ROLLOUTS = itertools.count()


async def _agent(args, sample, prompt_ids, sampling_params):
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    payload = {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True}
    output = await post(url, payload)
    items = output["meta_info"]["output_token_logprobs"]
    sample.tokens = list(prompt_ids)
    sample.append_response_tokens(
        args,
        tokens=[item[1] for item in items],
        log_probs=[item[0] for item in items],
        meta_info=output["meta_info"],
        text=output["text"],
    )
    return sample


async def generate_with_multi_agents(args, sample, sampling_params, evaluation=False):
    params = {**sampling_params, "max_new_tokens": min(sampling_params["max_new_tokens"], 6)}
    solver = await _agent(args, copy.deepcopy(sample), list(sample.tokens), params)
    critic = await _agent(args, copy.deepcopy(sample), list(solver.tokens), params)
    rollout_id = next(_ROLLOUTS)
    for agent, role in ((solver, "solver"), (critic, "critic")):
        agent.rollout_id = rollout_id
        agent.metadata["role"] = role
    return [solver, critic]


async def group_rm(args, samples, **kwargs):
    # rank the group's samples by length: a group reward model sees the whole group at once
    order = sorted(range(len(samples)), key=lambda i: (samples[i].response_length, i))
    return [order.index(i) / max(len(samples) - 1, 1) for i in range(len(samples))]
