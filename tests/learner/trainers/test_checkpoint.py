"""An exported checkpoint loads in transformers and in the serving engine, and generates as trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from learner.trainers import CheckpointError, TrainConfig, checkpoint_dtype, export_checkpoint, train_step
from learner.trainers.checkpoint import weights_sha256
from server.engines.local.weights import check_compatible, load_model, read_state_dict
from tests.learner.trainers.conftest import random_samples


def greedy(model: PreTrainedModel) -> list[int]:
    prompt = torch.tensor([[1, 100, 200, 300]])
    return model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()


@pytest.fixture
def trained(model: PreTrainedModel) -> PreTrainedModel:
    train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), random_samples(4), TrainConfig(clip_grad=None))
    return model.eval()


def test_export_in_the_base_dtype_loads_everywhere_and_generates_as_trained(
    base_dir: Path, trained: PreTrainedModel, tmp_path: Path
) -> None:
    result = export_checkpoint(trained, base_dir, tmp_path / "v1", dtype=checkpoint_dtype(base_dir))
    assert result.path == tmp_path / "v1" and result.sha256 == weights_sha256(result.path)
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]  # no staging folder left behind
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in result.path.iterdir()}

    served = load_model(base_dir, device="cpu", dtype=torch.bfloat16)
    tensors = read_state_dict(result.path)
    check_compatible(served, tensors)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}

    exported = AutoModelForCausalLM.from_pretrained(result.path)
    assert exported.dtype == torch.bfloat16
    assert greedy(exported) == greedy(trained.to(torch.bfloat16))
    assert AutoTokenizer.from_pretrained(result.path).encode("hello") == AutoTokenizer.from_pretrained(base_dir).encode(
        "hello"
    )


def test_float32_export_is_exact_and_its_hash_is_stable(
    base_dir: Path, trained: PreTrainedModel, tmp_path: Path
) -> None:
    first = export_checkpoint(trained, base_dir, tmp_path / "a")
    second = export_checkpoint(trained, base_dir, tmp_path / "b")
    assert first.sha256 == second.sha256
    exported = AutoModelForCausalLM.from_pretrained(first.path, dtype=torch.float32)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    assert greedy(exported) == greedy(trained)
    assert trained.dtype == torch.float32  # exporting never converts the model itself


def test_an_existing_destination_or_a_source_without_tokenizer_is_refused(
    base_dir: Path, model: PreTrainedModel, tmp_path: Path
) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match="never overwritten"):
        export_checkpoint(model, base_dir, tmp_path / "taken")
    with pytest.raises(CheckpointError, match="no tokenizer files"):
        export_checkpoint(model, tmp_path / "taken", tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
