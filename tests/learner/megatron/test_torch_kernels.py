"""torch's kernels in place of megatron's fallbacks (local loops, Apex's fused weight-gradient GEMM)
compute what those compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core.optimizer import clip_grads, optimizer

from learner.megatron.backend import MegatronPolicy, OptimizerSettings
from learner.megatron.runtime import parallel
from learner.megatron.torch_kernels import (
    fuse_weight_gradient_accumulation,
    install_multi_tensor_kernels,
    multi_tensor_l2_norm,
    multi_tensor_scale,
)
from learner.megatron_config import MegatronConfig
from learner.trainers import TrainConfig
from tests.learner.megatron.conftest import FAMILIES, random_hf, saved_state
from tests.learner.trainers.conftest import random_samples


def _tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (13,), (3, 4, 2), (1,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    return [torch.randn(s, generator=generator).to(d) for s, d in zip(shapes, dtypes, strict=True)]


def test_l2_norm_matches_the_loop() -> None:
    tensors = _tensors(0)
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors]))
    norm, _ = multi_tensor_l2_norm(2048, torch.zeros(1), [tensors], False)
    assert norm.shape == (1,) and norm.dtype == torch.float32
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_scale_into_other_tensors_casts_to_their_dtype(scale: float) -> None:
    sources = [t.float() for t in _tensors(1)]
    destinations = [torch.zeros_like(t) for t in _tensors(2)]  # float32 and bfloat16
    multi_tensor_scale(2048, torch.zeros(1), [sources, destinations], scale)
    for source, destination in zip(sources, destinations, strict=True):
        assert torch.equal(destination, (source * scale).to(destination.dtype))


def test_scale_in_place() -> None:
    tensors = _tensors(3)
    expected = [t * 0.5 for t in tensors]
    multi_tensor_scale(2048, torch.zeros(1), [tensors, tensors], 0.5)
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))


def test_installed_in_place_of_megatrons_local_loops() -> None:
    install_multi_tensor_kernels()
    assert clip_grads.l2_norm_impl is multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_impl is multi_tensor_scale
    assert optimizer.multi_tensor_scale_impl is multi_tensor_scale


@pytest.mark.parametrize("family", ["qwen2", "qwen2-mqa-tied"])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_fused_weight_gradient_accumulation_gives_the_same_main_grad(family: str, bf16: bool, tmp_path: Path) -> None:
    """The GEMM that adds into ``main_grad`` (CUDA's default) against autograd's gradient plus DDP's add,
    over two micro-batches: a tied output weight also collects the embedding's gradient."""
    saved_state(random_hf(FAMILIES[family]()), tmp_path)
    layout = MegatronConfig(bf16=bf16)
    samples = random_samples(6, seed=4, vocab=256)
    config = TrainConfig(max_tokens_per_micro_batch=40)
    grads = []
    with parallel(layout):
        for fused in (False, True):
            policy = MegatronPolicy(tmp_path, layout, optimizer=OptimizerSettings(1e-3))
            if fused:
                fuse_weight_gradient_accumulation(policy.model)
            assert len(policy.micro_batches(samples, config)) > 1
            policy.accumulate_gradients(samples, config)
            linear = policy.model.decoder.layers[0].mlp.linear_fc1.weight
            assert linear.grad_added_to_main_grad is fused  # the fused path ran
            grads.append({name: p.main_grad.clone() for name, p in policy.model.named_parameters()})
    plain, fused_grads = grads
    # bf16: the plain path rounds each micro-batch's weight gradient to bf16 before adding it up
    tolerance = 1e-2 if bf16 else 1e-6
    for name, grad in plain.items():
        assert grad.abs().sum() > 0, name
        error = float((fused_grads[name] - grad).norm() / grad.norm())
        assert error < tolerance, (name, error)
