"""learner.sglang_router: SGLang's /generate in front of a live gateway, as slime's plugins call it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from learner.sglang_router import SGLANG_DEFAULT_MAX_NEW_TOKENS, RouterRefusal, rollout_body, sglang_router
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway, tiny_model

__all__ = ["tiny_model"]  # the shared fixture, visible here


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    settings = gateway_settings(tmp_path_factory.mktemp("router-gateway"), tiny_model, admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("acme",)) as gw:
        yield gw


@pytest.fixture(scope="module")
def router(gateway: Gateway) -> Iterator[str]:
    with sglang_router(gateway.url, ADMIN_KEY, timeout=60) as (ip, port):
        yield f"http://{ip}:{port}"


def generate(router: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{router}/generate", json=body, headers=headers, timeout=60)


def test_input_ids_answer_like_sglang(router: str) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 5, "sampling_seed": 3, "no_stop_trim": True}
    body = {"input_ids": [1, 2, 3], "sampling_params": params, "return_logprob": True}
    answer = generate(router, body).json()
    meta = answer["meta_info"]
    items = meta["output_token_logprobs"]
    assert [item[1] for item in items] == answer["output_ids"] and 1 <= len(items) <= 5
    assert all(item[0] < 0 and item[2] is None for item in items)
    assert meta["finish_reason"]["type"] == ("length" if len(items) == 5 else "stop")
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(items)
    assert meta["weight_version"] == "default" and isinstance(answer["text"], str)
    assert generate(router, body).json()["output_ids"] == answer["output_ids"]  # sampling_seed is the seed


def test_text_is_tokenized_and_logprobs_are_only_on_request(router: str, tiny_model: Path) -> None:
    text = "The river"
    answer = generate(router, {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
    assert answer["meta_info"]["prompt_tokens"] == len(AutoTokenizer.from_pretrained(tiny_model).encode(text))
    assert "output_token_logprobs" not in answer["meta_info"]


def test_the_routing_key_becomes_the_session(router: str) -> None:
    body = {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2}}
    assert generate(router, body, headers={"X-SMG-Routing-Key": "session-1"}).status_code == 200
    assert rollout_body(body, "session-1")["session_id"] == "session-1"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ([1, 2], "must be a JSON object"),
        ({"sampling_params": {}}, "exactly one of input_ids and text"),
        ({"text": "a", "input_ids": [1]}, "exactly one of input_ids and text"),
        ({"text": ["a", "b"]}, "text must be one prompt"),
        ({"input_ids": [1], "stream": True}, "stream is not served"),
        ({"input_ids": [1], "sampling_params": {"n": 2}}, "n != 1"),
        (
            {"input_ids": [1], "sampling_params": {"regex": "a+", "stop_token_ids": [2]}},
            "regex, stop_token_ids",
        ),
    ],
)
def test_what_the_gateway_cannot_serve_is_refused_clearly(router: str, body: Any, says: str) -> None:
    response = generate(router, body)
    assert response.status_code == 400 and says in response.json()["error"]["message"]
    with pytest.raises(RouterRefusal, match=says.replace("(", r"\(")):
        rollout_body(body, None)


def test_json_schema_constrains_the_rollout(router: str, tiny_model: Path) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    closed = schema | {"required": ["n"], "additionalProperties": False}
    params = {"max_new_tokens": 40, "sampling_seed": 5, "json_schema": json.dumps(closed)}
    answer = generate(router, {"input_ids": [1, 2, 3], "sampling_params": params, "return_logprob": True}).json()
    text = AutoTokenizer.from_pretrained(tiny_model).decode(answer["output_ids"])
    assert list(json.loads(text)) == ["n"] and answer["meta_info"]["finish_reason"]["type"] == "stop"
    bad = generate(router, {"input_ids": [1], "sampling_params": {"json_schema": '{"type": "nope"}'}})
    assert bad.status_code == 400 and "json_schema" in bad.json()["error"]["message"]


def test_gateway_refusals_and_other_paths_pass_through(router: str) -> None:
    too_long = generate(router, {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**6}})
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
    assert httpx.get(f"{router}/health").status_code == 200
    assert httpx.post(f"{router}/update_weights_from_disk", json={}).status_code == 404


def test_sglang_defaults_fill_what_is_left_out() -> None:
    body = rollout_body({"input_ids": [1]}, None)
    assert body == {
        "input_ids": [1],
        "n": 1,
        "max_tokens": SGLANG_DEFAULT_MAX_NEW_TOKENS,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
    }
