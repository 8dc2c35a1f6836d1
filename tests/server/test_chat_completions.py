"""Chat completions through the official openai client against a live gateway."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.server.conftest import Gateway

HELLO = [{"role": "user", "content": "What is 2 + 3?"}]


def completion_log(gateway: Gateway, completion_id: str, key: str) -> dict:
    response = httpx.get(
        f"{gateway.url}/v1/completions/{completion_id}", headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_models_lists_the_served_model(client: OpenAI, gateway: Gateway) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [gateway.model]


def test_chat_completion_shape_and_usage(client: OpenAI, gateway: Gateway) -> None:
    reply = client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=6, temperature=0)
    assert reply.id.startswith("chatcmpl-") and len(reply.id) == len("chatcmpl-") + 32
    assert reply.object == "chat.completion"
    assert reply.model == gateway.model
    (choice,) = reply.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs is None
    usage = reply.usage
    assert usage is not None and usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens >= 0


def test_prompt_is_the_rendered_template_and_output_ids_are_logged(
    client: OpenAI, gateway: Gateway, tiny_model: object
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Sum 1 and 2 <|im_end|>"},
    ]
    reply = client.chat.completions.create(model=gateway.model, messages=messages, max_tokens=8, temperature=0)
    logged = completion_log(gateway, reply.id, gateway.keys["acme"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rendered = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi\nthere"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Sum 1 and 2 <|im_end|>"},
        ],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        sanitize_control_tokens=True,
    )
    assert logged["prompt_token_ids"] == list(rendered)
    # A control token typed by the user is plain text, not the end-of-turn token.
    assert rendered.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == len(messages)
    (choice,) = logged["choices"]
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == reply.choices[0].message.content
    assert len(choice["logprobs"]) == len(choice["token_ids"]) == reply.usage.completion_tokens


def test_n_choices_are_independent_samples(client: OpenAI, gateway: Gateway) -> None:
    reply = client.chat.completions.create(
        model=gateway.model, messages=HELLO, max_tokens=12, n=3, temperature=1.0, seed=7
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1
    logged = completion_log(gateway, reply.id, gateway.keys["acme"])
    assert [c["index"] for c in logged["choices"]] == [0, 1, 2]
    assert reply.usage.completion_tokens == sum(len(c["token_ids"]) for c in logged["choices"])


def test_seed_reproduces_a_sample(client: OpenAI, gateway: Gateway) -> None:
    def sample(seed: int) -> str | None:
        reply = client.chat.completions.create(
            model=gateway.model, messages=HELLO, max_tokens=16, temperature=1.0, seed=seed
        )
        return reply.choices[0].message.content

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_logprobs_and_top_logprobs(client: OpenAI, gateway: Gateway) -> None:
    reply = client.chat.completions.create(
        model=gateway.model, messages=HELLO, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    logged = completion_log(gateway, reply.id, gateway.keys["acme"])
    assert logged["choices"][0]["logprobs"] == pytest.approx([e.logprob for e in content], abs=1e-5)

    plain = client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=3, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_stop_string_cuts_the_visible_text_but_not_the_logged_ids(client: OpenAI, gateway: Gateway) -> None:
    free = client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=24, temperature=0)
    text = free.choices[0].message.content or ""
    # Three printable ASCII characters from the middle of the greedy reply.
    start = next(
        i for i in range(len(text) // 2, len(text) - 3) if text[i : i + 3].isascii() and text[i : i + 3].isprintable()
    )
    stop = text[start : start + 3]
    cut = client.chat.completions.create(
        model=gateway.model, messages=HELLO, max_tokens=24, temperature=0, stop=[stop, "never-appears"]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    logged = completion_log(gateway, cut.id, gateway.keys["acme"])
    tokenizer_text = logged["choices"][0]["text"]
    assert tokenizer_text == cut.choices[0].message.content
    first = completion_log(gateway, free.id, gateway.keys["acme"])["choices"][0]["token_ids"]
    ids = logged["choices"][0]["token_ids"]
    assert ids == first[: len(ids)] and len(ids) >= 1


def test_max_completion_tokens_wins_and_length_is_reported(client: OpenAI, gateway: Gateway) -> None:
    reply = client.chat.completions.create(
        model=gateway.model, messages=HELLO, max_tokens=20, max_completion_tokens=2, temperature=0
    )
    assert reply.usage.completion_tokens <= 2
    if reply.usage.completion_tokens == 2:
        assert reply.choices[0].finish_reason == "length"


def test_session_key_user_and_metadata_are_logged(client: OpenAI, gateway: Gateway) -> None:
    by_header = client.chat.completions.create(
        model=gateway.model,
        messages=HELLO,
        max_tokens=2,
        user="alice",
        metadata={"session_id": "meta-session", "app": "test"},
        extra_headers={"X-Session-Id": "header-session"},
    )
    by_metadata = client.chat.completions.create(
        model=gateway.model, messages=HELLO, max_tokens=2, user="alice", metadata={"session_id": "meta-session"}
    )
    by_user = client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=2, user="bob")
    key = gateway.keys["acme"]
    first = completion_log(gateway, by_header.id, key)
    assert first["session_key"] == "header-session"
    assert first["end_user"] == "alice"
    assert first["metadata"] == {"session_id": "meta-session", "app": "test"}
    assert completion_log(gateway, by_metadata.id, key)["session_key"] == "meta-session"
    assert completion_log(gateway, by_user.id, key)["session_key"] == "bob"


def test_tool_messages_and_unknown_fields(client: OpenAI, gateway: Gateway) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    reply = client.chat.completions.create(
        model=gateway.model,
        messages=messages,
        max_tokens=2,
        extra_body={"top_k": 5, "some_future_field": {"x": 1}},
    )
    assert reply.choices[0].message.role == "assistant"
