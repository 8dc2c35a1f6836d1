"""xgrammar against llguidance on one tokenizer: what a JSON-schema grammar costs each, on this CPU.

    <python with both installed> benchmarks/grammar_libraries.py MODEL_FOLDER [--steps 200]

Run by benchmarks/grammar_decode.py with SGLang's venv (which ships both libraries); standalone it
needs only transformers, torch, xgrammar and llguidance. For each library: the one-off tokenizer
set-up, compiling a typical tool-call schema, computing one token's mask along a valid answer
(median), and applying a batch of 8 masks to fp32 logits. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar
from transformers import AutoConfig, AutoTokenizer

SCHEMA = {
    "type": "array",
    "minItems": 1,
    "maxItems": 8,
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": "get_weather"},
                    "arguments": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 40},
                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                            "days": {"type": "integer", "minimum": 1, "maximum": 14},
                        },
                        "required": ["city", "unit", "days"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {
                    "name": {"const": "search"},
                    "arguments": {
                        "type": "object",
                        "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
                        "required": ["query"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            },
        ]
    },
}
ANSWER = (
    '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}, '
    '{"name": "search", "arguments": {"query": "museums open on Monday in Paris", "top_k": 5}}]'
)
BATCH = 8


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1000, out


def llguidance_costs(tokenizer: Any, vocab: int, tokens: list[int], repeats: int) -> dict[str, float]:
    setup_ms, lltok = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    compile_ms = statistics.median(
        timed(
            lambda: llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=options))
        )[0]  # type: ignore[arg-type]
        for _ in range(repeats)
    )
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=options))  # type: ignore[arg-type]
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    steps = []
    for token in tokens:
        steps.append(timed(lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0))[0])
        assert matcher.consume_token(token), matcher.get_error()
    logits = torch.randn(BATCH, vocab)
    masks = llguidance.torch.allocate_token_bitmask(BATCH, vocab)
    bits = torch.arange(32, dtype=torch.int32)

    def apply() -> None:  # as server/engines/local/grammar.py does: unpack, then masked_fill
        allowed = ((masks[:, :, None] >> bits) & 1).reshape(BATCH, -1)[:, :vocab].bool()
        logits.masked_fill(~allowed, float("-inf"))

    apply_ms = statistics.median(timed(apply)[0] for _ in range(repeats))
    return {"setup_ms": setup_ms, "compile_ms": compile_ms, "mask_ms": statistics.median(steps), "apply8_ms": apply_ms}


def xgrammar_costs(tokenizer: Any, vocab: int, tokens: list[int], repeats: int) -> dict[str, float]:
    setup_ms, info = timed(lambda: xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    schema = json.dumps(SCHEMA)

    def compile_fresh() -> Any:
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        return compiler.compile_json_schema(schema, any_whitespace=False)

    compile_ms = statistics.median(timed(compile_fresh)[0] for _ in range(repeats))
    matcher = xgrammar.GrammarMatcher(compile_fresh())
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    steps = []
    for token in tokens:
        steps.append(timed(lambda: matcher.fill_next_token_bitmask(bitmask, 0))[0])
        assert matcher.accept_token(token)
    logits = torch.randn(BATCH, vocab)
    masks = xgrammar.allocate_token_bitmask(BATCH, vocab)
    apply_ms = statistics.median(
        timed(lambda: xgrammar.apply_token_bitmask_inplace(logits, masks))[0] for _ in range(repeats)
    )
    return {"setup_ms": setup_ms, "compile_ms": compile_ms, "mask_ms": statistics.median(steps), "apply8_ms": apply_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a Hugging Face model folder (its tokenizer and vocabulary size)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = int(AutoConfig.from_pretrained(args.model).vocab_size)
    tokens = tokenizer.encode(ANSWER, add_special_tokens=False)
    result = {
        "tokens": len(tokens),
        "llguidance": llguidance_costs(tokenizer, vocab, tokens, args.repeats),
        "xgrammar": xgrammar_costs(tokenizer, vocab, tokens, args.repeats),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
