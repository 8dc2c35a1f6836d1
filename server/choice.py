"""One choice of a chat completion as it is assembled: token ids, visible text, weight spans."""

from __future__ import annotations

from typing import Any

from tokenizers import decoders
from transformers import PreTrainedTokenizerBase

from server.detokenizer import IncrementalDetokenizer, decode_text
from server.engines.base import Finish, TokenChunk
from storage.records import ChoiceRecord, WeightSpan
from tandem.text import holdback

# orjson writes -inf as null; OpenAI clients expect a number.
_MIN_LOGPROB = -9999.0


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: printable stand-in character -> the byte it spells."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    decoder = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            decoder[chr(256 + shifted)] = b
            shifted += 1
    return decoder


class ChoiceState:
    """Folds engine chunks into the ids and logprobs to log and the text the client may see.

    The visible text is cut before the first stop string (OpenAI semantics) and, while streaming,
    a tail that may turn into a stop string is held back; the logged ids stay as generated.
    Without ``incremental`` (no stream to feed) the text is decoded once, at the finish.
    """

    def __init__(
        self, index: int, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...], *, incremental: bool
    ) -> None:
        self.index = index
        self._tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer) if incremental else None
        self._text = ""
        self._stops = stops
        self._sent = 0
        self._cut = False
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.spans: list[WeightSpan] = []
        self.cached_tokens = 0
        self.routed_experts: list[list[int]] | None = None  # asked for by a rollout (tandem.moe_routing)
        self.replica: str | None = None
        self.finish: Finish | None = None

    @property
    def weight_version(self) -> str | None:
        return self.spans[0].version if self.spans else None

    @property
    def aborted(self) -> bool:
        return self.finish is not None and self.finish.type == "abort"

    @property
    def abort_message(self) -> str:
        return (self.finish.message if self.finish else None) or "aborted"

    @property
    def finish_reason(self) -> str:
        return "length" if self.finish is not None and self.finish.type == "length" else "stop"

    @property
    def visible_text(self) -> str:
        return self._text[: self._sent]

    def add(self, chunk: TokenChunk) -> str:
        """Take one chunk; return the newly visible text."""
        if not self.token_ids and not self.spans:
            self.cached_tokens = chunk.cached_tokens
            self.replica = chunk.replica
        start = len(self.token_ids)
        if chunk.token_ids:
            self.token_ids.extend(chunk.token_ids)
            self.logprobs.extend(chunk.logprobs)
            self.top_logprobs.extend(chunk.top_logprobs)
            last = self.spans[-1] if self.spans else None
            if last is not None and last.version == chunk.weight_version and last.end == start:
                last.end = len(self.token_ids)
            else:
                self.spans.append(WeightSpan(chunk.weight_version, start, len(self.token_ids)))
            if self._detok is not None:
                self._detok.push(chunk.token_ids)
        if chunk.finish is not None:
            self.finish = chunk.finish
            self.routed_experts = chunk.routed_experts
            if self._detok is not None:
                self._detok.flush()
            else:
                self._text = decode_text(self._tokenizer, self.token_ids, skip_special_tokens=True)
        if self._detok is not None:
            self._text = self._detok.text
        return self._release(final=chunk.finish is not None)

    def _release(self, *, final: bool) -> str:
        if self._cut:
            return ""
        text = self._text
        end = len(text)
        if self._stops:
            # A stop string cannot start before what was sent: its prefix would have been held back.
            hits = [i for i in (text.find(s, self._sent) for s in self._stops) if i >= 0]
            if hits:
                end, self._cut = min(hits), True
            elif not final:
                end -= holdback(text, self._stops)
        delta = text[self._sent : end]
        self._sent = max(end, self._sent)
        return delta

    def record(self) -> ChoiceRecord:
        return ChoiceRecord(
            index=self.index,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            text=self.visible_text,
            finish_reason=self.finish.type if self.finish is not None else "abort",
            weight_versions=self.spans,
        )


class TokenText:
    """Token id -> (text, bytes) for OpenAI's logprobs entries, memoised per id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # Byte-level BPE tokens spell their exact bytes; other tokenizers fall back to decoding.
        self._byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
        self._byte_decoder = _byte_level_decoder()
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw: bytes | None = None
        if self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._byte_decoder for c in piece):
                raw = bytes(self._byte_decoder[c] for c in piece)
        if raw is None:
            raw = decode_text(self._tokenizer, [token_id]).encode()
        entry = (raw.decode(errors="replace"), list(raw))
        self._cache[token_id] = entry
        return entry

    def _top(self, pairs: list[tuple[int, float]]) -> list[dict[str, Any]]:
        out = []
        for token_id, logprob in pairs:
            text, raw = self(token_id)
            out.append({"token": text, "logprob": max(logprob, _MIN_LOGPROB), "bytes": raw})
        return out

    def entries(self, state: ChoiceState, start: int, end: int) -> list[dict[str, Any]]:
        """OpenAI ``logprobs.content`` entries for output tokens [start, end) of a choice."""
        out = []
        tops = state.top_logprobs
        for i in range(start, end):
            text, raw = self(state.token_ids[i])
            out.append(
                {
                    "token": text,
                    "logprob": max(state.logprobs[i], _MIN_LOGPROB),
                    "bytes": raw,
                    "top_logprobs": self._top(tops[i]) if i < len(tops) else [],
                }
            )
        return out
