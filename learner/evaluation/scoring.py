"""One model's score on an eval set, computed where the model is loaded (the eval child, the training child).

``loglik_margin`` (built in, no generation): for every rated answer with a non-zero reward, the mean
log-probability of its tokens given its prompt (teacher forcing); the score is the mean over liked
answers (reward > 0) minus the mean over disliked ones (reward < 0), either term left out when the
set has no answer of that kind. A model that moved towards what users liked and away from what
they disliked scores higher; a change that lowers every answer's likelihood alike cancels out.

With an eval function the model answers every eval prompt (``EvalMethod``'s sampling parameters,
prompt ``i`` seeded with ``seed + i``, so two models compared draw with the same seeds) and the
score is the mean of the function's values over all answers.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import asdict, replace
from types import SimpleNamespace
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from learner.evaluation.config import EvalMethod
from learner.plugins import HookKind, load_plugin
from learner.rewards import score_samples
from learner.sample import Sample, SampleStatus
from learner.trainers.torch_backend import response_log_probs

__all__ = ["score_model", "stop_ids", "tokenized", "unscorable"]


def unscorable(eval_set: Sequence[Sample], method: EvalMethod) -> str | None:
    """Why ``method`` cannot score ``eval_set`` (nothing to score), or None when it can."""
    if not eval_set:
        return "the eval set is empty"
    if not method.generates and not _rated(eval_set):
        return "the eval set has no answer with a non-zero reward"
    return None


@torch.no_grad()
def score_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    eval_set: Sequence[Sample],
    method: EvalMethod,
    *,
    max_tokens_per_micro_batch: int = 4096,
) -> dict[str, float]:
    """``{"score", "n", ...}`` of ``model`` on ``eval_set``; the model is left in eval mode.

    Raises:
        PluginError: the eval function failed or returned something other than a number.
    """
    model.eval()
    samples = [tokenized(s, tokenizer) for s in eval_set]
    if method.fn_path is not None:
        return _generated_score(model, tokenizer, samples, method, method.fn_path)
    return _loglik_margin(model, _rated(samples), max_tokens_per_micro_batch)


def _rated(samples: Sequence[Sample]) -> list[Sample]:
    return [s for s in samples if (s.response_token_ids or s.response) and s.reward is not None and s.reward_value()]


def _loglik_margin(model: PreTrainedModel, rated: list[Sample], max_tokens: int) -> dict[str, float]:
    # The model's own distribution (temperature 1), whatever temperature each rated answer was drawn at.
    at_one = [replace(s, rollout_temperature=1.0) for s in rated]
    means = [float(lp.mean()) for lp in response_log_probs(model, at_one, max_tokens)]
    liked = [m for m, s in zip(means, rated, strict=True) if s.reward_value() > 0]
    disliked = [m for m, s in zip(means, rated, strict=True) if s.reward_value() < 0]
    result = {"n": float(len(rated)), "n_liked": float(len(liked)), "n_disliked": float(len(disliked))}
    if liked:
        result["liked_logprob"] = statistics.fmean(liked)
    if disliked:
        result["disliked_logprob"] = statistics.fmean(disliked)
    result["score"] = result.get("liked_logprob", 0.0) - result.get("disliked_logprob", 0.0)
    return result


def _generated_score(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    samples: list[Sample],
    method: EvalMethod,
    fn_path: str,
) -> dict[str, float]:
    by_prompt: dict[tuple[int, ...], Sample] = {}
    for sample in samples:  # several rated answers to one prompt: it is asked once
        by_prompt.setdefault(tuple(sample.prompt_token_ids), sample)
    prompts = list(by_prompt.values())
    answers = [a for i, prompt in enumerate(prompts) for a in _answers(model, tokenizer, prompt, i, method)]
    plugin = load_plugin(fn_path, HookKind.EVAL)
    args = SimpleNamespace(**asdict(method), reward_key=None)
    scores = asyncio.run(score_samples(plugin, args, answers, only_missing=False))
    values = []
    for answer, value in zip(answers, scores, strict=True):
        if isinstance(value, dict):
            raise plugin.error(f"returned a dict for sample {answer.index}; an eval function returns a number")
        values.append(value)
    return {
        "score": statistics.fmean(values),
        "n": float(len(values)),
        "prompts": float(len(prompts)),
        "response_length_mean": statistics.fmean(a.response_length for a in answers),
    }


def _answers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: Sample, i: int, method: EvalMethod
) -> list[Sample]:
    """``samples_per_prompt`` answers to eval prompt ``i``, drawn with seed ``method.seed + i``."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt.prompt_token_ids], device=device)
    sampled = method.temperature > 0
    stops = stop_ids(model, tokenizer)
    torch.manual_seed(method.seed + i)
    sampling = {"temperature": method.temperature, "top_p": method.top_p} if sampled else {}
    # mypy reads ``generate`` through nn.Module's __getattr__ (a Tensor); it is GenerationMixin's.
    rows = model.generate(  # type: ignore[operator]
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=sampled,
        max_new_tokens=method.max_tokens,
        num_return_sequences=method.samples_per_prompt if sampled else 1,  # greedy answers are all alike
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops, default=0),
        eos_token_id=sorted(stops) or None,
        **sampling,
    )[:, ids.shape[1] :].tolist()
    rows = rows * method.samples_per_prompt if not sampled else rows
    answers = []
    for j, row in enumerate(rows):
        end = next((k + 1 for k, token in enumerate(row) if token in stops), len(row))
        answers.append(
            replace(
                prompt,
                response_token_ids=row[:end],
                response=str(tokenizer.decode(row[:end], skip_special_tokens=True)),
                reward=None,
                rollout_log_probs=None,
                loss_mask=None,
                weight_versions=[],
                index=i * method.samples_per_prompt + j,
                group_index=i,
                status=SampleStatus.COMPLETED if end < len(row) or row[-1] in stops else SampleStatus.TRUNCATED,
                metadata=dict(prompt.metadata),
            )
        )
    return answers


def stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The token ids that end an answer (the generation config's EOS, else the tokenizer's)."""
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def tokenized(sample: Sample, tokenizer: PreTrainedTokenizerBase) -> Sample:
    """The sample with token ids, rendered from its messages and answer text where the file gave none."""
    prompt_ids = sample.prompt_token_ids or _prompt_ids(sample.prompt, tokenizer)
    response_ids = sample.response_token_ids or (
        tokenizer.encode(sample.response, add_special_tokens=False) if sample.response else []
    )
    return replace(sample, prompt_token_ids=list(prompt_ids), response_token_ids=list(response_ids))


def _prompt_ids(prompt: str | list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)
