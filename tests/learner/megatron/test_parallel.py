"""Megatron layouts over two processes (gloo on the CPU), through the real training child, against one process.

The same request (two PPO steps with old log-probs, the KL loss to a megatron reference, gradient
clipping, several micro-batches) runs in a world of one and with tensor, pipeline, data and context
parallelism over two ranks (context parallel also with the distributed optimizer, and with tensor
parallel over four ranks): the loss parts and gradient norm of each step, and the exported weights,
must agree within float32 rounding. The model is the tiny Qwen2 in float32 with tied embeddings, so
the export is compared unrounded and the pipeline layout shares the embeddings across its stages.
A rank that dies or hangs fails the run and leaves no process behind.
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from learner.algorithms import PolicyLossConfig
from learner.megatron_config import MegatronConfig
from learner.trainers import TrainConfig
from learner.training import TrainingOutcome, TrainingRequest, run_training_child
from tests.fixtures.tiny_model import tiny_model_path
from tests.learner.fault_plugins import CRASH, HANG
from tests.learner.trainers.conftest import random_samples

LAYOUTS = {
    "tensor_parallel=2": MegatronConfig(devices=2, tensor_parallel=2),
    "pipeline_parallel=2": MegatronConfig(devices=2, pipeline_parallel=2),
    "data_parallel=2": MegatronConfig(devices=2),
    "context_parallel=2": MegatronConfig(devices=2, context_parallel=2),
    # the optimizer sharded over the data-parallel-with-CP group; its weights are views of one buffer
    "context_parallel=2, distributed optimizer": MegatronConfig(
        devices=2, context_parallel=2, distributed_optimizer=True
    ),
    "context_parallel=2 x tensor_parallel=2": MegatronConfig(devices=4, context_parallel=2, tensor_parallel=2),
}
CONFIG = TrainConfig(
    backend="megatron",
    loss=PolicyLossConfig(kl_loss_coef=0.05, entropy_coef=0.01),
    max_tokens_per_micro_batch=24,  # 6 samples in 3 micro-batches: uneven over two replicas
    clip_grad=0.5,
)
ADVANTAGES = (1.0, -0.5, 2.0, 0.3, -1.0, 0.7)  # not centred, so the policy loss is not 0
STEP_KEYS = ("loss", "pg_loss", "kl_loss", "entropy_loss", "grad_norm")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with tied embeddings, saved in float32 (exports keep the base's dtype)."""
    folder = tmp_path_factory.mktemp("tied-float32") / "model"
    shutil.copytree(tiny_model_path(), folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(folder)  # the embeddings alone: HF drops the tied lm_head
    return folder


def request(
    base_dir: Path, out_dir: Path, layout: MegatronConfig, custom_loss_path: str | None = None, **changes: object
) -> TrainingRequest:
    fields: dict = {
        "base_model_dir": base_dir,
        "out_dir": out_dir,
        "samples": tuple(random_samples(6, seed=2)),
        "config": dataclasses.replace(CONFIG, megatron=layout, custom_loss_path=custom_loss_path),
        "advantages": ADVANTAGES,
        "num_steps": 2,
        "learning_rate": 1e-3,
        "num_threads": 1,
        "timeout_s": 300,
    }
    return TrainingRequest(**{**fields, **changes})  # type: ignore[arg-type]


def trained(base_dir: Path, out_dir: Path, layout: MegatronConfig) -> tuple[TrainingOutcome, dict[str, torch.Tensor]]:
    outcome = run_training_child(request(base_dir, out_dir, layout))
    assert outcome.status == "succeeded", outcome.error
    assert outcome.checkpoint is not None
    return outcome, load_file(outcome.checkpoint.path / "model.safetensors")


@pytest.fixture(scope="module")
def one_process(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainingOutcome, dict]:
    return trained(base_dir, tmp_path_factory.mktemp("one") / "out", MegatronConfig())


@pytest.mark.parametrize("name", LAYOUTS)
def test_two_ranks_train_like_one_process(
    base_dir: Path, one_process: tuple[TrainingOutcome, dict], tmp_path: Path, name: str
) -> None:
    expected, expected_weights = one_process
    outcome, weights = trained(base_dir, tmp_path / "out", LAYOUTS[name])
    assert len(outcome.metrics) == len(expected.metrics) == 2
    for step, (got, want) in enumerate(zip(outcome.metrics, expected.metrics, strict=True)):
        for key in STEP_KEYS:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), f"step {step + 1} {key}"
    assert expected.metrics[1]["kl_loss"] > 0  # the second step moved away from the reference
    base = load_file(base_dir / "model.safetensors")
    assert weights.keys() == expected_weights.keys() == base.keys()
    assert "lm_head.weight" not in weights  # tied: written once, as HF does
    for key, tensor in expected_weights.items():
        assert not torch.equal(tensor, base[key]), f"{key} did not move"
        # two Adam steps of lr 1e-3 move each weight by up to 2e-3: 1e-5 is rounding, not a wrong step
        torch.testing.assert_close(weights[key], tensor, rtol=0, atol=1e-5, msg=key)


def processes_with(marker: str) -> list[int]:
    """The processes whose environment holds ``marker`` (inherited from this test), wherever they are."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if marker.encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


@pytest.fixture
def marker(monkeypatch: pytest.MonkeyPatch) -> str:
    """An environment entry every process this test starts inherits."""
    value = uuid.uuid4().hex
    monkeypatch.setenv("TANDEM_TEST_PROCESS_MARK", value)
    return f"TANDEM_TEST_PROCESS_MARK={value}"


def test_a_rank_that_dies_fails_the_run_and_no_rank_is_left(base_dir: Path, tmp_path: Path, marker: str) -> None:
    # the last rank exits hard once loaded; rank 0 is left in a collective with it
    faulty = request(base_dir, tmp_path / "out", LAYOUTS["tensor_parallel=2"], custom_loss_path=CRASH)
    outcome = run_training_child(faulty)
    assert outcome.status == "failed" and outcome.failure == "crashed", outcome.error
    assert "the training process of rank 1 (of 2) exited with code 3" in (outcome.error or "")
    assert not (tmp_path / "out").exists()
    assert processes_with(marker) == []


def test_a_hung_rank_times_out_and_no_rank_is_left(base_dir: Path, tmp_path: Path, marker: str) -> None:
    hung = request(base_dir, tmp_path / "out", LAYOUTS["pipeline_parallel=2"], custom_loss_path=HANG, timeout_s=12)
    outcome = run_training_child(hung)
    assert outcome.status == "failed" and outcome.failure == "timeout", outcome.error
    assert "12 s timeout" in (outcome.error or "")
    assert processes_with(marker) == []
