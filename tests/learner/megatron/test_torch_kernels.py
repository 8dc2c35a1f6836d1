"""The multi-tensor kernels that replace megatron's local loops compute what the loops compute."""

from __future__ import annotations

import pytest
import torch
from megatron.core.optimizer import clip_grads, optimizer

from learner.megatron.torch_kernels import install_multi_tensor_kernels, multi_tensor_l2_norm, multi_tensor_scale


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
