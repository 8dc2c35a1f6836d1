"""A simulated user population with a hidden preference, talking to tandem through its public API only.

Each user asks questions with the official ``openai`` client (``user`` set, so feedback is theirs),
reads the answer's text, and rates it through ``POST /v1/feedback``: ``up`` when the answer pleases
them more than their own threshold (lenient users rate more things up), else ``down``; some users give
a ``score`` instead. The preference is shared and hidden: only ratings reveal it.

Preferences judge text, as a person would:
- ``LetterPreference``: answers rich in some letters are better (the count of those letters against
  an expected count). A model with random weights has no notion of meaning, so what it can learn is
  which tokens to prefer; a preference carried by ~9 % of the tokens is one it can, from a few
  hundred ratings.
- ``ContrastPreference``: answers rich in some letters and poor in others are better. With two
  letter sets the tiny model writes about equally often (k, v and c, p: 0.95 and 0.96 per 12-token
  answer), a taste and its opposite are equally hard to learn: a model that drifts (more repetitive,
  fewer distinct tokens) moves both groups' scores alike, where a one-sided taste such as
  ``LetterPreference`` favours whoever dislikes the letters.
- ``BrevityPreference``: short, plain sentences are better (1 at a mean of ``target_words`` words per
  sentence or fewer, -1 at twice that). Natural for a real chat model, and visible within the first
  tokens of an answer, so a length cap does not hide it.

``evaluate`` measures what the issue calls the mean reward of fresh answers: the preference's score of
answers to held-out questions, sampled with fixed seeds so two evaluations compare paired answers.
"""

from __future__ import annotations

import random
import re
import statistics
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from openai import OpenAI

from learner.sample import Sample

__all__ = [
    "BrevityPreference",
    "ContrastPreference",
    "LetterPreference",
    "OppositePreference",
    "Population",
    "Preference",
    "RandomPreference",
    "SimulatedUser",
    "brevity_reward",
    "evaluate",
    "letter_reward",
    "questions",
]

_SENTENCE_END = re.compile(r"[.!?:;]+(?:\s|$)|\n+")
_TOPICS = (
    "water", "time", "people", "music", "rivers", "learning", "weather", "cities", "numbers", "words",
    "trees", "light", "history", "sleep", "stars", "bread", "travel", "colour", "memory", "games",
    "ships", "gardens", "money", "mountains", "friends", "rain", "books", "machines", "animals", "art",
)  # fmt: skip
_FORMS = ("Tell me about {}.", "What do you know about {}?", "Explain {} simply.", "Why do {} matter?")


def questions(count: int, seed: int) -> list[str]:
    """``count`` distinct-ish questions, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [rng.choice(_FORMS).format(rng.choice(_TOPICS)) for _ in range(count)]


class Preference(Protocol):
    def score(self, text: str) -> float:
        """How much the answer pleases, in [-1, 1]."""
        ...


@dataclass(frozen=True, slots=True)
class LetterPreference:
    letters: str = "kv"
    expected: float = 1.5  # the count that scores 0

    def score(self, text: str) -> float:
        count = sum(text.lower().count(letter) for letter in self.letters)
        return max(-1.0, min(1.0, (count - self.expected) / self.expected))


@dataclass(frozen=True, slots=True)
class ContrastPreference:
    likes: str = "kv"
    dislikes: str = "cp"
    scale: float = 1.5  # a lead of this many letters scores 1

    def score(self, text: str) -> float:
        lower = text.lower()
        lead = sum(lower.count(x) for x in self.likes) - sum(lower.count(x) for x in self.dislikes)
        return max(-1.0, min(1.0, lead / self.scale))


@dataclass(frozen=True, slots=True)
class OppositePreference:
    """Likes what ``inner`` dislikes: a group whose taste pulls the other way."""

    inner: Preference

    def score(self, text: str) -> float:
        return -self.inner.score(text)


@dataclass(frozen=True, slots=True)
class RandomPreference:
    """No taste at all: a score drawn at random whatever the text (users who rate at random)."""

    seed: int = 0

    def score(self, text: str) -> float:
        return random.Random(f"{self.seed}:{text}").uniform(-1.0, 1.0)


@dataclass(frozen=True, slots=True)
class BrevityPreference:
    target_words: float = 8.0  # mean sentence length that scores 1; twice as long scores -1

    def score(self, text: str) -> float:
        sentences = [len(part.split()) for part in _SENTENCE_END.split(text) if part.split()]
        if not sentences:
            return -1.0
        excess = (statistics.fmean(sentences) - self.target_words) / self.target_words
        return max(-1.0, min(1.0, 1.0 - 2.0 * excess))


@dataclass(frozen=True, slots=True)
class SimulatedUser:
    name: str
    threshold: float  # rates "up" above it
    gives_scores: bool  # a score in [-1, 1] instead of up/down


@dataclass(frozen=True, slots=True)
class Population:
    """Users sharing one hidden preference, differing in leniency and in how they rate."""

    preference: Preference
    users: tuple[SimulatedUser, ...]

    @classmethod
    def make(cls, preference: Preference, size: int, seed: int, spread: float = 0.3, prefix: str = "sim") -> Population:
        rng = random.Random(seed)
        users = tuple(
            SimulatedUser(f"{prefix}-{seed}-{i}", threshold=rng.uniform(-spread, spread), gives_scores=i % 4 == 3)
            for i in range(size)
        )
        return cls(preference, users)

    def chat_and_rate(
        self, client: OpenAI, model: str, count: int, *, seed: int, max_tokens: int, workers: int = 4
    ) -> list[float]:
        """``count`` chats spread over the users, each rated; returns the hidden scores of the answers.

        Reading one answer back at the end flushes the gateway's conversation log, so the ratings
        are in the database when this returns.
        """
        rng = random.Random(seed)
        jobs = [
            (self.users[i % len(self.users)], q, rng.randrange(2**31)) for i, q in enumerate(questions(count, seed))
        ]

        def one(job: tuple[SimulatedUser, str, int]) -> tuple[str, float]:
            user, question, answer_seed = job
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": question}],
                max_tokens=max_tokens,
                seed=answer_seed,
                user=user.name,
            )
            score = self.preference.score(reply.choices[0].message.content or "")
            verdict = {"score": round(score, 4)} if user.gives_scores else {"rating": _rating(score, user.threshold)}
            client.post("/feedback", body={"completion_id": reply.id, **verdict}, cast_to=object)
            return reply.id, score

        with ThreadPoolExecutor(workers) as pool:
            rated = list(pool.map(one, jobs))
        client.get(f"/completions/{rated[-1][0]}", cast_to=object)
        return [score for _, score in rated]


def _rating(score: float, threshold: float) -> str:
    return "up" if score > threshold else "down"


def evaluate(
    client: OpenAI,
    model: str,
    preference: Preference,
    prompts: Sequence[str],
    *,
    samples_per_prompt: int,
    max_tokens: int,
    workers: int = 4,
    user: str = "evaluator",
) -> float:
    """Mean hidden score of fresh answers (seeded sampling: the same seeds give paired answers)."""
    jobs = [(p, s) for p in prompts for s in range(samples_per_prompt)]

    def one(job: tuple[str, int]) -> float:
        prompt, seed = job
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            seed=seed,
            user=user,  # a user of a group is served that group's adapter
        )
        return preference.score(reply.choices[0].message.content or "")

    with ThreadPoolExecutor(workers) as pool:
        return statistics.fmean(pool.map(one, jobs))


async def letter_reward(args: object, sample: Sample) -> float:
    """``LetterPreference``'s score as a slime reward plugin: a reward function that knows the preference."""
    return LetterPreference().score(sample.response or "")


async def brevity_reward(args: object, sample: Sample) -> float:
    """``BrevityPreference``'s score as a slime reward plugin."""
    return BrevityPreference().score(sample.response or "")
