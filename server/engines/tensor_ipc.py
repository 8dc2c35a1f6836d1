"""Handing weights to an engine process on the same machine without copying them through a file.

The payload is SGLang's ``update_weights_from_tensor`` one: a list of (name, tensor) pickled with
torch.multiprocessing's reductions and base64-encoded. A CUDA tensor travels as a CUDA IPC handle
(the receiver maps the sender's GPU memory), a CPU tensor as the name of a shared-memory file, so
only names, dtypes, shapes and handles cross the wire. The sender must keep its tensors alive, and
unchanged, until the receiver has answered (it copies them into its weights, then synchronises).

Unpickling runs code by design, so the receiver accepts only torch's own rebuild functions and data
types (as SGLang's SafeUnpickler does); anything else in a payload is refused.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp  # importing it registers the tensor and storage reductions

__all__ = ["TensorPayloadError", "deserialize_named_tensors", "serialize_named_tensors"]


class TensorPayloadError(ValueError):
    """A payload that is not a list of (name, tensor) made by ``serialize_named_tensors``."""


_DTYPES = {str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
_ALLOWED = {
    "torch.multiprocessing.reductions": {
        "rebuild_tensor",
        "rebuild_cuda_tensor",
        "rebuild_typed_storage",
        "rebuild_storage_filename",
        "rebuild_storage_empty",
    },
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch": {"Tensor", "Size", *_DTYPES},
}


class _TorchOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if name not in _ALLOWED.get(module, ()):
            raise TensorPayloadError(f"the payload refers to {module}.{name}, which a tensor payload never does")
        return super().find_class(module, name)


@contextmanager
def _cpu_tensors_by_file_name() -> Iterator[None]:
    # The default file-descriptor strategy hands descriptors over a socket that only a child of the
    # sender may use; a named shared-memory file opens from any process on the machine.
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """The base64 payload for ``update_weights_from_tensor`` (one per tensor-parallel rank).

    CPU tensors are moved into shared memory in place. Parameters are sent as plain tensors.
    """
    buffer = io.BytesIO()
    with _cpu_tensors_by_file_name():
        ForkingPickler(buffer).dump([(name, tensor.detach()) for name, tensor in named_tensors])
    return base64.b64encode(buffer.getvalue()).decode()


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a payload, mapped from the sender's memory.

    Raises:
        TensorPayloadError: not base64, not a list of (str, tensor), refers to anything but torch's
            rebuild functions, or its memory cannot be mapped (the sender is gone or on another machine).
    """
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise TensorPayloadError(f"the payload is not base64: {exc}") from exc
    try:
        named = _TorchOnlyUnpickler(io.BytesIO(raw)).load()
    except TensorPayloadError:
        raise
    except Exception as exc:  # a stale handle fails inside torch with RuntimeError, a bad pickle with many types
        raise TensorPayloadError(f"the tensors could not be opened: {type(exc).__name__}: {exc}") from exc
    if not isinstance(named, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
        for item in named
    ):
        raise TensorPayloadError("the payload must be a list of (name, tensor) pairs")
    return named
