"""A user's corrected answer becomes a supervised sample: the same prompt, the correction as the
assistant's turn, trained by likelihood (the SFT term, ``loss.sft_coef``) next to the rated answers'
policy gradient.

An SFT term rather than the preferred side of a pair: a correction was never sampled from the
policy, so it has no behaviour log-probs for a ratio, and its worth does not depend on the rest of
its group; the model should simply make it more likely. Only the assistant's tokens are trained,
through its end-of-turn token (the model also learns where to stop), not the template's text after it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from learner.sample import Sample, SampleStatus

__all__ = ["assistant_tokens", "corrected_samples", "corrections_of", "turn_tokenizer"]

log = logging.getLogger("tandem.learner")


def corrections_of(samples: Sequence[Sample], model_dir: Path) -> list[Sample]:
    """``corrected_samples`` with the tokenizer and stop tokens of ``model_dir`` (loaded only when there
    is a correction)."""
    if not any(_correction(s) for s in samples):
        return []
    tokenizer, stops = turn_tokenizer(model_dir)
    return corrected_samples(samples, tokenizer, stop_ids=stops)


def turn_tokenizer(model_dir: Path) -> tuple[Any, set[int]]:
    """The tokenizer of ``model_dir`` and the tokens that end a turn (its generation config's)."""
    from transformers import AutoTokenizer, GenerationConfig  # heavy: only for rounds that need it

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's end of sequence
        eos = None
    return tokenizer, {eos} if isinstance(eos, int) else set(eos or [])


def corrected_samples(samples: Sequence[Sample], tokenizer: Any, *, stop_ids: Collection[int] = ()) -> list[Sample]:
    """One supervised sample per rated answer that carries a corrected answer (``learner.collect``
    keeps it in ``metadata["feedback"]``), with the rated answer's prompt, user and session.
    ``stop_ids``: the tokens that end a turn (the generation config's); the tokenizer's EOS by default.
    A correction that cannot be rendered is skipped with a warning, not the round."""
    stops = set(stop_ids) or {tokenizer.eos_token_id} - {None}
    corrected = []
    for sample in samples:
        text = _correction(sample)
        if not text:
            continue
        try:
            response = assistant_tokens(sample, text, tokenizer, stops)
        except Exception as exc:  # a template or tokenizer error of this one text (jinja2, ValueError, ...)
            log.warning(
                "corrected answer skipped: it cannot be tokenized",
                extra={"completion_id": sample.completion_id, "error": f"{type(exc).__name__}: {exc}"},
            )
            continue
        corrected.append(
            Sample(
                prompt_token_ids=list(sample.prompt_token_ids),
                response_token_ids=response,
                group_index=None,  # a group of its own: no group statistics
                prompt=sample.prompt,
                response=text,
                reward=0.0,  # unused: a supervised sample takes no advantage
                supervised=True,
                status=SampleStatus.COMPLETED,
                user_id=sample.user_id,
                session_id=sample.session_id,
                metadata={
                    "source": "corrected_answer",
                    "tenant_id": sample.metadata.get("tenant_id"),
                    "corrected_completion_id": sample.completion_id,
                },
            )
        )
    return corrected


def _correction(sample: Sample) -> str:
    feedback = sample.metadata.get("feedback") or {}
    return str(feedback.get("corrected_answer") or "").strip()


def assistant_tokens(sample: Sample, text: str, tokenizer: Any, stops: set[int]) -> list[int]:
    """``text`` as the assistant's turn after ``sample``'s prompt, through the end-of-turn token."""
    prompt = sample.prompt_token_ids
    if isinstance(sample.prompt, list):
        rendered = tokenizer.apply_chat_template(
            [*sample.prompt, {"role": "assistant", "content": text}], tokenize=True, return_dict=False
        )
        if list(rendered[: len(prompt)]) == list(prompt):  # the served prompt, as the template renders it
            turn = list(rendered[len(prompt) :])
            end = next((i for i, token in enumerate(turn) if token in stops), None)
            return turn if end is None else turn[: end + 1]
    # A prompt the template does not reproduce: the text's own tokens, then end of turn.
    end_of_turn = tokenizer.eos_token_id if tokenizer.eos_token_id in stops else min(stops, default=None)
    return [*tokenizer.encode(text, add_special_tokens=False), *([] if end_of_turn is None else [end_of_turn])]
