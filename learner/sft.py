"""Supervised fine-tuning rounds (``tandem sft``, ``RoundConfig(mode="sft")``): what they train on.

Either an OpenAI-format JSONL file (``{"messages": [...]}`` per line): every assistant turn becomes a
supervised sample, the conversation before it as the prompt, the turn's tokens (through its
end-of-turn token, as ``learner.corrections`` renders a corrected answer) trained by likelihood; the
prompt, user turns and tool results are never trained. Or the log: the answers rated up (or scored
above 0), as the policy generated them, filtered by the round's tenant, user and age.

An SFT round then goes the way of an RL round: the same training child (the SFT term,
``loss.sft_coef``), export, the evaluation gate, and the hot swap. It does not move the feedback
watermark: RL rounds still learn from the same ratings.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from learner.corrections import assistant_tokens
from learner.sample import Sample, SampleStatus


class SftDataError(ValueError):
    """A line of the file that is not a conversation (the message names the line)."""


def conversation_samples(path: Path, tokenizer: Any, stops: set[int]) -> list[Sample]:
    """One supervised sample per assistant turn with text, in file order."""
    samples = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        messages = _messages(line, f"{path}:{number}")
        for turn, message in enumerate(messages):
            text = message.get("content")
            if message.get("role") != "assistant" or not isinstance(text, str) or not text.strip() or turn == 0:
                continue
            prompt = messages[:turn]
            prompt_ids: list[int] = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
            head = Sample(prompt_token_ids=prompt_ids, prompt=prompt)
            samples.append(
                Sample(
                    prompt_token_ids=prompt_ids,
                    response_token_ids=assistant_tokens(head, text, tokenizer, stops),
                    prompt=prompt,
                    response=text,
                    reward=0.0,  # unused: a supervised sample takes no advantage
                    supervised=True,
                    status=SampleStatus.COMPLETED,
                    metadata={"source": "sft_file", "line": number, "turn": turn},
                )
            )
    return samples


def rated_up(samples: Iterable[Sample]) -> list[Sample]:
    """Supervised copies of the rated answers that were liked (score above 0), tokens as generated."""
    liked = []
    for sample in samples:
        feedback = sample.metadata.get("feedback") or {}
        if float(feedback.get("score") or 0) > 0 and sample.response_length > 0:
            copy = Sample.from_dict(sample.to_dict())
            copy.supervised, copy.reward, copy.group_index = True, 0.0, None
            copy.metadata = {**copy.metadata, "source": "sft_log"}
            liked.append(copy)
    return liked


def _messages(line: str, where: str) -> list[dict[str, Any]]:
    try:
        item = json.loads(line)
    except ValueError as exc:
        raise SftDataError(f"{where}: not JSON: {exc}") from None
    messages = item.get("messages") if isinstance(item, dict) else None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise SftDataError(f'{where}: give "messages", a list of chat messages with a "role"')
    return messages
