"""Scoring a model on an eval set (the tiny model, in this process) and in the evaluation child."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from learner.evaluation import EvalFailed, EvalMethod, run_eval_child
from learner.evaluation.scoring import score_model, unscorable
from learner.plugins import PluginError
from learner.sample import Sample
from learner.trainers import response_log_probs
from tests.fixtures.tiny_model import perturb_weights, tiny_model_path
from tests.learner.trainers.conftest import load_tiny, one_thread  # noqa: F401  (one_thread: autouse fixture)

FNS = "tests.learner.evaluation.eval_fns"


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return load_tiny(tiny_model_path())


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_path())


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def rated(text: str, answer: str, reward: float, group: int) -> Sample:
    return Sample(prompt=user(text), response=answer, reward=reward, group_index=group)


EVAL_SET = [
    rated("2 + 2?", "four", 1.0, 0),
    rated("2 + 2?", "five", -1.0, 0),
    rated("Say hi.", "hello there", 0.5, 1),
    rated("Say hi.", "no", 0.0, 1),  # neither liked nor disliked: not scored
    Sample(prompt=user("Name a colour."), group_index=2),  # no answer: only an eval function uses it
]


def test_loglik_margin_is_liked_minus_disliked_mean_token_log_prob(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    scores = score_model(model, tokenizer, EVAL_SET, EvalMethod())
    # By hand: the chat template's prompt ids, the answer's ids, mean log-prob of the answer tokens.
    questions = ["2 + 2?", "2 + 2?", "Say hi."]
    by_hand = [
        Sample(
            prompt_token_ids=tokenizer.encode(
                str(tokenizer.apply_chat_template(user(question), add_generation_prompt=True, tokenize=False)),
                add_special_tokens=False,
            ),
            response_token_ids=tokenizer.encode(s.response, add_special_tokens=False),
        )
        for question, s in zip(questions, EVAL_SET, strict=False)
    ]
    means = [float(lp.mean()) for lp in response_log_probs(model, by_hand, 4096)]
    liked = statistics.fmean([means[0], means[2]])
    assert scores["liked_logprob"] == pytest.approx(liked, abs=1e-5)
    assert scores["disliked_logprob"] == pytest.approx(means[1], abs=1e-5)
    assert scores["score"] == pytest.approx(liked - means[1], abs=1e-5)
    assert (scores["n"], scores["n_liked"], scores["n_disliked"]) == (3, 2, 1)
    only_liked = score_model(model, tokenizer, EVAL_SET[:1], EvalMethod())
    assert only_liked["score"] == pytest.approx(means[0], abs=1e-5) and "disliked_logprob" not in only_liked


def test_what_cannot_be_scored_says_why() -> None:
    assert unscorable([], EvalMethod()) == "the eval set is empty"
    assert unscorable(EVAL_SET[3:], EvalMethod()) == "the eval set has no answer with a non-zero reward"
    assert unscorable(EVAL_SET[3:], EvalMethod(fn_path=f"{FNS}:response_length")) is None
    assert unscorable(EVAL_SET, EvalMethod()) is None


def test_an_eval_function_scores_seeded_answers_to_each_prompt_once(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    method = EvalMethod(fn_path=f"{FNS}:response_length", temperature=1.0, max_tokens=6, samples_per_prompt=3)
    first = score_model(model, tokenizer, EVAL_SET, method)
    assert first["prompts"] == 3 and first["n"] == 9  # 3 distinct prompts, 3 answers each
    assert 1 <= first["score"] <= 6 and first["score"] == first["response_length_mean"]
    assert score_model(model, tokenizer, EVAL_SET, method) == first  # same seeds, same answers
    greedy = EvalMethod(fn_path=f"{FNS}:response_length", temperature=0.0, max_tokens=6, samples_per_prompt=2)
    assert score_model(model, tokenizer, EVAL_SET[:1], greedy)["n"] == 2
    echo = EvalMethod(fn_path=f"{FNS}:sampling_echo", temperature=0.5, max_tokens=4)
    labelled = Sample(prompt=user("x?"), label="x", group_index=0)
    assert score_model(model, tokenizer, [labelled], echo)["score"] == 104.5  # its args and the label reached it


def test_an_eval_function_must_return_a_number(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    method = EvalMethod(fn_path=f"{FNS}:returns_dict", max_tokens=2)
    with pytest.raises(PluginError, match="returned a dict for sample 0; an eval function returns a number"):
        score_model(model, tokenizer, EVAL_SET[:1], method)


def test_the_child_scores_each_checkpoint_and_reports_failures(tmp_path: Path) -> None:
    other = perturb_weights(tiny_model_path(), tmp_path / "other", seed=1)
    checkpoints = {"serving": tiny_model_path(), "candidate": other, "again": tiny_model_path()}
    scores = run_eval_child(checkpoints, EVAL_SET, EvalMethod(), num_threads=1, timeout_s=300)
    assert set(scores) == {"serving", "candidate", "again"}
    assert scores["again"]["score"] == scores["serving"]["score"]  # same weights, same score
    assert scores["candidate"]["score"] != scores["serving"]["score"]
    assert all(s["n"] == 3 and s["seconds"] > 0 for s in scores.values())
    failing = EvalMethod(fn_path=f"{FNS}:fails", max_tokens=2)
    with pytest.raises(EvalFailed, match="RuntimeError: the eval judge is down"):
        run_eval_child({"serving": tiny_model_path()}, EVAL_SET, failing, num_threads=1, timeout_s=300)
