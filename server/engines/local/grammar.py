"""JSON-schema constrained decoding for the local engine, with llguidance.

A request with ``SamplingParams.json_schema`` gets a matcher that follows its output token by token;
before each sampling step the matcher says which tokens may come next, as a bitmask over the
vocabulary, and every other token's logit is set to -inf. So the output always parses and matches
the schema (unless it runs out of ``max_new_tokens``), whatever the weights.

Why llguidance over xgrammar (both on PyPI, both in SGLang), measured on this CPU with SmolLM2's
tokenizer (benchmarks/grammar_libraries.py): a two-tool schema compiles in 0.7 ms against 181 ms,
and tool schemas change from request to request; either library's per-token mask costs next to
nothing beside a forward pass (15 us and 2 us), and llguidance computes it with the GIL released.

Each schema is compiled once (``GrammarCache``) and every request starts from a copy of that matcher.
The masks of a decode step are computed on a helper thread while the model runs its forward pass
(``MaskFiller``): the mask of step t+1 only depends on the tokens up to step t.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence as Rows
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from cachetools import LRUCache

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON: no whitespace between tokens, which a random or small model would otherwise fill
# (newlines and spaces are valid JSON, and a weak model loves them); the separators OpenAI's use.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMARS_CACHED = 256


class GrammarError(ValueError):
    """The schema cannot be turned into a grammar (the message says why)."""


class GrammarCache:
    """Compiled matchers per schema text; the llguidance tokenizer is built on first use (~1 s)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Rows[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: LRUCache[str, llguidance.LLMatcher] = LRUCache(GRAMMARS_CACHED)
        self._lock = threading.Lock()  # requests arrive on worker threads

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
            )
        return self._tokenizer

    def matcher(self, schema: str) -> llguidance.LLMatcher:
        """A fresh matcher for ``schema`` (a JSON Schema as text); raises GrammarError."""
        with self._lock:
            compiled = self._compiled.get(schema)
            if compiled is None:
                compiled = self._compile(schema)
                self._compiled[schema] = compiled
            return compiled.deep_copy()

    def _compile(self, schema: str) -> llguidance.LLMatcher:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema cannot be read: {exc}") from exc
        matcher = llguidance.LLMatcher(self._lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the JSON schema cannot be enforced: {matcher.get_error()}")
        return matcher


class MaskFiller:
    """Computes the allowed-token masks of one step on a helper thread (llguidance drops the GIL)."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size
        self._executor = llguidance.LLExecutor()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    def start(self, matchers: list[llguidance.LLMatcher | None]) -> Future[torch.Tensor | None]:
        """The masks for rows with a matcher (None when no row has one), computed in the background."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            done: Future[torch.Tensor | None] = Future()
            done.set_result(None)
            return done
        return self._thread.submit(self._fill, rows, len(matchers))

    def _fill(self, rows: list[tuple[llguidance.LLMatcher, int]], batch: int) -> torch.Tensor:
        bitmask = llguidance.torch.allocate_token_bitmask(batch, self._vocab_size)  # all allowed
        llguidance.torch.fill_next_token_bitmask_par(self._executor, rows, bitmask)
        return unpack_bitmask(bitmask, self._vocab_size)

    def close(self) -> None:
        self._thread.shutdown(wait=False)


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[batch, words] int32, bit j of word w allowing token 32w+j -> [batch, vocab_size] bool."""
    bits = (bitmask[:, :, None] >> _BITS) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
