"""Signs that a model stopped being useful, read from its answers' text and tokens alone.

Four ways an RL-trained policy collapses when it hacks a narrow reward, each a share or a mean over a
set of answers (``answer_stats``): answers that are empty; answers that only repeat the question
("People." to "Tell me about people."); answers stuck in a loop (a 4-gram three times or more); and
a poorer vocabulary (distinct-2: unique token bigrams over all bigrams of an answer). The mean
length is kept too, for the ratio to another version's answers.
"""

from __future__ import annotations

import itertools
import re
import statistics
from collections import Counter
from collections.abc import Sequence

__all__ = ["answer_stats", "distinct_2", "is_echo", "is_loop"]

_WORD = re.compile(r"\w+")
LOOP_NGRAM = 4
LOOP_TIMES = 3


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _contains(haystack: Sequence[str], needle: Sequence[str]) -> bool:
    width = len(needle)
    return any(list(haystack[i : i + width]) == list(needle) for i in range(len(haystack) - width + 1))


def is_echo(question: str, answer: str) -> bool:
    """The answer adds nothing to the question: its words are a run of the question's words, or it
    opens by repeating the whole question. Empty answers are not echoes (they count as empty)."""
    asked, said = _words(question), _words(answer)
    if not said or not asked:
        return False
    return _contains(asked, said) or said[: len(asked)] == asked


def is_loop(tokens: Sequence[int]) -> bool:
    """Some ``LOOP_NGRAM``-gram occurs ``LOOP_TIMES`` times or more."""
    grams = Counter(tuple(tokens[i : i + LOOP_NGRAM]) for i in range(len(tokens) - LOOP_NGRAM + 1))
    return bool(grams) and max(grams.values()) >= LOOP_TIMES


def distinct_2(tokens: Sequence[int]) -> float:
    """Unique bigrams over all bigrams (1.0 for an answer too short to have two)."""
    bigrams = list(itertools.pairwise(tokens))
    return len(set(bigrams)) / len(bigrams) if bigrams else 1.0


def answer_stats(questions: Sequence[str], answers: Sequence[str], tokens: Sequence[Sequence[int]]) -> dict[str, float]:
    """Shares and means over ``answers`` (``answers[i]`` replies to ``questions[i]``; ``tokens[i]`` are its ids)."""
    if not answers:
        raise ValueError("answer_stats needs at least one answer")
    filled = [i for i, answer in enumerate(answers) if answer.strip()]
    return {
        "answers": float(len(answers)),
        "length_mean": statistics.fmean(len(t) for t in tokens),
        "empty_rate": 1 - len(filled) / len(answers),
        "echo_rate": sum(is_echo(questions[i], answers[i]) for i in filled) / len(answers),
        "loop_rate": sum(is_loop(t) for t in tokens) / len(answers),
        "distinct_2": statistics.fmean(distinct_2(tokens[i]) for i in filled) if filled else 0.0,
    }
