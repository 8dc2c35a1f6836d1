"""The eval set: a JSONL file of prompts, or the rated answers to a stable share of prompts never trained on.

Holdout: a prompt (its messages, as canonical JSON) is held out when the first 8 bytes of its salted
sha256, read as a fraction of 2**64, fall below ``fraction``. The choice depends on the prompt alone,
so it is the same in every round, process and database: a held-out prompt's answers never train,
however often it is asked and rated, and always evaluate.

JSONL file, one prompt per line::

    {"messages": [{"role": "user", "content": "..."}], "label": "optional", "metadata": {...},
     "answers": [{"content": "a good answer", "reward": 1}, {"content": "a bad one", "reward": -1}]}

``answers`` is what the built-in ``loglik_margin`` method scores (rewards > 0 liked, < 0 disliked);
an eval function needs only the messages (and reads ``label`` / ``metadata`` from the sample).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from learner.sample import Sample

__all__ = ["EvalSetError", "is_held_out", "read_eval_prompts", "split_held_out"]

_SALT = b"tandem-eval-holdout\0"
_LINE_KEYS = frozenset({"messages", "label", "metadata", "answers"})


class EvalSetError(ValueError):
    """An eval prompts file that cannot be used, with the line that is wrong."""


def is_held_out(prompt: str | list[dict[str, Any]], fraction: float) -> bool:
    """Whether ``prompt`` belongs to the held-out share ``fraction`` (0: none)."""
    if fraction <= 0:
        return False
    canonical = json.dumps(prompt, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    digest = hashlib.sha256(_SALT + canonical).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def split_held_out(samples: Sequence[Sample], fraction: float) -> tuple[list[Sample], list[Sample]]:
    """``(to train, held out)``, each in the given order."""
    train: list[Sample] = []
    held: list[Sample] = []
    for sample in samples:
        (held if is_held_out(sample.prompt, fraction) else train).append(sample)
    return train, held


def read_eval_prompts(path: Path, *, needs_answers: bool) -> list[Sample]:
    """The file's prompts as samples: one per rated answer (reward set), or one per prompt without answers.

    Samples of one line share ``group_index`` (the line's index); token ids are left empty, for the
    process holding the model's tokenizer to fill in.

    Raises:
        EvalSetError: unreadable file, no prompts, bad JSON or fields (with the line number), or a
            line without answers when ``needs_answers``.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalSetError(f"eval prompts file {path}: {exc}") from exc
    samples: list[Sample] = []
    group = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            samples += _line_samples(line, group, needs_answers)
        except EvalSetError as exc:
            raise EvalSetError(f"eval prompts file {path}, line {number}: {exc}") from exc
        group += 1
    if not samples:
        raise EvalSetError(f"eval prompts file {path}: no prompts")
    return samples


def _line_samples(line: str, group: int, needs_answers: bool) -> list[Sample]:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EvalSetError(f"not JSON ({exc.msg})") from exc
    if not isinstance(data, dict):
        raise EvalSetError("expected a JSON object")
    unknown = set(data) - _LINE_KEYS
    if unknown:
        raise EvalSetError(f"unknown keys {sorted(unknown)}; known: {sorted(_LINE_KEYS)}")
    messages = data.get("messages")
    if not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise EvalSetError("'messages' must be a non-empty list of {'role': str, 'content': str}")
    label, metadata = data.get("label"), data.get("metadata", {})
    if label is not None and not isinstance(label, str):
        raise EvalSetError("'label' must be a string")
    if not isinstance(metadata, dict):
        raise EvalSetError("'metadata' must be an object")
    answers = data.get("answers", [])
    if not isinstance(answers, list) or not all(_is_answer(a) for a in answers):
        raise EvalSetError("'answers' must be a list of {'content': str, 'reward': finite number}")
    if needs_answers and not answers:
        raise EvalSetError("no 'answers': the built-in loglik_margin method scores rated answers (or set an eval fn)")

    def sample(response: str = "", reward: float | None = None) -> Sample:
        return Sample(
            prompt=messages, response=response, reward=reward, label=label, metadata=dict(metadata), group_index=group
        )

    return [sample(a["content"], float(a["reward"])) for a in answers] or [sample()]


def _is_answer(answer: object) -> bool:
    if not isinstance(answer, dict) or set(answer) != {"content", "reward"}:
        return False
    reward = answer["reward"]
    return (
        isinstance(answer["content"], str)
        and isinstance(reward, int | float)
        and not isinstance(reward, bool)
        and math.isfinite(reward)
    )
