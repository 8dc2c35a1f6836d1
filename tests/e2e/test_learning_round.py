"""One learning round end to end: chat and rate through the SDK, learn, and serve the new version.

A real gateway (in-thread uvicorn, the local engine on the tiny model, SQLite, an admin key), real
training in a child process, and the rollout through ``POST /admin/weights``; streaming clients keep
the gateway busy while the round runs and every one of their requests must complete.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from learner.algorithms import PolicyLossConfig
from learner.corrections import corrected_samples
from learner.debug_batch import replay_batch
from learner.evaluation import EvalConfig
from learner.reward_model import FittedRewardModel, RewardModelConfig
from learner.rollout import RolloutConfig
from learner.round import RoundConfig, RoundResult, run_round
from learner.round_config import default_train_config
from learner.round_metrics import RoundMetricsConfig
from learner.sample import Sample
from learner.trainers import TrainConfig, response_log_probs
from learner.trainers.drift import DriftConfig
from storage import get_round, get_version, list_rounds, list_versions, serving_version
from tandem.cli import app
from tests.fixtures.tiny_model import tiny_model_path
from tests.learner.fault_plugins import CRASH
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.support.streaming_load import StreamingLoad

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
LEARNING_RATE = 1e-2  # the tiny model is stored in bf16: smaller updates round away on export
# Every rating trains and every round rolls out: the evaluation gate has tests of its own (test_eval_gate.py).
EVAL_OFF = EvalConfig(gate="off")
# Rounds after rounds at a high rate on a random model drift far from it by design: the drift guard
# has tests of its own (test_guards.py, tests/learner/trainers/test_child.py).
DRIFT_OFF = DriftConfig(guard="off")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    torch.set_num_threads(1)
    return tiny_model_path()


@pytest.fixture(scope="module")
def gateway(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    settings = gateway_settings(tmp_path_factory.mktemp("learn"), model_dir, admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("e2e",)) as gw:
        yield gw


@pytest.fixture
def fresh_gateway(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway of its own, for a test of the first round from the base weights (no earlier ratings)."""
    settings = gateway_settings(tmp_path_factory.mktemp("first-round"), model_dir, admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("e2e",)) as gw:
        yield gw


def round_config(gateway: Gateway, tmp_path: Path, **overrides: Any) -> RoundConfig:
    values: dict[str, Any] = {
        "server_url": gateway.url,
        "admin_key": ADMIN_KEY,
        "database_url": gateway.settings.resolved_database_url,
        "checkpoint_dir": tmp_path / "checkpoints",
        "learning_rate": LEARNING_RATE,
        "num_threads": 1,
        "evaluation": EVAL_OFF,
        "drift": DRIFT_OFF,
        **overrides,
    }
    return RoundConfig(**values)


def chat_and_rate(gateway: Gateway, ratings: list[tuple[str, str]], user: str = "") -> list[str]:
    """One single-turn chat per (question, rating), rated through /v1/feedback (as ``user``, when
    given); the ids, in order."""
    client = gateway.client(gateway.keys["e2e"])
    ids = []
    for seed, (question, rating) in enumerate(ratings):
        reply = client.chat.completions.create(
            model=gateway.model,
            messages=[{"role": "user", "content": question}],
            max_tokens=8,
            temperature=0.9,
            seed=seed,
            **({"user": user} if user else {}),
        )
        client.post("/feedback", body={"completion_id": reply.id, "rating": rating}, cast_to=object)
        ids.append(reply.id)
    # Reading one back through the API flushes the conversation log: the database has the ratings.
    client.get(f"/completions/{ids[-1]}", cast_to=object)
    return ids


def serving(gateway: Gateway) -> dict[str, Any]:
    response = httpx.get(f"{gateway.url}/admin/weights", headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


def test_round_learns_and_swaps_without_a_failed_request(
    fresh_gateway: Gateway, model_dir: Path, tmp_path: Path
) -> None:
    gateway = fresh_gateway
    chat_and_rate(
        gateway,
        [("What is 2 + 2?", "up"), ("What is 2 + 2?", "down"), ("Name a colour.", "down"), ("Say hi.", "up")],
    )
    before = serving(gateway)
    stages: list[tuple[str, float | None]] = []
    with StreamingLoad(gateway.client(gateway.keys["e2e"]), gateway.model) as load:
        result = run_round(round_config(gateway, tmp_path), on_stage=lambda *event: stages.append(event))
    assert result.status == "succeeded", result.error
    assert load.failures == [] and load.completed > 0
    assert {"default", result.version_id} <= load.fingerprints
    assert result.samples == 4 and result.reward_mean == 0.0
    assert set(result.seconds) == {"collect", "reward", "train", "export", "swap"}
    assert [s for s, seconds in stages if seconds is None] == ["collect", "reward", "train", "export", "swap"]
    assert result.parent_version_id is None and before["weight_version"] == "default"

    version = result.version_id
    assert version is not None
    with gateway.sessions()() as session:
        row = get_version(session, version_id=version)
        assert serving_version(session, model=gateway.model) == row
        assert row.status == "serving" and row.watermark == result.watermark_to and row.sha256
        assert row.metrics["samples"] == 4 and "loss" in row.metrics and "grad_norm" in row.metrics
        round_row = get_round(session, round_id=result.round_id)
    assert round_row.status == "succeeded" and round_row.produced_version_id == version
    assert round_row.watermark_from == 0 and round_row.watermark_to == result.watermark_to > 0
    assert round_row.samples_trained == 4

    now = serving(gateway)
    assert now["weight_version"] == version and now["version"]["id"] == version
    assert Path(now["model_path"]) == Path(row.checkpoint_path)
    client = gateway.client(gateway.keys["e2e"])
    reply = client.chat.completions.create(
        model=gateway.model, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert reply.system_fingerprint == version
    logged = client.get(f"/completions/{reply.id}", cast_to=object)
    assert {span["version"] for span in logged["choices"][0]["weight_versions"]} == {version}  # type: ignore[index]

    base = load_file(model_dir / "model.safetensors")
    trained = load_file(Path(row.checkpoint_path) / "model.safetensors")
    assert base.keys() == trained.keys()
    assert any(not torch.equal(base[name], trained[name]) for name in base)

    again = run_round(round_config(gateway, tmp_path))
    assert again.status == "nothing_to_learn" and again.version_id is None
    assert again.watermark_from == again.watermark_to == result.watermark_to
    assert "train" not in again.seconds
    assert serving(gateway)["weight_version"] == version


def test_a_round_that_cannot_change_the_policy_makes_no_version(fresh_gateway: Gateway, tmp_path: Path) -> None:
    """One rating is its own user's baseline: its advantage is zero, so training would copy the weights.
    The round says so, makes no version and consumes the rating (the next round does not see it again)."""
    gateway = fresh_gateway
    chat_and_rate(gateway, [("Say hi.", "up")], user="lone")
    result = run_round(round_config(gateway, tmp_path))
    assert result.status == "nothing_to_learn" and result.version_id is None, result
    assert result.reason and result.reason.startswith("every advantage is zero (1 samples)")
    assert "train" not in result.seconds and serving(gateway)["version"] is None
    run = httpx.get(f"{gateway.url}/admin/runs/{result.round_id}", headers=ADMIN).json()
    assert run["status"] == "nothing_to_learn" and run["reason"] == result.reason
    assert run["produced_version_id"] is None and run["watermark"]["to"] == result.watermark_to > 0
    listed = httpx.get(f"{gateway.url}/admin/runs", params={"status": "nothing_to_learn"}, headers=ADMIN).json()
    assert [r["reason"] for r in listed["data"]] == [result.reason]
    again = run_round(round_config(gateway, tmp_path))
    assert again.watermark_from == result.watermark_to
    assert again.reason == f"no new ratings since watermark {result.watermark_to}"
    with gateway.sessions()() as session:
        assert list_versions(session, model=gateway.model) == ()


def test_a_corrected_answer_is_trained_and_becomes_more_likely(
    fresh_gateway: Gateway, model_dir: Path, tmp_path: Path
) -> None:
    """A lone rating has no advantage, but its corrected answer is learnt by likelihood (the SFT term)."""
    gateway = fresh_gateway
    client = gateway.client(gateway.keys["e2e"])
    messages = [{"role": "user", "content": "What is two plus two?"}]
    reply = client.chat.completions.create(model=gateway.model, messages=messages, max_tokens=8, user="fixer")
    body = {"completion_id": reply.id, "rating": "down", "corrected_answer": "Two plus two is four."}
    client.post("/feedback", body=body, cast_to=object)
    logged = client.get(f"/completions/{reply.id}", cast_to=dict[str, Any])  # flushes the log
    result = run_round(round_config(gateway, tmp_path))
    assert result.status == "succeeded" and result.version_id is not None, result
    assert result.metrics["corrections"] == 1 and result.checkpoint_path is not None

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rated = Sample(
        prompt_token_ids=logged["prompt_token_ids"],
        prompt=messages,
        metadata={"feedback": {"corrected_answer": body["corrected_answer"]}},
    )
    [corrected] = corrected_samples([rated], tokenizer)

    def loglik(path: Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return float(response_log_probs(model, [corrected], 4096)[0].mean())

    before, after = loglik(model_dir), loglik(Path(result.checkpoint_path))
    print("corrected answer, mean log-prob per token: before", before, "after", after)
    assert after > before + 0.05, (before, after)  # nats per token


def test_failed_training_leaves_serving_and_watermark(gateway: Gateway, tmp_path: Path) -> None:
    chat_and_rate(gateway, [("Is water wet?", "up"), ("Is fire cold?", "down")])
    before = serving(gateway)
    with gateway.sessions()() as session:
        versions_before = list_versions(session, model=gateway.model)
    crashing = dataclasses.replace(default_train_config(), custom_loss_path=CRASH)
    result = run_round(round_config(gateway, tmp_path, train_config=crashing))
    assert result.status == "failed" and result.version_id is None
    assert "training crashed" in (result.error or "")
    assert serving(gateway) == before
    with gateway.sessions()() as session:
        assert list_versions(session, model=gateway.model) == versions_before
        failed = get_round(session, round_id=result.round_id)
    assert failed.status == "failed" and failed.watermark_to is None and failed.error
    # The feedback is still there for the next round.
    retry = run_round(round_config(gateway, tmp_path))
    assert retry.status == "succeeded" and retry.samples == 2
    assert retry.watermark_from == result.watermark_from
    assert retry.parent_version_id == (before["version"]["id"] if before["version"] else None)


def test_a_canary_share_without_an_engine_pool_keeps_the_version_a_candidate(gateway: Gateway, tmp_path: Path) -> None:
    """A base canary needs replicas to split (tests/e2e/test_base_canary.py); one engine refuses it."""
    chat_and_rate(gateway, [("Is ice cold?", "up"), ("Is ice hot?", "down")])
    before = serving(gateway)
    result = run_round(round_config(gateway, tmp_path, canary_share=0.5))
    assert result.status == "failed" and "needs an engine pool" in (result.error or ""), result.error
    assert serving(gateway) == before
    with gateway.sessions()() as session:
        [version] = [v for v in list_versions(session, model=gateway.model) if v.id in (result.error or "")]
    assert version.status == "candidate" and "engine pool" in (version.status_reason or "")
    # The ratings are still there for the next round (the tests after this one count theirs).
    assert run_round(round_config(gateway, tmp_path)).samples == 2


def test_rollout_only_saves_a_replayable_batch_and_metrics_follow_trained_rounds(
    gateway: Gateway, tmp_path: Path
) -> None:
    chat_and_rate(gateway, [("Pick a number.", "up"), ("Pick a letter.", "down"), ("Pick a word.", "up")])
    before = serving(gateway)
    batches = tmp_path / "batches"
    looked = run_round(round_config(gateway, tmp_path, mode="rollout_only", save_batch_dir=batches))
    assert looked.status == "rollout_only" and looked.version_id is None and looked.samples == 3
    assert serving(gateway) == before
    with gateway.sessions()() as session:
        assert get_round(session, round_id=looked.round_id).watermark_to == looked.watermark_from  # not consumed
    # The saved batch trains with no server involved, into a checkpoint of its own.
    outcome = replay_batch(batches / looked.round_id, out_dir=tmp_path / "replayed")
    assert outcome.status == "succeeded" and outcome.checkpoint is not None

    metrics = RoundMetricsConfig(tensorboard_dir=tmp_path / "tb")
    trained = run_round(round_config(gateway, tmp_path, metrics=metrics))
    assert trained.status == "succeeded" and trained.samples == 3  # the same feedback, still there
    events = EventAccumulator(str(next((tmp_path / "tb").iterdir()))).Reload()
    assert events.Scalars("rollout/reward_mean")[-1].value == pytest.approx(1 / 3)
    assert {"train/loss", "train/grad_norm", "time/swap_s"} <= set(events.Tags()["scalars"])


def test_rollout_round_trains_on_real_groups(gateway: Gateway, tmp_path: Path) -> None:
    chat_and_rate(gateway, [("Name a river.", "up"), ("Name a tree.", "down"), ("Name a tree.", "up")])
    rollout = RolloutConfig(n_samples_per_prompt=4, max_new_tokens=8, seed=7)
    config = round_config(
        gateway, tmp_path, reward="custom", reward_path="benchmarks.simulated_users:letter_reward", rollout=rollout
    )
    with StreamingLoad(gateway.client(gateway.keys["e2e"]), gateway.model) as load:
        result = run_round(config)
    assert result.status == "succeeded", result.error
    assert load.failures == []
    assert list(result.seconds) == ["collect", "reward", "rollout", "train", "export", "swap"]
    metrics = result.metrics
    assert metrics["groups"] == 2 and metrics["rollout_samples"] == 8
    # A kept group is its rated answer(s) and 4 fresh samples: river 1 + 4, tree 2 + 4, or both; a
    # group whose rewards are all equal is dropped.
    assert {1: {5, 6}, 2: {11}}[metrics["groups_kept"]] >= {result.samples}
    assert serving(gateway)["weight_version"] == result.version_id


def test_reward_model_is_used_only_when_trusted(gateway: Gateway, tmp_path: Path) -> None:
    questions = [f"Question number {i}?" for i in range(18)]
    # Each question twice, rated differently for a quarter of them: the same rating twice would be its
    # own group's baseline (zero advantage everywhere: nothing to learn).
    chat_and_rate(gateway, [(q, "up" if i % 4 else "down") for i, q in enumerate(questions * 2)])
    rollout = RolloutConfig(n_samples_per_prompt=2, max_new_tokens=8, seed=3)
    strict = RewardModelConfig(min_quality=1.01)  # no fit can reach it: the round falls back to feedback
    fallback = run_round(round_config(gateway, tmp_path, reward="reward_model", reward_model=strict, rollout=rollout))
    assert fallback.status == "succeeded", fallback.error
    assert fallback.metrics["reward_model"].startswith("not used: held-out quality")
    assert "rollout" not in fallback.seconds and fallback.samples == 36

    chat_and_rate(gateway, [(q, "down" if i % 3 else "up") for i, q in enumerate(questions)])
    lenient = RewardModelConfig(min_quality=-1.0)  # any fit is trusted: fresh rollouts get its scores
    used = run_round(round_config(gateway, tmp_path, reward="reward_model", reward_model=lenient, rollout=rollout))
    assert used.status == "succeeded", used.error
    assert used.metrics["reward_model"] == "used" and used.metrics["reward_model/n"] >= 54
    assert used.metrics["rollout_samples"] == 2 * 18 and "rollout" in used.seconds
    saved = FittedRewardModel.load(Path(used.metrics["reward_model_path"]))
    assert saved.metrics == {
        k.removeprefix("reward_model/"): v for k, v in used.metrics.items() if k.startswith("reward_model/")
    }


def test_kl_loss_anchors_to_the_lineages_first_model(gateway: Gateway, model_dir: Path, tmp_path: Path) -> None:
    kl = TrainConfig(loss=PolicyLossConfig(use_tis=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl"))
    results = []
    for question in ("First KL question?", "Second KL question?"):
        chat_and_rate(gateway, [(question, "up"), (question, "down")])
        results.append(run_round(round_config(gateway, tmp_path, train_config=kl)))
    first, second = results
    assert first.status == second.status == "succeeded", (first.error, second.error)
    with gateway.sessions()() as session:
        rows = [get_version(session, version_id=r.version_id or "") for r in results]
    root = rows[0].metrics["base_model_path"]
    assert rows[1].metrics["base_model_path"] == root and rows[1].parent_id == rows[0].id
    # The second round trains a version that moved away from the root: its KL to it is not zero.
    assert second.metrics["kl_loss"] > 0


def test_tandem_learn_cli(gateway: Gateway, tmp_path: Path) -> None:
    chat_and_rate(gateway, [("Tell me a joke.", "up"), ("Tell me a joke.", "down"), ("Bye.", "up")])
    args = [
        "learn",
        "--server",
        gateway.url,
        "--database-url",
        gateway.settings.resolved_database_url,
        "--checkpoint-dir",
        str(tmp_path / "checkpoints"),
        "--learning-rate",
        str(LEARNING_RATE),
        "--threads",
        "1",
    ]
    env = {"TANDEM_ADMIN_KEY": ADMIN_KEY, "TANDEM_DATA_DIR": str(tmp_path / "data"), "TANDEM_EVAL_GATE": "off"}
    env["TANDEM_LEARN_DRIFT_GUARD"] = "off"  # after this module's rounds the tiny model is far from its root
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    summary = result.output.strip().splitlines()[-1]
    version = serving(gateway)["weight_version"]
    assert summary.startswith("round round-") and "3 samples" in summary and f"new version {version}" in summary
    assert "swap" in summary
    nothing = CliRunner().invoke(app, args, env=env)
    assert nothing.exit_code == 0 and "nothing to learn" in nothing.output
    refused = CliRunner().invoke(app, args, env={**env, "TANDEM_ADMIN_KEY": "wrong"})
    assert refused.exit_code == 1 and "401" in refused.output


def test_tandem_learn_cli_refuses_bad_settings_before_starting(gateway: Gateway, tmp_path: Path) -> None:
    env = {"TANDEM_ADMIN_KEY": ADMIN_KEY, "TANDEM_DATA_DIR": str(tmp_path / "data")}
    base = ["learn", "--server", gateway.url, "--database-url", gateway.settings.resolved_database_url]
    no_path = CliRunner().invoke(app, [*base, "--reward", "custom"], env=env)
    assert no_path.exit_code == 2 and "reward_path" in no_path.output
    missing = CliRunner().invoke(app, [*base, "--reward", "custom", "--reward-path", "nowhere.at_all:fn"], env=env)
    assert missing.exit_code == 2 and "cannot import 'nowhere.at_all'" in missing.output
    with gateway.sessions()() as session:
        assert not [r for r in list_rounds(session, model=gateway.model) if r.status == "running"]


def test_round_result_is_plain_data() -> None:
    result = RoundResult("nothing_to_learn", "round-x", "m")
    assert result.seconds == {} and result.error is None


@pytest.mark.parametrize("form", ["fp8", "int4"])
def test_a_quantized_round_serves_a_quantized_copy_and_keeps_training_in_full_precision(
    gateway: Gateway, tmp_path: Path, form: str
) -> None:
    chat_and_rate(gateway, [("Is the sky blue?", "up"), ("Is grass blue?", "down")])
    # INT4 trains through the fake quantizer (groups of 32: every linear of the tiny model qualifies).
    qat = {"qat": "int4", "qat_group_size": 32} if form == "int4" else {}
    train = dataclasses.replace(default_train_config(), **qat)
    result = run_round(round_config(gateway, tmp_path, rollout_weights=form, train_config=train))

    assert result.status == "succeeded", result.error
    assert {"export", "quantize", "swap"} <= set(result.seconds)
    with gateway.sessions()() as session:
        version = get_version(session, version_id=result.version_id)
    served = Path(serving(gateway)["model_path"])
    assert served == Path(f"{version.checkpoint_path}-{form}")  # the version's own checkpoint stays full precision
    method = json.loads((served / "config.json").read_text())["quantization_config"]["quant_method"]
    assert method == {"fp8": "fp8", "int4": "compressed-tensors"}[form]
    stored = load_file(served / "model.safetensors")
    assert any(t.dtype == torch.float8_e4m3fn for t in stored.values()) == (form == "fp8")
    assert any(name.endswith(".weight_packed") for name in stored) == (form == "int4")
    client = gateway.client(gateway.keys["e2e"])
    reply = client.chat.completions.create(model=gateway.model, messages=[{"role": "user", "content": "hi"}])
    assert reply.system_fingerprint == result.version_id  # the local engine serves the quantized weights
