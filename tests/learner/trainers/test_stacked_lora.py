"""Many adapters in one training pass: each row through its own adapter, each adapter trained as if
alone (compared with peft's path, step for step), exported as a PEFT folder peft and the engine read,
and the one-child pass giving what one child per adapter gives."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import PreTrainedModel

from learner.sample import Sample
from learner.trainers.stacked_lora import StackedLoRA, spec_of_folder
from learner.trainers.stacked_step import SlotBatch, train_stacked_step
from learner.trainers.torch_backend import TrainConfig, train_step
from learner.training import TrainingRequest, run_training_child
from learner.training.adapter_batch import batch_misfit, run_adapter_batch
from learner.training_request import AdapterSpec
from server.engines.local.lora import read_adapter
from tests.learner.trainers.conftest import load_tiny, random_samples

SPEC = AdapterSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj", "lm_head"))


def stored_adapter(base_dir: Path, folder: Path, seed: int) -> Path:
    """A random (non-zero) adapter of ``SPEC``, saved by peft: a scope's stored adapter to continue."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=SPEC.rank, lora_alpha=SPEC.alpha, target_modules=list(SPEC.target_modules), init_lora_weights=False
    )
    get_peft_model(load_tiny(base_dir), config).save_pretrained(folder, save_embedding_layers=False)
    return folder


@pytest.fixture(scope="module")
def stored(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("stored")
    return [stored_adapter(base_dir, root / f"scope-{i}", seed=i) for i in range(2)]


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_each_row_goes_through_its_own_adapter(base_dir: Path, stored: list[Path], tmp_path: Path) -> None:
    ids = torch.tensor([[5, 9, 14, 200, 31], [7, 7, 300, 2, 11], [40, 41, 42, 43, 44]])
    base = logits_of(load_tiny(base_dir), ids)
    alone = [logits_of(PeftModel.from_pretrained(load_tiny(base_dir), folder), ids) for folder in stored]
    model = load_tiny(base_dir)
    stack = StackedLoRA(model, SPEC, 3)  # slot 2 stays fresh: B = 0, the base's own outputs
    for slot, folder in enumerate(stored):
        stack.load_slot(slot, folder)
    with stack.rows(torch.tensor([1, 2, 0])):
        mixed = logits_of(model, ids)
    torch.testing.assert_close(mixed[0], alone[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed[1], base[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed[2], alone[0][2], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(alone[0], alone[1])

    # Exported, a slot is the PEFT folder it was loaded from: peft and the serving engine read it.
    out = stack.export_slot(1, tmp_path / "exported", base_dir).path
    for name, tensor in load_file(stored[1] / "adapter_model.safetensors").items():
        torch.testing.assert_close(load_file(out / "adapter_model.safetensors")[name], tensor)
    assert spec_of_folder(out) == replace(SPEC, target_modules=tuple(sorted(SPEC.target_modules)))
    torch.testing.assert_close(logits_of(PeftModel.from_pretrained(load_tiny(base_dir), out), ids), alone[1])
    assert len(read_adapter("exported", out, load_tiny(base_dir)).modules) == 3 * 2 + 1


def test_a_forward_outside_rows_is_refused(model: PreTrainedModel) -> None:
    StackedLoRA(model, SPEC, 2)
    with pytest.raises(RuntimeError, match="outside rows"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def peft_steps(base_dir: Path, folder: Path, samples: list[Sample], config: TrainConfig, steps: int) -> dict:
    """What training ``folder``'s adapter alone on ``samples`` gives (the back-to-back path's code)."""
    model = PeftModel.from_pretrained(load_tiny(base_dir), folder, is_trainable=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    metrics = [train_step(model, optimizer, samples, config) for _ in range(steps)]
    weights = {n.replace(".default", ""): p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    return {"metrics": metrics, "weights": weights}


def test_one_pass_trains_each_adapter_as_it_would_train_alone(
    base_dir: Path, stored: list[Path], tmp_path: Path
) -> None:
    # Different sample counts and lengths per scope (so their token counts differ), micro-batches
    # small enough that both scopes share some, and a clip between the two scopes' first gradient
    # norms (3.01 and 3.50): it binds for one scope only.
    scopes = [random_samples(6, seed=1), random_samples(3, seed=2)]
    config = TrainConfig(max_tokens_per_micro_batch=40, clip_grad=3.25)
    alone = [
        peft_steps(base_dir, folder, samples, config, steps=2) for folder, samples in zip(stored, scopes, strict=True)
    ]

    model = load_tiny(base_dir)
    stack = StackedLoRA(model, SPEC, 2)
    for slot, folder in enumerate(stored):
        stack.load_slot(slot, folder)
    optimizer = torch.optim.AdamW(stack.parameters(), lr=1e-2)
    slots = [SlotBatch(samples) for samples in scopes]
    together = [train_stacked_step(model, stack, optimizer, slots, config) for _ in range(2)]

    for slot, result in enumerate(alone):
        for step in range(2):
            for name in ("loss", "pg_loss", "grad_norm"):
                assert together[step][slot][name] == pytest.approx(result["metrics"][step][name], rel=1e-4, abs=1e-6)
        exported = load_file(
            stack.export_slot(slot, tmp_path / f"slot-{slot}", base_dir).path / "adapter_model.safetensors"
        )
        assert set(exported) == set(result["weights"])
        for name, weight in result["weights"].items():
            torch.testing.assert_close(exported[name], weight, rtol=1e-4, atol=1e-6)
    low, high = sorted(slot["grad_norm"] for slot in together[0])
    assert low < config.clip_grad < high


def request(base_dir: Path, out_dir: Path, samples: list[Sample], init_dir: Path | None) -> TrainingRequest:
    return TrainingRequest(
        base_model_dir=base_dir,
        out_dir=out_dir,
        samples=tuple(samples),
        num_steps=2,
        learning_rate=1e-2,
        num_threads=1,
        timeout_s=120,
        adapter=replace(SPEC, init_dir=init_dir),
    )


def test_one_child_gives_each_scope_what_one_child_per_scope_gives(
    base_dir: Path, stored: list[Path], tmp_path: Path
) -> None:
    scopes = [random_samples(5, seed=3), random_samples(4, seed=4)]
    batch = [
        request(base_dir, tmp_path / f"batch-{i}", s, folder)
        for i, (s, folder) in enumerate(zip(scopes, stored, strict=True))
    ]
    assert batch_misfit(batch) is None
    outcomes = run_adapter_batch(batch)
    assert [o.status for o in outcomes] == ["succeeded", "succeeded"], outcomes[0].error
    for one, outcome in zip(batch, outcomes, strict=True):
        alone = run_training_child(replace(one, out_dir=tmp_path / f"alone-{one.out_dir.name}"))
        assert alone.status == "succeeded" and alone.checkpoint is not None and outcome.checkpoint is not None
        mine, theirs = (load_file(o.checkpoint.path / "adapter_model.safetensors") for o in (outcome, alone))  # type: ignore[union-attr]
        assert set(mine) == set(theirs)
        for name in theirs:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-6)
        assert outcome.metrics[-1]["loss"] == pytest.approx(alone.metrics[-1]["loss"], rel=1e-4, abs=1e-6)


def test_a_diverging_pass_fails_every_request_in_it(base_dir: Path, stored: list[Path], tmp_path: Path) -> None:
    batch = [
        replace(request(base_dir, tmp_path / f"huge-{i}", random_samples(3, seed=i), None), learning_rate=1e30)
        for i in range(2)
    ]
    outcomes = run_adapter_batch(batch)
    assert [o.failure for o in outcomes] == ["diverged", "diverged"]
    assert not any(r.out_dir.exists() for r in batch)


def test_requests_that_cannot_share_a_pass_are_named(base_dir: Path, stored: list[Path], tmp_path: Path) -> None:
    one = request(base_dir, tmp_path / "a", random_samples(2), None)
    assert batch_misfit([one, replace(one, learning_rate=1e-3)]) is not None
    assert "rank, alpha" in str(batch_misfit([one, replace(one, adapter=replace(SPEC, rank=8))]))
    other = replace(one, adapter=AdapterSpec(rank=4, alpha=8, init_dir=stored[0]))  # default targets
    assert "trained with another" in str(batch_misfit([other]))
    assert "not a readable adapter" in str(batch_misfit([replace(one, adapter=replace(SPEC, init_dir=tmp_path))]))
    with pytest.raises(ValueError, match="differ"):
        run_adapter_batch([one, replace(one, num_steps=3)])
