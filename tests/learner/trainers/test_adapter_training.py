"""Training a LoRA adapter in the child: a PEFT folder out, the base untouched, the liked answers
made likelier; and continuing from a stored adapter starts where it left off."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from learner.sample import Sample
from learner.trainers import weights_sha256
from learner.trainers.torch_backend import response_log_probs
from learner.training import TrainingRequest, run_training_child
from learner.training_request import AdapterSpec
from tests.learner.trainers.conftest import load_tiny, random_samples

SPEC = AdapterSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))


def liked(samples: list[Sample]) -> list[Sample]:
    """Every answer rated up: a positive advantage for each pushes its log-probability up."""
    return [replace(s, reward=1.0) for s in samples]


def mean_log_prob(base_dir: Path, adapter: Path | None, samples: list[Sample]) -> float:
    model = load_tiny(base_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return float(torch.cat(response_log_probs(model.eval(), samples, 4096)).mean())


@pytest.fixture(scope="module")
def first(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainingRequest:
    samples = liked(random_samples(4))
    return TrainingRequest(
        base_model_dir=base_dir,
        out_dir=tmp_path_factory.mktemp("adapters") / "first",
        samples=tuple(samples),
        advantages=(1.0,) * len(samples),
        num_steps=3,
        learning_rate=1e-2,
        num_threads=1,
        timeout_s=120,
        adapter=SPEC,
    )


def test_an_adapter_round_writes_a_peft_folder_that_makes_liked_answers_likelier(
    first: TrainingRequest, base_dir: Path
) -> None:
    base_weights = weights_sha256(base_dir)
    outcome = run_training_child(first)
    assert outcome.status == "succeeded", outcome.error
    folder = first.out_dir
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert outcome.checkpoint is not None and outcome.checkpoint.sha256 == weights_sha256(folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    assert tensors and all(".lora_A." in name or ".lora_B." in name for name in tensors)
    assert weights_sha256(base_dir) == base_weights  # the base is never written
    samples = list(first.samples)
    assert mean_log_prob(base_dir, folder, samples) > mean_log_prob(base_dir, None, samples) + 0.05

    # A second round continues from the first adapter's weights, not from a fresh one.
    second = replace(first, out_dir=folder.parent / "second", adapter=replace(SPEC, init_dir=folder), num_steps=1)
    fresh = replace(first, out_dir=folder.parent / "fresh", num_steps=1)
    assert run_training_child(second).status == run_training_child(fresh).status == "succeeded"
    after_second = mean_log_prob(base_dir, second.out_dir, samples)
    assert after_second > mean_log_prob(base_dir, folder, samples) > mean_log_prob(base_dir, fresh.out_dir, samples)


def test_adapters_are_refused_on_the_megatron_backend(first: TrainingRequest) -> None:
    with pytest.raises(ValueError, match="adapters train on the torch backend only"):
        replace(first, config=replace(first.config, backend="megatron"))
