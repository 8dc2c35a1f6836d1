"""A prompt that cannot fit is refused from its length in characters, before the tokenizer runs.

The drill sent four chats of 3.9 M characters: each took 5-18 s to tokenise before its 400, and
meanwhile /health took up to 8.5 s and other tenants' chats up to 12.6 s.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from server.errors import ApiError
from server.prompt import PromptRenderer, longest_token_chars

CONTEXT = 2048


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def renderer(tokenizer: PreTrainedTokenizerBase) -> PromptRenderer:
    return PromptRenderer(tokenizer, CONTEXT)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def test_a_prompt_longer_than_can_fit_is_refused_without_tokenising_it(
    renderer: PromptRenderer, tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    def tokenise(*_: object, **__: object) -> None:
        raise AssertionError("the tokenizer ran on a prompt that cannot fit")

    monkeypatch.setattr(renderer, "_render", tokenise)
    started = time.perf_counter()
    with pytest.raises(ApiError) as refused:
        await renderer.render_conversation(user("a" * 3_900_000))
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"
    assert "characters" in refused.value.message
    assert time.perf_counter() - started < 0.5


async def test_a_prompt_within_the_character_bound_is_measured_in_tokens(renderer: PromptRenderer) -> None:
    with pytest.raises(ApiError) as refused:
        await renderer.render_conversation(user("a" * renderer.max_prompt_chars))
    assert "tokens" in refused.value.message and "characters" not in refused.value.message


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=400))
def test_no_text_has_more_characters_than_its_tokens_can_spell(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(text) <= len(ids) * longest_token_chars(tokenizer)
