"""POST /admin/rollouts on a live gateway with the local engine: samples, auth, validation, no logging, bound."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from transformers import AutoTokenizer

from server.app import create_app
from server.engines.local.engine import LocalEngine
from storage.models import Completion
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings
from tests.server.engines.helpers import reference_logprobs
from tests.support.polling import wait_until
from tests.support.uvicorn_thread import serve_in_thread

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def rollout(url: str, body: dict[str, Any], headers: dict[str, str] | None = ADMIN) -> httpx.Response:
    return httpx.post(f"{url}/admin/rollouts", json=body, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def prompt_ids(tiny_model: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False))


def test_n_samples_with_behaviour_logprobs(gateway: Gateway, tiny_model: Path, prompt_ids: list[int]) -> None:
    response = rollout(gateway.url, {"input_ids": prompt_ids, "n": 4, "max_tokens": 10, "seed": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == gateway.model and body["prompt_ids"] == prompt_ids
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert len({tuple(c["output_ids"]) for c in choices}) > 1  # fresh samples, not one repeated
    for choice in choices:
        output = choice["output_ids"]
        assert 1 <= len(output) <= 10 and len(choice["logprobs"]) == len(output)
        assert choice["finish_reason"] == ("length" if len(output) == 10 else "stop")
        assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": len(output)}]
        # Temperature 1, no top-k/top-p: the behaviour logprob is the model's own log-softmax.
        reference = reference_logprobs(tiny_model, prompt_ids, output)
        assert max(abs(a - b) for a, b in zip(choice["logprobs"], reference, strict=True)) < 1e-3
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": sum(len(c["output_ids"]) for c in choices),
    }
    again = rollout(gateway.url, {"input_ids": prompt_ids, "n": 4, "max_tokens": 10, "seed": 3}).json()
    assert [c["output_ids"] for c in again["choices"]] == [c["output_ids"] for c in choices]  # seeded


def test_messages_render_like_chat_completions(gateway: Gateway, prompt_ids: list[int]) -> None:
    response = rollout(gateway.url, {"messages": MESSAGES, "n": 2, "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["prompt_ids"] == prompt_ids
    greedy = [c["output_ids"] for c in body["choices"]]
    assert greedy[0] == greedy[1]  # temperature 0: both choices are the greedy answer
    chat = gateway.client(gateway.keys["acme"]).chat.completions.create(
        model=gateway.model,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
    )
    assert body["choices"][0]["text"] == chat.choices[0].message.content


def test_text_is_tokenized_as_sglang_generate_does(gateway: Gateway, tiny_model: Path) -> None:
    text = "The sea is"
    response = rollout(gateway.url, {"text": text, "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["prompt_ids"] == AutoTokenizer.from_pretrained(tiny_model).encode(text)


def test_needs_the_admin_key(gateway: Gateway, prompt_ids: list[int]) -> None:
    body = {"input_ids": prompt_ids, "max_tokens": 2}
    missing = rollout(gateway.url, body, headers=None)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    tenant = rollout(gateway.url, body, headers={"Authorization": f"Bearer {gateway.keys['acme']}"})
    assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "admin_required"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"n": 2}, "exactly one of input_ids, messages and text"),
        ({"input_ids": [1, 2], "messages": MESSAGES}, "exactly one of input_ids, messages and text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1], "n": 0}, "'n'"),
        ({"input_ids": [1], "n": 65}, "'n'"),
        ({"input_ids": [1], "temperature": -1}, "temperature"),
        ({"input_ids": [1], "top_p": 0}, "top_p"),
        ({"input_ids": [1], "max_new_tokens": 4}, "max_new_tokens"),
        ({"input_ids": [1], "stop": [""]}, "stop"),
        ({"input_ids": [1, 10**9]}, "input_ids must be token ids in"),
        ({"input_ids": [-1]}, "input_ids must be token ids in"),
        ({"input_ids": [1] * 5000}, "context"),
        ({"input_ids": [1], "max_tokens": 10**6}, "maximum context length"),
        ({"messages": [{"role": "nobody", "content": "x"}]}, "messages"),
    ],
)
def test_invalid_requests_are_400(gateway: Gateway, body: dict[str, Any], says: str) -> None:
    response = rollout(gateway.url, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and says in error["message"]


def _completions(gateway: Gateway) -> int:
    with gateway.sessions()() as session:
        return session.scalar(select(func.count()).select_from(Completion)) or 0


def _chat_until_stored(gateway: Gateway) -> None:
    """Log one chat completion and wait until it is stored: the log keeps order, so everything
    logged before it is stored by then too."""
    chat = gateway.client(gateway.keys["acme"]).chat.completions.create(
        model=gateway.model,
        messages=MESSAGES,
        max_tokens=2,
        user=f"u-{uuid.uuid4().hex}",  # type: ignore[arg-type]
    )

    def stored() -> bool:
        with gateway.sessions()() as session:
            return session.get(Completion, chat.id) is not None

    wait_until(stored, timeout_s=10, what="the chat completion is stored")


def test_rollouts_are_not_logged_as_conversations(gateway: Gateway, prompt_ids: list[int]) -> None:
    _chat_until_stored(gateway)  # earlier tests' completions are in the database before the count
    before = _completions(gateway)
    assert rollout(gateway.url, {"input_ids": prompt_ids, "n": 3, "max_tokens": 4}).status_code == 200
    assert rollout(gateway.url, {"messages": MESSAGES, "n": 2, "max_tokens": 4}).status_code == 200
    # Had the rollouts been logged, they would be stored before this chat completion.
    _chat_until_stored(gateway)
    assert _completions(gateway) == before + 1


@pytest.fixture(scope="module")
async def bounded(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, LocalEngine]]:
    """A gateway of its own whose engine the test can watch; rollouts bounded to 2 sequences."""
    engine = await LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=8)
    settings = gateway_settings(
        tmp_path_factory.mktemp("rollout-bound"), tiny_model, admin_key=ADMIN_KEY, rollout_max_concurrency=2
    )
    try:
        with serve_in_thread(create_app(settings, engine=engine)) as url:
            yield url, engine
    finally:
        await engine.close()


def test_concurrency_bound_holds(bounded: tuple[str, LocalEngine], prompt_ids: list[int]) -> None:
    url, engine = bounded
    peak, stop = 0, threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, engine.running)
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    body = {"input_ids": prompt_ids, "n": 6, "max_tokens": 24, "temperature": 1.0}
    results: list[httpx.Response] = []
    try:
        # Two rollout requests at once: 12 samples, never more than 2 in the engine.
        threads = [threading.Thread(target=lambda: results.append(rollout(url, body))) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        stop.set()
        watcher.join()
    assert [r.status_code for r in results] == [200, 200]
    assert sum(len(r.json()["choices"]) for r in results) == 12
    assert peak == 2
