"""A whole learning round on the megatron backend: chat and rate, train in the child, export, swap, serve.

The same real gateway, child process and rollout as tests/e2e/test_learning_round.py, with
``TrainConfig(backend="megatron")``: two optimizer steps (PPO old log-probs from megatron) and the
KL loss against a megatron reference, in one process and with tensor parallelism over two (gloo).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner.algorithms import PolicyLossConfig
from learner.megatron_config import MegatronConfig
from learner.round import run_round
from learner.trainers import TrainConfig
from storage import get_version
from tests.e2e.test_learning_round import (  # noqa: F401
    chat_and_rate,
    fresh_gateway,
    gateway,
    model_dir,
    round_config,
    serving,
)
from tests.server.conftest import Gateway

MEGATRON = TrainConfig(backend="megatron", loss=PolicyLossConfig(use_tis=True, kl_loss_coef=0.05))


@pytest.mark.parametrize(
    "layout",
    [MegatronConfig(), MegatronConfig(devices=2, tensor_parallel=2)],
    ids=["one process", "tensor_parallel=2"],
)
def test_a_round_trains_with_megatron_and_serves_the_export(
    fresh_gateway: Gateway,  # noqa: F811
    model_dir: Path,  # noqa: F811
    tmp_path: Path,
    layout: MegatronConfig,
) -> None:
    chat_and_rate(fresh_gateway, [("What is 2 + 2?", "up"), ("What is 2 + 2?", "down"), ("Say hi.", "up")])
    train_config = dataclasses.replace(MEGATRON, megatron=layout)
    result = run_round(round_config(fresh_gateway, tmp_path, train_config=train_config, num_steps=2))
    assert result.status == "succeeded", result.error
    assert result.samples == 3 and {"loss", "grad_norm", "kl_loss", "tis"} <= set(result.metrics)
    assert serving(fresh_gateway)["weight_version"] == result.version_id
    with fresh_gateway.sessions()() as session:
        row = get_version(session, version_id=result.version_id or "")
    base = load_file(model_dir / "model.safetensors")
    trained = load_file(Path(row.checkpoint_path) / "model.safetensors")
    assert trained.keys() == base.keys() and all(trained[k].dtype == base[k].dtype for k in base)
    assert any(not torch.equal(base[name], trained[name]) for name in base)
    client = fresh_gateway.client(fresh_gateway.keys["e2e"])
    reply = client.chat.completions.create(
        model=fresh_gateway.model, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert reply.system_fingerprint == result.version_id


def test_a_layout_that_does_not_fit_fails_the_round_and_keeps_serving(
    gateway: Gateway,  # noqa: F811
    tmp_path: Path,
) -> None:
    chat_and_rate(gateway, [("Is water wet?", "up"), ("Is fire cold?", "down")])
    before = serving(gateway)
    # The tiny model has 2 KV heads: refused before any training process starts.
    too_wide = TrainConfig(backend="megatron", megatron=MegatronConfig(devices=4, tensor_parallel=4))
    result = run_round(round_config(gateway, tmp_path, train_config=too_wide))
    assert result.status == "failed"
    assert "num_key_value_heads=2 is not divisible by tensor_parallel=4" in (result.error or "")
    assert serving(gateway) == before
