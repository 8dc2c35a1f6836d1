"""Measuring one model for the capability guard, where it is loaded (the evaluation child).

``measure`` gives, for one model:

- ``reference_loglik``: the mean log-probability per token of the capability set's reference answers,
  teacher forced (a model that forgot how to answer plain questions loses likelihood on them);
- the degeneration statistics (``learner.evaluation.degeneration``) of its answers to the capability
  prompts and to a few held-out user prompts, sampled at temperature 1 with the same seed for every
  model compared (sampled, not greedy: greedy answers of a model full of near-ties flip at the
  smallest change, while a collapsed policy loops and echoes even when sampled);
- those answers with their log-probs, for ``kl_to_root``: the lineage root scores the candidate's
  answers, and the mean per-token k3 estimate ``exp(r) - 1 - r``, ``r = log p_root - log p_candidate``,
  estimates KL(candidate || root) (unbiased and never negative: the answers come from the candidate).

Generation is one left-padded batch, so a model's measurement costs about one answer's time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from learner.evaluation.degeneration import answer_stats
from learner.evaluation.guard import GuardConfig
from learner.evaluation.scoring import stop_ids, tokenized
from learner.sample import Sample
from learner.trainers.torch_backend import response_log_probs

__all__ = ["kl_to_root", "measure"]

MAX_TOKENS_PER_MICRO_BATCH = 4096
EXAMPLES = 4  # answers kept on the record, for a person reading why a version was held back


@torch.no_grad()
def measure(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    capability: Sequence[Sample],
    user_prompts: Sequence[Sample],
    config: GuardConfig,
) -> tuple[dict[str, Any], list[Sample]]:
    """``(measurements, samples for kl_to_root)``; ``capability`` samples carry their reference answers."""
    model.eval()
    references = [tokenized(s, tokenizer) for s in capability]
    log_probs = response_log_probs(model, references, MAX_TOKENS_PER_MICRO_BATCH)
    tokens = sum(len(lp) for lp in log_probs)
    reference_loglik = float(sum(float(lp.sum()) for lp in log_probs) / max(tokens, 1))

    asked = _distinct_prompts([*references, *[tokenized(s, tokenizer) for s in user_prompts][: config.user_prompts]])
    sampled = _sample(model, tokenizer, asked, config.max_tokens, seed=config.seed)
    texts = [str(tokenizer.decode(ids, skip_special_tokens=True)) for ids in sampled]
    questions = [_question(s) for s in asked]
    stats = answer_stats(questions, texts, sampled)
    kl_samples = [  # a held-out prompt comes with its rated answer's log-probs, mask and temperature: not these
        replace(
            p,
            response_token_ids=ids,
            response="",
            rollout_log_probs=None,
            rollout_temperature=1.0,  # _sample draws at 1
            loss_mask=None,
            reward=None,
        )
        for p, ids in zip(asked, sampled, strict=True)
    ]
    kl_samples = [s for s in kl_samples if s.response_token_ids]
    own = response_log_probs(model, kl_samples, MAX_TOKENS_PER_MICRO_BATCH)
    kl_samples = [replace(s, rollout_log_probs=lp.tolist()) for s, lp in zip(kl_samples, own, strict=True)]
    examples = [{"question": q, "answer": a} for q, a in zip(questions, texts, strict=True)][:EXAMPLES]
    return {"reference_loglik": reference_loglik, **stats, "examples": examples}, kl_samples


@torch.no_grad()
def kl_to_root(root: PreTrainedModel, samples: Sequence[Sample]) -> float:
    """Mean per-token k3 estimate of KL(candidate || root) on the candidate's own samples (0.0 for none)."""
    if not samples:
        return 0.0
    root.eval()
    estimates = []
    for sample, root_lp in zip(samples, response_log_probs(root, samples, MAX_TOKENS_PER_MICRO_BATCH), strict=True):
        assert sample.rollout_log_probs is not None  # measure() set them
        for own, theirs in zip(sample.rollout_log_probs, root_lp.tolist(), strict=True):
            r = min(theirs - own, 50.0)  # a token the root finds e^50 times likelier: the estimate is huge anyway
            estimates.append(math.exp(r) - 1 - r)
    return statistics.fmean(estimates)


def _distinct_prompts(samples: Sequence[Sample]) -> list[Sample]:
    by_prompt: dict[tuple[int, ...], Sample] = {}
    for sample in samples:
        by_prompt.setdefault(tuple(sample.prompt_token_ids), sample)
    return list(by_prompt.values())


def _question(sample: Sample) -> str:
    """The last user message (the text an echo would repeat)."""
    if isinstance(sample.prompt, str):
        return sample.prompt
    users = [m.get("content") for m in sample.prompt if m.get("role") == "user"]
    return str(users[-1]) if users and isinstance(users[-1], str) else ""


def _sample(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Sample], max_tokens: int, *, seed: int
) -> list[list[int]]:
    """Every prompt's answer ids sampled at temperature 1 (up to and including the stop token), in one
    left-padded batch; the same ``seed`` for every model compared, so near-equal models draw near-equal answers."""
    stops = stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops, default=0)
    width = max(len(p.prompt_token_ids) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(p.prompt_token_ids)) + p.prompt_token_ids for p in prompts], device=device)
    mask = torch.tensor(
        [[0] * (width - len(p.prompt_token_ids)) + [1] * len(p.prompt_token_ids) for p in prompts], device=device
    )
    torch.manual_seed(seed)
    # mypy reads ``generate`` through nn.Module's __getattr__ (a Tensor); it is GenerationMixin's.
    rows = model.generate(  # type: ignore[operator]
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=max_tokens,
        pad_token_id=pad,
        eos_token_id=sorted(stops) or None,
    )[:, width:].tolist()
    return [row[: next((k + 1 for k, token in enumerate(row) if token in stops), len(row))] for row in rows]
