"""On-policy distillation as slime's ``--opd-type sglang`` feeds it: a teacher scores each rollout's
tokens into ``sample.teacher_log_probs`` (here the serving checkpoint, loaded with transformers,
standing in for a bigger model) while the reward stays the task's."""

import functools

import torch
from transformers import AutoModelForCausalLM


@functools.cache
def _teacher(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


async def reward_with_teacher(args, sample, **kwargs):
    n = sample.response_length
    ids = torch.tensor([sample.tokens])
    with torch.no_grad():
        logits = _teacher(args.hf_checkpoint)(ids).logits[0, -n - 1 : -1].float() / args.rollout_temperature
    sample.teacher_log_probs = torch.log_softmax(logits, -1).gather(-1, ids[0, -n:, None]).squeeze(-1).tolist()
    return float(len(set(sample.tokens[-n:])))
