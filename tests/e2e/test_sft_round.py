"""Supervised fine-tuning rounds end to end: a conversations file and the answers rated up in the log
become more likely, through the same training, version, gate and hot swap as a learning round, and
the feedback watermark does not move."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from learner.corrections import turn_tokenizer
from learner.round import run_round
from learner.sample import Sample
from learner.sft import conversation_samples
from learner.trainers import response_log_probs
from tandem.cli import app
from tests.e2e.test_learning_round import chat_and_rate, round_config, serving
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What colour is the sky?"},
        {"role": "assistant", "content": "Blue, mostly."},
        {"role": "user", "content": "And at night?"},
        {"role": "assistant", "content": "Black, with stars."},
    ],
    [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven is prime."}],
]
# Measured on the tiny model, three runs each: +2.68 (file) and +2.76 (log) nats per token every time
# (seeded answers, deterministic CPU training); the bound leaves room for another CPU's rounding.
MIN_GAIN = 1.0


@pytest.fixture(scope="module")
def model_dir() -> Path:
    torch.set_num_threads(1)
    return tiny_model_path()


@pytest.fixture
def gateway(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    settings = gateway_settings(tmp_path_factory.mktemp("sft"), model_dir, admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("e2e",)) as gw:
        yield gw


def mean_log_prob(checkpoint: Path, samples: list[Sample]) -> float:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return float(torch.cat(response_log_probs(model, samples, 4096)).mean())


def write_conversations(path: Path) -> Path:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    return path


def test_a_conversations_file_is_learnt_and_served(gateway: Gateway, model_dir: Path, tmp_path: Path) -> None:
    data = write_conversations(tmp_path / "conversations.jsonl")
    tokenizer, stops = turn_tokenizer(model_dir)
    samples = conversation_samples(data, tokenizer, stops)
    assert len(samples) == 3 and all(s.supervised for s in samples)  # one per assistant turn
    # Only the assistant's turn is trained: its tokens decode to the answer and the end of turn.
    assert tokenizer.decode(samples[1].response_token_ids) == "Black, with stars.<|im_end|>"
    assert "Blue, mostly." in tokenizer.decode(samples[1].prompt_token_ids)  # earlier turns: prompt only

    result = run_round(round_config(gateway, tmp_path, mode="sft", sft_data=data, num_steps=4))
    assert result.status == "succeeded" and result.checkpoint_path is not None, result
    assert result.metrics["sft_samples"] == 3 and result.watermark_to == result.watermark_from
    assert serving(gateway)["version"]["id"] == result.version_id  # the same hot swap as a learning round
    before, after = mean_log_prob(model_dir, samples), mean_log_prob(Path(result.checkpoint_path), samples)
    print("SFT file, mean log-prob per token: before", before, "after", after)
    assert after > before + MIN_GAIN, (before, after)


def test_liked_answers_in_the_log_are_learnt(gateway: Gateway, model_dir: Path, tmp_path: Path) -> None:
    ids = chat_and_rate(gateway, [("Say a word.", "up"), ("Say another.", "down"), ("One more.", "up")])
    client = gateway.client(gateway.keys["e2e"])
    liked: list[dict[str, Any]] = [client.get(f"/completions/{ids[i]}", cast_to=dict[str, Any]) for i in (0, 2)]
    result = run_round(round_config(gateway, tmp_path, mode="sft", num_steps=4))
    assert result.status == "succeeded" and result.metrics["sft_samples"] == 2, result
    samples = [
        Sample(prompt_token_ids=c["prompt_token_ids"], response_token_ids=c["choices"][0]["token_ids"]) for c in liked
    ]
    assert result.checkpoint_path is not None
    before, after = mean_log_prob(model_dir, samples), mean_log_prob(Path(result.checkpoint_path), samples)
    print("SFT log, mean log-prob per token: before", before, "after", after)
    assert after > before + MIN_GAIN, (before, after)
    # An RL round still sees those ratings: the watermark did not move.
    assert run_round(round_config(gateway, tmp_path)).samples == 3


def test_tandem_sft_command(gateway: Gateway, tmp_path: Path) -> None:
    data = write_conversations(tmp_path / "conversations.jsonl")
    common = ["sft", "--server", gateway.url, "--steps", "1", "--checkpoint-dir", str(tmp_path / "ckpt")]
    common += ["--database-url", gateway.settings.resolved_database_url]
    env = {"TANDEM_ADMIN_KEY": ADMIN_KEY, "TANDEM_EVAL_GATE": "off", "TANDEM_LEARN_DRIFT_GUARD": "off"}
    result = CliRunner().invoke(app, [*common, "--data", str(data)], env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "3 samples, trained by likelihood (SFT), new version" in result.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "hello"}\n')
    refused = CliRunner().invoke(app, [*common, "--data", str(bad)], env=env, catch_exceptions=False)
    assert refused.exit_code == 1 and "bad.jsonl:1" in refused.output
