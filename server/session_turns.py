"""Next-turn prompts that contain the previous reply as the model generated it, token for token.

A client sends the whole history again each turn, and re-tokenising a reply's text need not give the
ids the model produced (byte-level BPE merges differently). Then the next prompt diverges from the
engine's cached prefix inside the previous reply, and the learner would see a prompt the policy
never produced. When a session's new messages extend its last turn with that turn's reply unchanged,
the new prompt is spliced from the last prompt, the generated ids and the template's rendering of
what follows; anything else (an edited reply, a reply cut by a stop string, another history) falls
back to plain rendering, as does any splice whose text would differ from plain rendering.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Conversation = list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Reply:
    text: str  # what the client saw, and will send back as the assistant message
    token_ids: array[int]  # as generated, ending with the end-of-turn token when the model stopped itself


@dataclass(frozen=True, slots=True)
class Turn:
    conversation: Conversation  # the messages the prompt was rendered from
    prompt_ids: array[int]  # what the engine got (itself spliced when the turn before was)
    rendered_ids: array[int]  # the template's plain rendering of ``conversation``
    replies: tuple[Reply, ...]  # one per choice

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.rendered_ids) + sum(len(r.token_ids) for r in self.replies)


class SessionTurns:
    """The last turn of each session, least recently used first out, bounded in tokens held.

    ``render_closed`` renders a conversation ending with an assistant message, without a generation
    prompt; ``decode`` turns ids into text with special tokens kept, to check a splice says exactly
    what plain rendering says.
    """

    def __init__(
        self,
        render_closed: Callable[[Conversation], list[int]],
        decode: Callable[[Sequence[int]], str],
        end_of_turn_ids: set[int],
        capacity_tokens: int = 8 << 20,
    ) -> None:
        self._render_closed = render_closed
        self._decode = decode
        self._end_ids = end_of_turn_ids
        self._capacity = capacity_tokens
        self._turns: OrderedDict[tuple[str, str], Turn] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._turns)

    def remember(self, key: tuple[str, str], turn: Turn) -> None:
        self._forget(key)
        if turn.tokens > self._capacity:
            return
        self._turns[key] = turn
        self._tokens += turn.tokens
        while self._tokens > self._capacity:
            self._forget(next(iter(self._turns)))

    def _forget(self, key: tuple[str, str]) -> None:
        old = self._turns.pop(key, None)
        if old is not None:
            self._tokens -= old.tokens

    def splice(self, key: tuple[str, str], conversation: Conversation, rendered: list[int]) -> list[int] | None:
        """The prompt with the last turn's generated reply in place, or None to use ``rendered``."""
        last = self._turns.get(key)
        if last is None:
            return None
        self._turns.move_to_end(key)
        n = len(last.conversation)
        if len(conversation) <= n + 1 or conversation[:n] != last.conversation:
            return None
        reply = conversation[n]
        chosen = next((r for r in last.replies if reply == {"role": "assistant", "content": r.text}), None)
        if chosen is None or not chosen.token_ids:
            return None
        closed = self._render_closed(conversation[: n + 1])
        before = list(last.rendered_ids)
        if closed[: len(before)] != before or rendered[: len(closed)] != closed:
            return None  # the template does not render this conversation as a growing prefix
        # The template closes the reply with an end-of-turn token; the model wrote that token itself
        # when it stopped on its own, and not when a length limit cut it.
        reply_rendered = closed[len(before) :]
        end = next((i for i, token in enumerate(reply_rendered) if token in self._end_ids), None)
        if end is None:
            return None
        closed_by_model = chosen.token_ids[-1] in self._end_ids
        after_reply = reply_rendered[end + 1 if closed_by_model else end :]
        spliced = [*last.prompt_ids, *chosen.token_ids, *after_reply, *rendered[len(closed) :]]
        # The same text as plain rendering, only tokenised as the model did: else do not use it.
        return spliced if self._decode(spliced) == self._decode(rendered) else None
