"""learner.judge: verdict parsing, the rubric prompt, the flow with a rule-based judge, and the live gateway."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

import pytest

from learner.judge import (
    DEFAULT_RUBRIC,
    UNSCORED,
    JudgeArgs,
    JudgeConfig,
    JudgeError,
    VerdictError,
    judge,
    judge_messages,
    judge_samples,
    parse_verdict,
    score_to_reward,
)
from learner.plugins import load_plugin
from learner.rewards import score_samples
from learner.sample import Sample
from tests.server.conftest import ADMIN_KEY, Gateway, gateway, tiny_model

__all__ = ["gateway", "tiny_model"]  # the shared fixtures, visible here


@pytest.mark.parametrize(
    ("verdict", "score"),
    [
        ("The answer is right and short.\nScore: 9", 9),
        ("**Score:** 8", 8),
        ("Score = 7/10", 7),
        ("Overall the score is 6.", 6),
        ("I'd give it a score of 8 out of 10.", 8),
        ("Final score: 6.5", 6.5),
        ("Rating: [[7]]", 7),
        ("[[3]]", 3),
        ("Helpful but verbose: 7/10", 7),
        ("Score (1-10): 4", 4),
        ("Score:\n5", 5),
        ("**Score** - 2", 2),
        ("Score: 10/10", 10),
        ("SCORE: 1", 1),
        ("Grade: 6/10.", 6),
        ("Score: 3\n\nOn reflection the answer holds up.\nScore: 8", 8),  # the conclusion counts
        ("<think>Maybe Score: 2? No.</think>It is fine. Score: 7", 7),  # reasoning is not the verdict
    ],
)
def test_reads_scores_in_the_forms_judges_write(verdict: str, score: float) -> None:
    assert parse_verdict(verdict) == score


@pytest.mark.parametrize(
    ("verdict", "problem"),
    [
        ("Score: 11", "outside 1..10"),
        ("Score: 0", "outside 1..10"),
        ("Score: -3", "outside 1..10"),
        ("Score: 100", "outside 1..10"),
        ("Rating: 4 out of 5", "out of 5, expected out of 10"),
        ("Score: 4/5", "out of 5, expected out of 10"),
        ("Score: 7-8", "no score"),  # a range is no verdict
        ("Score: 10-12", "no score"),  # nor its first digit
        ("Score: 7 to 8", "no score"),
        ("Score: seven", "no score"),
        ("I cannot grade this.", "no score"),
        ("", "no score"),
        ("<think>Score: 9, and then it ran out of tokens", "no score"),
        ("ka lo mi ne su ta ri ven dor qua", "no score"),
    ],
)
def test_refuses_verdicts_without_a_usable_score(verdict: str, problem: str) -> None:
    with pytest.raises(VerdictError, match=re.escape(problem)):
        parse_verdict(verdict)


def test_scores_map_linearly_onto_minus_one_to_one() -> None:
    assert [score_to_reward(s) for s in (1, 5.5, 10)] == [-1.0, 0.0, 1.0]
    assert score_to_reward(4, scale_min=0, scale_max=4) == 1.0
    assert parse_verdict("Score: 4/4", scale_min=0, scale_max=4) == 4
    assert parse_verdict("Score: 0", scale_min=0, scale_max=4) == 0


def test_the_rubric_prompt_carries_question_history_and_answer() -> None:
    config = JudgeConfig()
    single = Sample(prompt="What is 2 + 3?", response="5")
    system, user = judge_messages(single, config)
    assert system == {"role": "system", "content": config.system_prompt}
    assert user["role"] == "user"
    assert "<question>\nWhat is 2 + 3?\n</question>" in user["content"]
    assert "<answer>\n5\n</answer>" in user["content"] and "<history>\n\n</history>" in user["content"]
    turns: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Add 2"}, {"type": "text", "text": "and 3 {please}"}]},
    ]
    (user,) = judge_messages(Sample(prompt=turns, response="{5}"), JudgeConfig(system_prompt=None))
    assert "<history>\nsystem: Be brief.\nuser: Hi\nassistant: Hello!\n</history>" in user["content"]
    assert "<question>\nAdd 2\nand 3 {please}\n</question>" in user["content"]  # braces in text are kept
    assert "<answer>\n{5}\n</answer>" in user["content"]
    custom = JudgeConfig(rubric='Q: {question}\nA: {answer}\nReply {{"score": N}}')
    assert judge_messages(single, custom)[-1]["content"] == 'Q: What is 2 + 3?\nA: 5\nReply {"score": N}'
    with pytest.raises(VerdictError, match="no user message"):
        judge_messages(Sample(prompt=[{"role": "system", "content": "x"}], response="5"), config)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"rubric": "Q: {question}"}, "must contain {question} and {answer}"),
        ({"rubric": "{question} {answer} {user}"}, "unknown placeholders ['user']"),
        ({"rubric": '{question} {answer} {"score": 1}'}, "unknown placeholders"),
        ({"rubric": "{question} {answer} {"}, "not a valid template"),
        ({"scale_min": 5, "scale_max": 5}, "scale_max (5) must exceed scale_min (5)"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"temperature": 3.0}, "temperature"),
    ],
)
def test_a_wrong_config_is_refused_at_once(changes: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        JudgeConfig(**changes)  # type: ignore[arg-type]


@dataclass
class SumsJudge:
    """A deterministic judge for "What is a + b?": 9 for the right sum, 2 for a wrong one, no score for '??'.

    It reads the question and answer back out of the rubric prompt it is sent, as an LLM judge would.
    """

    in_flight: int = 0
    most_in_flight: int = 0
    calls: int = 0

    async def __call__(self, messages: list[dict[str, str]], max_tokens: int, temperature: float) -> str:
        assert (max_tokens, temperature) == (64, 0.0)  # the config's, greedy by default
        self.calls += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.01)  # let the other calls pile up against the bound
        self.in_flight -= 1
        prompt = messages[-1]["content"]
        a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", prompt).groups())  # type: ignore[union-attr]
        answer = prompt.split("<answer>\n", 1)[1].split("\n</answer>", 1)[0]
        if "??" in answer:
            return "I am not sure what to make of this."
        right = answer.strip() == str(a + b)
        return f"The answer is {'correct' if right else 'wrong'}.\nScore: {9 if right else 2}"


def sums_samples() -> list[Sample]:
    return [
        Sample(prompt=[{"role": "user", "content": f"What is {a} + {b}?"}], response=answer, index=i)
        for i, (a, b, answer) in enumerate([(2, 3, "5"), (2, 3, "6"), (10, 4, "14"), (1, 1, "??"), (7, 7, "1")])
    ]


async def test_judges_samples_in_place_and_removes_unreadable_verdicts() -> None:
    judge_model = SumsJudge()
    config = JudgeConfig(max_tokens=64, max_concurrency=2)
    samples = sums_samples()
    no_text = Sample(prompt="What is 1 + 2?", response_token_ids=[5, 6], index=9)
    verdicts = await judge_samples([*samples, no_text], config, judge_model)
    right, wrong = score_to_reward(9), score_to_reward(2)
    assert [v.reward for v in verdicts] == [right, wrong, right, None, wrong, None]
    assert [s.reward for s in samples] == [right, wrong, right, None, wrong]
    assert [s.remove_sample for s in [*samples, no_text]] == [False, False, False, True, False, True]
    assert samples[0].metadata["judge"] == {
        "score": 9.0,
        "reward": right,
        "verdict": "The answer is correct.\nScore: 9",
    }
    assert samples[3].metadata["judge"] == {"error": "no score in the verdict", "verdict": verdicts[3].text}
    assert no_text.metadata["judge"]["error"] == "the sample has response tokens but no response text"
    assert judge_model.calls == 5 and judge_model.most_in_flight == 2  # never asked about no_text; bounded


async def test_judge_reward_is_a_slime_reward_plugin() -> None:
    plugin = load_plugin("learner.judge:judge_reward", "reward")
    args = JudgeArgs("http://unused", "unused", JudgeConfig(max_tokens=64), complete=SumsJudge())
    samples = sums_samples()
    rewards = await score_samples(plugin, args, samples, max_concurrency=3)
    assert rewards == [score_to_reward(9), score_to_reward(2), score_to_reward(9), UNSCORED, score_to_reward(2)]
    assert [s.remove_sample for s in samples] == [False, False, False, True, False]

    @dataclass
    class SlimeArgs:  # slime's namespace carrying the judge's settings
        judge: JudgeArgs

    sample = sums_samples()[0]
    await score_samples(plugin, SlimeArgs(args), [sample])
    assert sample.reward == score_to_reward(9)
    with pytest.raises(TypeError, match="JudgeArgs"):
        await score_samples(plugin, object(), sums_samples())


def test_through_the_gateway_asks_the_serving_model_greedily(gateway: Gateway) -> None:
    # The tiny model's random weights write gibberish, so its verdicts have no score: every sample
    # is removed, with the model's own words kept. Greedy, so /v1 gives the same words for the same messages.
    config = JudgeConfig(rubric="Rate it. Q: {question} A: {answer}", max_tokens=12)
    samples = sums_samples()[:3]
    verdicts = judge(gateway.url, ADMIN_KEY, samples, config)
    client = gateway.client(gateway.keys["acme"])
    for sample, verdict in zip(samples, verdicts, strict=True):
        assert verdict.text and verdict.error == "no score in the verdict"
        assert sample.remove_sample and sample.reward is None and sample.metadata["judge"]["verdict"] == verdict.text
        messages = judge_messages(sample, config)
        reply = client.chat.completions.create(
            model=gateway.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0.0,
        )
        assert reply.choices[0].message.content == verdict.text


def test_a_judge_that_cannot_be_asked_is_an_error_not_a_verdict(gateway: Gateway) -> None:
    samples = sums_samples()[:1]
    with pytest.raises(JudgeError, match="answered 401"):
        judge(gateway.url, "wrong-key", samples, JudgeConfig(max_tokens=4))
    with pytest.raises(JudgeError, match="cannot reach the judge"):
        judge("http://127.0.0.1:9", ADMIN_KEY, samples, JudgeConfig(max_tokens=4, timeout_s=5))
    assert samples[0].reward is None and not samples[0].remove_sample


def test_the_default_rubric_asks_for_the_format_the_parser_reads() -> None:
    assert "Score: N" in DEFAULT_RUBRIC and "from 1 (useless or wrong) to 10 (excellent)" in DEFAULT_RUBRIC
    assert parse_verdict(DEFAULT_RUBRIC.replace("Score: N", "Score: 7")) == 7
