"""A whole conversation through the SDK: four turns of one session, two rated, then the rows checked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from openai import OpenAI
from transformers import AutoTokenizer

from storage.completions import get_completion_view
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import Gateway, gateway_settings, run_gateway

SESSION = "e2e-conversation-1"
QUESTIONS = ["What is 2 + 3?", "And 4 + 4?", "Write a function that adds.", "Thanks, bye."]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    torch.set_num_threads(1)
    return tiny_model_path()


@pytest.fixture(scope="module")
def gateway(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    settings = gateway_settings(tmp_path_factory.mktemp("e2e"), model_dir)
    with run_gateway(settings, tenants=("e2e",)) as gw:
        yield gw


def ask(client: OpenAI, gateway: Gateway, messages: list[dict[str, Any]], *, stream: bool) -> tuple[str, str, Any]:
    """One turn; returns (completion id, reply text, usage)."""
    common: dict[str, Any] = {
        "model": gateway.model,
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0.7,
        "seed": len(messages),
        "extra_headers": {"X-Session-Id": SESSION},
    }
    if not stream:
        reply = client.chat.completions.create(**common)
        return reply.id, reply.choices[0].message.content or "", reply.usage
    chunks = list(client.chat.completions.create(**common, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks[0].id, text, chunks[-1].usage


def test_four_turns_logged_token_for_token(gateway: Gateway, model_dir: Path) -> None:
    client = gateway.client(gateway.keys["e2e"])
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a calculator."}]
    turns: list[dict[str, Any]] = []
    for number, question in enumerate(QUESTIONS):
        history.append({"role": "user", "content": question})
        completion_id, text, usage = ask(client, gateway, history, stream=number % 2 == 1)
        turns.append({"id": completion_id, "messages": list(history), "text": text, "usage": usage})
        history.append({"role": "assistant", "content": text})

    assert turns[1]["usage"].prompt_tokens_details.cached_tokens > 0
    for turn in turns[1:]:
        assert turn["usage"].prompt_tokens_details.cached_tokens <= turn["usage"].prompt_tokens

    rated = {1: ("up", None), 3: ("down", "Goodbye!")}
    for index, (rating, corrected) in rated.items():
        body = {"completion_id": turns[index]["id"], "rating": rating, "corrected_answer": corrected}
        assert client.post("/feedback", body=body, cast_to=object)["revision"] == 1  # type: ignore[index]

    # Reading one back through the API flushes the log, so the database has every turn after this.
    client.get(f"/completions/{turns[-1]['id']}", cast_to=object)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with gateway.sessions()() as session:
        views = [get_completion_view(session, tenant_id="e2e", completion_id=t["id"]) for t in turns]

    previous = None
    for index, (turn, view) in enumerate(zip(turns, views, strict=True)):
        assert view is not None
        assert view.session_key == SESSION and view.turn_index == index
        assert view.previous_completion_id == previous
        previous = view.id
        rendered = tokenizer.apply_chat_template(
            turn["messages"], add_generation_prompt=True, tokenize=True, return_dict=False, sanitize_control_tokens=True
        )
        # The prompt says what the template renders, with earlier replies as the model generated them.
        assert tokenizer.decode(view.prompt_token_ids) == tokenizer.decode(rendered)
        if index > 0:
            earlier = views[index - 1]
            assert earlier is not None
            generated = [*earlier.prompt_token_ids, *earlier.choices[0].token_ids]
            assert view.prompt_token_ids[: len(generated)] == generated
        assert view.prompt_tokens == turn["usage"].prompt_tokens
        assert view.cached_tokens == turn["usage"].prompt_tokens_details.cached_tokens
        assert view.stream == (index % 2 == 1)
        (choice,) = view.choices
        assert tokenizer.decode(choice.token_ids, skip_special_tokens=True) == turn["text"] == choice.text
        assert len(choice.logprobs) == len(choice.token_ids) == turn["usage"].completion_tokens
        assert [(s.version, s.start, s.end) for s in choice.weight_versions] == [("default", 0, len(choice.token_ids))]
        if index in rated:
            rating, corrected = rated[index]
            assert choice.feedback is not None
            assert (choice.feedback.rating, choice.feedback.corrected_answer) == (rating, corrected)
            assert choice.feedback.score == (1.0 if rating == "up" else -1.0)
        else:
            assert choice.feedback is None
