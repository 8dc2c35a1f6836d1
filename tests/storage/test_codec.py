from __future__ import annotations

from array import array

from storage.codec import decode_logprobs, decode_token_ids, encode_logprobs, encode_token_ids


def test_token_ids_are_int32_little_endian() -> None:
    assert encode_token_ids([1, -2, 2**31 - 1]) == b"\x01\x00\x00\x00\xfe\xff\xff\xff\xff\xff\xff\x7f"
    assert decode_token_ids(encode_token_ids([1, -2, 2**31 - 1])) == [1, -2, 2**31 - 1]


def test_logprobs_are_float32_little_endian() -> None:
    assert encode_logprobs([-0.5]) == b"\x00\x00\x00\xbf"
    values = [-0.1, -12.345678, 0.0, float("-inf")]
    assert decode_logprobs(encode_logprobs(values)) == array("f", values).tolist()


def test_empty_round_trip() -> None:
    assert decode_token_ids(encode_token_ids([])) == []
    assert decode_logprobs(encode_logprobs([])) == []
