"""The evaluation gate in real rounds: rate through the API, learn, evaluate, and roll out or hold back.

A real gateway (in-thread uvicorn, the local engine on the tiny model, SQLite), real training and
evaluation in child processes, the rolling swap through ``POST /admin/weights``; streaming clients
keep the gateway busy through every round, and none of their requests may fail.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from typer.testing import CliRunner

from learner.debug_batch import load_batch
from learner.evaluation import EvalConfig, EvalMethod, is_held_out
from learner.evaluation.guard import GuardConfig
from learner.round import run_round
from learner.round_metrics import RoundMetricsConfig
from storage import get_round, get_version
from tandem.cli import app
from tests.e2e.test_learning_round import LEARNING_RATE, chat_and_rate, round_config, serving
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.support.streaming_load import StreamingLoad

HOLDOUT = 0.5  # half the prompts: enough held out and enough trained among a few questions
# The preference margin alone: the capability guard has tests of its own (test_guards.py).
NO_GUARD = GuardConfig(guard="off")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    settings = gateway_settings(tmp_path_factory.mktemp("eval"), tiny_model_path(), admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("e2e",)) as gw:
        yield gw


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def answered(gateway: Gateway, ratings: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """Chat and rate as ``chat_and_rate``; (question, answer text, rating) as logged."""
    client = gateway.client(gateway.keys["e2e"])
    ids = chat_and_rate(gateway, ratings)
    texts = [client.get(f"/completions/{i}", cast_to=object)["choices"][0]["text"] for i in ids]  # type: ignore[index]
    return [(q, text, rating) for (q, rating), text in zip(ratings, texts, strict=True)]


def eval_file(path: Path, rated: list[tuple[str, str, str]], *, flip: bool) -> Path:
    """A prompts file whose answers are ``rated``'s, liked and disliked as rated (or the other way round)."""
    prompts: dict[str, list[dict[str, object]]] = {}
    for question, text, rating in rated:
        reward = 1 if (rating == "up") != flip else -1
        prompts.setdefault(question, []).append({"content": text, "reward": reward})
    lines = [json.dumps({"messages": user(q), "answers": answers}) for q, answers in prompts.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_held_out_prompts_only_evaluate_and_a_candidate_within_the_margin_is_rolled_out(
    gateway: Gateway, tmp_path: Path
) -> None:
    questions = [f"Tell me about topic {i}." for i in range(8)]
    held = [q for q in questions if is_held_out(user(q), HOLDOUT)]
    assert 0 < len(held) < len(questions)  # the hash is fixed: both kinds are here on every run
    chat_and_rate(gateway, [(q, rating) for q in questions for rating in ("up", "down")])
    # Generalisation of a random tiny model to unseen prompts goes either way: a wide margin lets
    # this candidate through, whatever its score (the rule itself: tests/learner/evaluation/test_gate.py).
    evaluation = EvalConfig(holdout_fraction=HOLDOUT, margin=10.0, every_steps=1, guard=NO_GUARD)
    config = round_config(
        gateway,
        tmp_path,
        evaluation=evaluation,
        num_steps=2,
        save_batch_dir=tmp_path / "batches",
        metrics=RoundMetricsConfig(tensorboard_dir=tmp_path / "tb"),
    )
    with StreamingLoad(gateway.client(gateway.keys["e2e"]), gateway.model) as load:
        result = run_round(config)
    assert result.status == "succeeded", result.error
    assert list(result.seconds) == ["collect", "reward", "train", "export", "evaluate", "swap"]
    assert load.failures == [] and result.version_id in load.fingerprints

    # Held-out answers never reach training; every one of them is evaluated.
    batch = load_batch(tmp_path / "batches" / result.round_id, out_dir=tmp_path / "unused")
    assert {s.prompt[0]["content"] for s in batch.samples} == set(questions) - set(held)  # type: ignore[index]
    assert result.samples == 2 * (len(questions) - len(held))
    assert result.metrics["eval/held_out"] == 2 * len(held) == result.metrics["eval/n"]
    with gateway.sessions()() as session:
        row = get_version(session, version_id=result.version_id or "")
    assert row.status == "serving" and serving(gateway)["weight_version"] == row.id
    record = row.evaluation
    assert record["passed"] is True and record["fn"] == "loglik_margin" and record["eval_set"] == "held_out"
    assert record["n"] == 2 * len(held) and record["margin"] == 10.0 and record["serving_version"] is None
    assert record["candidate"]["n_liked"] == record["candidate"]["n_disliked"] == len(held)
    assert result.metrics["eval/score"] == record["score"] and result.metrics["eval/passed"] == 1.0

    # Periodic evaluation scored the weights before each step and after: before the first, they
    # are the serving weights the gate scored too.
    during = result.metrics["eval/training"]
    assert [e["step"] for e in during] == [0, 1, 2]
    assert during[0]["score"] == pytest.approx(record["serving_score"], abs=1e-4)
    assert during[0]["n"] == record["n"]
    events = EventAccumulator(str(next((tmp_path / "tb").iterdir()))).Reload()
    assert {"eval/score", "eval/serving_score", "eval/delta", "time/evaluate_s"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("eval/training/score")] == [0, 1, 2]


def test_a_worse_candidate_stays_a_candidate_and_serving_keeps_serving(gateway: Gateway, tmp_path: Path) -> None:
    rated = answered(
        gateway,
        [
            ("Describe the sea.", "up"),
            ("Describe the sea.", "down"),
            ("Describe a cat.", "up"),
            ("Describe a dog.", "down"),
        ],
    )
    # The eval file calls good what users disliked and bad what they liked: training on the ratings
    # moves the candidate the wrong way on it, so it scores below the serving version.
    prompts = eval_file(tmp_path / "flipped.jsonl", rated, flip=True)
    config = round_config(gateway, tmp_path, evaluation=EvalConfig(prompts_path=prompts, margin=0.0, guard=NO_GUARD))
    before = serving(gateway)
    with StreamingLoad(gateway.client(gateway.keys["e2e"]), gateway.model) as load:
        result = run_round(config)
    assert result.status == "held_back", result.error
    assert list(result.seconds) == ["collect", "reward", "train", "export", "evaluate"]  # no swap
    assert serving(gateway) == before and load.failures == [] and result.version_id not in load.fingerprints
    assert result.samples == 4  # with a prompts file every rating trains

    with gateway.sessions()() as session:
        row = get_version(session, version_id=result.version_id or "")
        round_row = get_round(session, round_id=result.round_id)
    assert row.status == "candidate" and row.parent_id == (before["version"] or {}).get("id")
    record = row.evaluation
    assert record["passed"] is False and record["score"] < record["serving_score"]
    assert record["eval_set"] == str(prompts) and record["n"] == 4
    assert row.status_reason == (
        f"held back by evaluation: candidate {record['score']:.4f} < serving {record['serving_score']:.4f}"
        " - margin 0 (loglik_margin on 4 eval items)"
    )
    assert result.metrics["eval/passed"] == 0.0 and result.metrics["eval/reason"] == row.status_reason
    # The round succeeded and consumed its feedback: the candidate holds what it learnt.
    assert round_row.status == "succeeded" and round_row.produced_version_id == row.id
    assert round_row.watermark_to == result.watermark_to and (result.watermark_to or 0) > result.watermark_from
    assert run_round(config).status == "nothing_to_learn"

    # Judged by the ratings as given, the same learning passes.
    rated = answered(gateway, [(q, r) for q, _, r in rated])
    config = round_config(
        gateway,
        tmp_path,
        evaluation=EvalConfig(
            prompts_path=eval_file(tmp_path / "e.jsonl", rated, flip=False), margin=0.0, guard=NO_GUARD
        ),
    )
    with StreamingLoad(gateway.client(gateway.keys["e2e"]), gateway.model) as load:
        passed = run_round(config)
    assert passed.status == "succeeded", passed.error
    assert load.failures == [] and passed.version_id in load.fingerprints
    assert serving(gateway)["weight_version"] == passed.version_id
    assert passed.metrics["eval/score"] >= passed.metrics["eval/serving_score"]


def test_an_eval_function_scores_answers_both_versions_generate(gateway: Gateway, tmp_path: Path) -> None:
    chat_and_rate(gateway, [("Say something.", "up"), ("Say nothing.", "down")])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": user(q), "label": q}) + "\n" for q in ("Hi?", "Bye?")))
    method = EvalMethod(
        fn_path="tests.learner.evaluation.eval_fns:response_length", temperature=0.9, max_tokens=6, samples_per_prompt=2
    )
    # Answer lengths differ by at most max_tokens: a margin of 6 always passes (this is about the path).
    config = round_config(
        gateway, tmp_path, evaluation=EvalConfig(prompts_path=prompts, method=method, margin=6.0, guard=NO_GUARD)
    )
    result = run_round(config)
    assert result.status == "succeeded", result.error
    with gateway.sessions()() as session:
        record = get_version(session, version_id=result.version_id or "").evaluation
    assert record["fn"] == method.fn_path and record["n"] == 4 and record["passed"] is True
    assert record["sampling"] == {"temperature": 0.9, "top_p": 1.0, "max_tokens": 6, "samples_per_prompt": 2, "seed": 0}
    for scores in (record["candidate"], record["serving"]):
        assert scores["prompts"] == 2 and 1 <= scores["score"] == scores["response_length_mean"] <= 6


def test_tandem_learn_reads_the_eval_settings_and_reports_a_held_back_version(gateway: Gateway, tmp_path: Path) -> None:
    rated = answered(gateway, [("Name a planet.", "up"), ("Name a planet.", "down")])
    env = {
        "TANDEM_ADMIN_KEY": ADMIN_KEY,
        "TANDEM_DATA_DIR": str(tmp_path / "data"),
        "TANDEM_EVAL_PROMPTS": str(eval_file(tmp_path / "flipped.jsonl", rated, flip=True)),
        "TANDEM_EVAL_MARGIN": "0",
        "TANDEM_EVAL_GUARD": "off",
    }
    args = ["learn", "--server", gateway.url, "--database-url", gateway.settings.resolved_database_url]
    args += ["--checkpoint-dir", str(tmp_path / "checkpoints"), "--learning-rate", str(LEARNING_RATE), "--threads", "1"]
    before = serving(gateway)
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    summary = result.output.strip().splitlines()[-1]
    assert "held back as a candidate: held back by evaluation: candidate" in summary, summary
    assert "- margin 0 (loglik_margin on 2 eval items)" in summary
    assert serving(gateway) == before
