"""A multi-turn generate with a tool, in the style of slime's search-r1 and retool examples, and a
retool-style reward that returns a dict (``--reward-key score``)."""

from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

TOOL_RESULT = "\n<result>42</result>\n"


async def generate(args, sample: Sample, sampling_params) -> Sample:
    assert not args.partial_rollout, "partial rollout is not supported"
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_tokens_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    sample.tokens = list(prompt_tokens_ids)
    text = sample.prompt
    for turn in range(2):
        payload = {
            "text": text,
            "sampling_params": {**sampling_params, "max_new_tokens": 6},
            "return_logprob": True,
        }
        output = await post(url, payload)
        if output["meta_info"]["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        items = output["meta_info"]["output_token_logprobs"]
        sample.append_response_tokens(
            args,
            tokens=[item[1] for item in items],
            log_probs=[item[0] for item in items],
            trainable=True,
            meta_info=output["meta_info"],
            text=output["text"],
        )
        text += output["text"]
        if turn == 0:  # the "tool" answers; its tokens are context, not the policy's
            obs_ids = state.tokenizer(TOOL_RESULT, add_special_tokens=False)["input_ids"]
            sample.append_response_tokens(args, tokens=obs_ids, trainable=False, text=TOOL_RESULT)
            text += TOOL_RESULT
            sample.tool_call_count = 1
    return sample


async def reward_func(args, sample, **kwargs):
    # A score that varies between samples of a group, so the groups are kept.
    distinct = len(set(sample.response.split())) / max(len(sample.response.split()), 1)
    return {"score": distinct + 0.1 * getattr(sample, "tool_call_count", 0), "pred": sample.response[-20:]}
