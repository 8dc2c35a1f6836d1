"""Compact column encodings: token ids as int32 and logprobs as float32, little-endian."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

_SWAP = sys.byteorder != "little"
_INT32 = next(code for code in "il" if array(code).itemsize == 4)


def _pack(typecode: str, values: Sequence[float] | Sequence[int]) -> bytes:
    packed = array(typecode, values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _unpack(typecode: str, data: bytes) -> array:  # type: ignore[type-arg]
    unpacked = array(typecode)
    unpacked.frombytes(data)
    if _SWAP:
        unpacked.byteswap()
    return unpacked


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    return _pack(_INT32, token_ids)


def decode_token_ids(data: bytes) -> list[int]:
    return _unpack(_INT32, data).tolist()


def encode_logprobs(logprobs: Sequence[float]) -> bytes:
    return _pack("f", logprobs)


def decode_logprobs(data: bytes) -> list[float]:
    return _unpack("f", data).tolist()
