"""``to_device``: host tensors reach a GPU through pinned memory, without blocking; elsewhere a plain move."""

from __future__ import annotations

import pytest
import torch

from learner.to_device import to_device


def test_on_the_cpu_the_tensor_is_handed_back() -> None:
    tensor = torch.arange(5)
    assert to_device(tensor, torch.device("cpu")) is tensor


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the device machine)")
def test_a_host_tensor_reaches_the_gpu_intact_while_the_gpu_is_busy() -> None:
    device = torch.device("cuda")
    torch.cuda._sleep(200_000_000)  # the copy is queued behind this, not waited for
    tensors = [to_device(torch.arange(i, i + 1000), device) for i in range(50)]  # temporaries: the pool keeps them
    for i, tensor in enumerate(tensors):
        assert tensor.device.type == "cuda"
        assert torch.equal(tensor.cpu(), torch.arange(i, i + 1000))
    positions = torch.arange(4).expand(3, 4)  # padded rows' positions: a view with stride 0
    assert torch.equal(to_device(positions, device).cpu(), positions)
    back = torch.ones(3, device=device)
    assert to_device(back, device) is back
