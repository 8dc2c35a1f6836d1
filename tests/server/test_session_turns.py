"""A session's next prompt carries its previous reply token for token, as the model generated it."""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from server.prompt import PromptRenderer
from server.session_turns import Reply, SessionTurns, Turn
from tests.server.conftest import Gateway

KEY = ("tenant", "session")
FIRST = [{"role": "user", "content": "hello there"}]
REPLY_TEXT = "the answer is here"


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def renderer(tokenizer: PreTrainedTokenizerBase) -> PromptRenderer:
    return PromptRenderer(tokenizer, 2048)


def turns_for(renderer: PromptRenderer, tokenizer: PreTrainedTokenizerBase, capacity: int = 1 << 20) -> SessionTurns:
    def decode(ids: Any) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    return SessionTurns(renderer.render_closed, decode, {tokenizer.eos_token_id}, capacity)


def char_level_reply(tokenizer: PreTrainedTokenizerBase, text: str, *, end: bool = True) -> array:
    """The reply spelled one character per token: the same text, other ids than re-tokenising it."""
    ids = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ch)[0]) for ch in text]
    return array("l", ids + ([tokenizer.eos_token_id] if end else []))


async def first_turn(renderer: PromptRenderer, tokenizer: PreTrainedTokenizerBase, **kwargs: Any) -> Turn:
    conversation, prompt = await renderer.render_conversation(FIRST)
    generated = char_level_reply(tokenizer, REPLY_TEXT, **kwargs)
    return Turn(conversation, array("l", prompt), array("l", prompt), (Reply(REPLY_TEXT, generated),))


def second_conversation(reply: str = REPLY_TEXT) -> list[dict[str, Any]]:
    return [*FIRST, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]


async def test_the_next_prompt_holds_the_generated_ids_and_says_the_same_text(
    renderer: PromptRenderer, tokenizer: PreTrainedTokenizerBase
) -> None:
    turns = turns_for(renderer, tokenizer)
    turn = await first_turn(renderer, tokenizer)
    turns.remember(KEY, turn)
    conversation, rendered = await renderer.render_conversation(second_conversation())
    spliced = turns.splice(KEY, conversation, rendered)
    assert spliced is not None and spliced != rendered
    head = [*turn.prompt_ids, *turn.replies[0].token_ids]
    assert spliced[: len(head)] == head
    assert tokenizer.decode(spliced, skip_special_tokens=False) == tokenizer.decode(rendered, skip_special_tokens=False)
    assert spliced[len(head) :] == rendered[len(rendered) - len(spliced) + len(head) :]  # same tail


@pytest.mark.parametrize(
    ("key", "conversation"),
    [
        (("tenant", "other session"), second_conversation()),
        (("other tenant", "session"), second_conversation()),
        (KEY, second_conversation("an edited answer")),
        (KEY, [{"role": "user", "content": "another start"}, *second_conversation()[1:]]),
        (KEY, second_conversation()[:2]),  # nothing new after the reply
    ],
)
async def test_anything_but_an_unchanged_continuation_renders_plainly(
    renderer: PromptRenderer, tokenizer: PreTrainedTokenizerBase, key: tuple[str, str], conversation: list[Any]
) -> None:
    turns = turns_for(renderer, tokenizer)
    turns.remember(KEY, await first_turn(renderer, tokenizer))
    rendered = renderer.render_closed(conversation)
    assert turns.splice(key, conversation, rendered) is None


async def test_a_reply_cut_by_a_length_limit_is_closed_by_the_template(
    renderer: PromptRenderer, tokenizer: PreTrainedTokenizerBase
) -> None:
    turns = turns_for(renderer, tokenizer)
    turn = await first_turn(renderer, tokenizer, end=False)
    turns.remember(KEY, turn)
    conversation, rendered = await renderer.render_conversation(second_conversation())
    spliced = turns.splice(KEY, conversation, rendered)
    assert spliced is not None
    head = [*turn.prompt_ids, *turn.replies[0].token_ids]
    assert spliced[: len(head)] == head and spliced[len(head)] == tokenizer.eos_token_id  # the template's end
    assert tokenizer.decode(spliced, skip_special_tokens=False) == tokenizer.decode(rendered, skip_special_tokens=False)


async def test_a_reply_cut_by_a_stop_string_renders_plainly(
    renderer: PromptRenderer, tokenizer: PreTrainedTokenizerBase
) -> None:
    turns = turns_for(renderer, tokenizer)
    conversation, prompt = await renderer.render_conversation(FIRST)
    generated = char_level_reply(tokenizer, REPLY_TEXT + " STOP and more", end=False)  # the client saw less
    turns.remember(KEY, Turn(conversation, array("l", prompt), array("l", prompt), (Reply(REPLY_TEXT, generated),)))
    conversation, rendered = await renderer.render_conversation(second_conversation())
    assert turns.splice(KEY, conversation, rendered) is None


async def test_turns_are_bounded_by_tokens_held(renderer: PromptRenderer, tokenizer: PreTrainedTokenizerBase) -> None:
    turn = await first_turn(renderer, tokenizer)
    turns = turns_for(renderer, tokenizer, capacity=2 * turn.tokens)
    for session in ("a", "b", "c"):
        turns.remember(("t", session), turn)
    assert len(turns) == 2
    conversation, rendered = await renderer.render_conversation(second_conversation())
    assert turns.splice(("t", "a"), conversation, rendered) is None  # the oldest went first
    assert turns.splice(("t", "c"), conversation, rendered) is not None


def test_a_sessions_second_turn_reuses_the_whole_first_turn(client: OpenAI, gateway: Gateway) -> None:
    # The tiny model answers this in 4 tokens and stops itself; re-tokenising its answer gives other ids.
    history: list[dict[str, Any]] = [{"role": "user", "content": "your of 33"}]
    session = {"X-Session-Id": "splice-1"}
    first = client.chat.completions.create(
        model=gateway.model, messages=history, max_tokens=40, temperature=0, extra_headers=session
    )
    assert first.choices[0].finish_reason == "stop"
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and what else?"},
    ]
    second = client.chat.completions.create(
        model=gateway.model, messages=history, max_tokens=4, temperature=0, extra_headers=session
    )
    logged = [logged_completion(gateway, reply.id) for reply in (first, second)]
    generated = [*logged[0]["prompt_token_ids"], *logged[0]["choices"][0]["token_ids"]]
    assert logged[1]["prompt_token_ids"][: len(generated)] == generated
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= len(generated) - 1


def logged_completion(gateway: Gateway, completion_id: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {gateway.keys['acme']}"}
    response = httpx.get(f"{gateway.url}/v1/completions/{completion_id}", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()
