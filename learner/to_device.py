"""Host tensors onto an accelerator without making the host wait for it.

A CUDA copy from pageable host memory is staged by the driver, which may first wait for the stream
to drain: in a training step that stalls the host at the loss until the forward pass is done, and
the device then idles while the host queues the backward. Copies from pinned memory are queued like
kernels. torch's pinned-memory pool keeps a block until the copies that read it are done.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["to_device"]


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device``; from the host to a GPU through pinned memory, without blocking."""
    if tensor.device == device or device.type == "cpu" or tensor.device.type != "cpu":
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.contiguous().pin_memory()  # an expanded view cannot be pinned as it is
    return tensor.to(device, non_blocking=True)
