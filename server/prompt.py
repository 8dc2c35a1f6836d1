"""Chat messages -> prompt token ids, rendered once through the model's chat template."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from server.errors import ApiError
from server.schemas import AssistantMessage, Content, Message, ToolMessage

# Longer conversations are tokenised on the renderer's threads so one big prompt does not stall the
# event loop (the tokenizer's batch encode releases the GIL; its single encode does not).
_INLINE_CHARS = 8_192
TOKENIZE_THREADS = 2


def content_text(content: Content | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part.text for part in content)


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token stands for: a vocabulary entry is never shorter than its text
    (byte-level entries spell one byte per character, sentencepiece ones one character each)."""
    return max(len(token) for token in tokenizer.get_vocab())


def template_message(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": content_text(message.content)}
    if isinstance(message, AssistantMessage) and message.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
    return out


class PromptRenderer:
    """Renders a conversation with the tokenizer's chat template and checks it fits the context."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, context_length: int) -> None:
        if not tokenizer.chat_template:
            raise ValueError(f"the tokenizer of {tokenizer.name_or_path!r} has no chat template")
        self.tokenizer = tokenizer
        self.context_length = context_length
        self._template = tokenizer.get_chat_template()
        self._template_vars: dict[str, Any] = dict(tokenizer.special_tokens_map)  # bos_token and the like
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._control = tuple(token.content for token in tokenizer.added_tokens_decoder.values())
        # More characters than this cannot fit the context, whatever they are: refused before the
        # tokenizer spends seconds on them (a 4 MB prompt took 5-18 s and stalled other requests).
        self.max_prompt_chars = context_length * longest_token_chars(tokenizer)
        self._threads = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")

    def render_closed(self, conversation: list[dict[str, Any]]) -> list[int]:
        """Ids of a conversation that ends with an assistant message (no generation prompt)."""
        return self._render(conversation, generation_prompt=False)

    def _render(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[Any, Any]] | None = None,
        *,
        generation_prompt: bool = True,
    ) -> list[int]:
        try:
            blob = orjson.dumps([conversation, tools]).decode()
            if self._backend is not None and not any(token in blob for token in self._control):
                # The common case, no control token typed by the user: render and encode directly,
                # the same ids as apply_chat_template at a third of its cost.
                # (texts, generation indices); transformers' annotation says str.
                rendered: tuple[list[str], Any] = render_jinja_template(  # type: ignore[assignment]
                    conversations=[conversation],
                    tools=list(tools) if tools else None,
                    chat_template=self._template,
                    add_generation_prompt=generation_prompt,
                    **self._template_vars,
                )
                encoded: list[int] = self._backend.encode_batch(rendered[0], add_special_tokens=False)[0].ids
                return encoded
            ids = self.tokenizer.apply_chat_template(
                conversation,
                tools=list(tools) if tools else None,
                add_generation_prompt=generation_prompt,
                tokenize=True,
                return_dict=False,
                # Control tokens typed by a user stay plain text: only the template writes them.
                sanitize_control_tokens=True,
            )
        except Exception as exc:  # the template's own checks (jinja raise_exception) end up here
            raise ApiError(400, f"The chat template rejected these messages: {exc}", param="messages") from exc
        return list(ids)

    @property
    def chat_template(self) -> str:
        return self._template

    async def render(self, messages: list[Message]) -> tuple[list[dict[str, Any]], list[int]]:
        """The messages as the template saw them, and the prompt token ids."""
        return await self.render_conversation([template_message(m) for m in messages])

    async def render_conversation(
        self, conversation: list[dict[str, Any]], tools: list[dict[Any, Any]] | None = None
    ) -> tuple[list[dict[str, Any]], list[int]]:
        """``tools``: function tools in OpenAI's form, for a template that renders them."""
        size = sum(len(m["content"]) for m in conversation) + (len(orjson.dumps(tools)) if tools else 0)
        if size > self.max_prompt_chars:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.context_length} tokens. However, your messages "
                f"have {size} characters, more than {self.max_prompt_chars} (the most that can fit). "
                "Please reduce the length of the messages.",
                param="messages",
                code="context_length_exceeded",
            )
        if size <= _INLINE_CHARS:
            ids = self._render(conversation, tools)
        else:
            ids = await asyncio.get_running_loop().run_in_executor(self._threads, self._render, conversation, tools)
        if len(ids) >= self.context_length:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.context_length} tokens. However, your "
                f"messages resulted in {len(ids)} tokens. Please reduce the length of the messages.",
                param="messages",
                code="context_length_exceeded",
            )
        return conversation, ids

    def max_new_tokens(self, prompt_tokens: int, requested: int | None) -> int:
        """The completion budget: what was asked for, else whatever the context has left."""
        room = self.context_length - prompt_tokens
        if requested is None:
            return room
        if requested > room:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.context_length} tokens. However, you "
                f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages or completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested
