"""The local engine's JSON-schema constraint: every output matches, the logprobs are the constrained
distribution's, grammars are compiled once per schema, and a schema no grammar can hold is a 400."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from server.engines.base import EngineError, SamplingParams
from server.engines.local.engine import LocalEngine
from server.engines.local.grammar import GrammarCache, unpack_bitmask
from tests.server.engines.helpers import collect, reference_logprobs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"type": "integer", "minimum": -5, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "score", "ok"],
    "additionalProperties": False,
}
PROMPT = [1, 5, 9, 13, 2]


def sampling(seed: int, schema: dict[str, object] = SCHEMA, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=300, seed=seed, json_schema=json.dumps(schema), **kwargs)  # type: ignore[arg-type]


async def test_every_sampled_output_matches_the_schema(engine: LocalEngine, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    results = []
    for batch in range(0, 100, 8):  # the engine queues at most 16
        results += await asyncio.gather(*(collect(engine, PROMPT, sampling(seed)) for seed in range(batch, batch + 8)))
    results = results[:100]
    for result in results:
        assert result.finish is not None and result.finish.type == "stop", result
        jsonschema.validate(json.loads(tokenizer.decode(result.token_ids)), SCHEMA)
    assert len({tuple(r.token_ids) for r in results}) > 90  # sampled, not one forced answer


async def test_logprobs_are_the_constrained_distributions(engine: LocalEngine, tiny_model: Path) -> None:
    result = await collect(engine, PROMPT, sampling(0, temperature=0))
    free = reference_logprobs(tiny_model, PROMPT, result.token_ids)
    # Renormalised over the allowed tokens: never below the free model's, and the forced
    # opening brace (the only token allowed) is certain.
    assert result.logprobs[0] == pytest.approx(0.0, abs=1e-6)
    assert all(c >= f - 1e-4 for c, f in zip(result.logprobs, free, strict=True))
    assert any(c > f + 1e-3 for c, f in zip(result.logprobs, free, strict=True))


async def test_requests_with_and_without_a_schema_share_the_batch(engine: LocalEngine) -> None:
    free = SamplingParams(max_new_tokens=20, seed=1, ignore_eos=True)
    plain_alone = await collect(engine, PROMPT, free)
    plain, shaped = await asyncio.gather(collect(engine, PROMPT, free), collect(engine, PROMPT, sampling(3)))
    assert plain.token_ids == plain_alone.token_ids  # the neighbour's mask touches its own row only
    assert shaped.finish is not None and shaped.finish.type == "stop"


@pytest.mark.parametrize(
    "schema",
    [{"type": "string", "pattern": "(?<=a)b"}, {"type": "object", "properties": {"a": {"type": "nope"}}}],
)
async def test_a_schema_no_grammar_can_hold_is_400(engine: LocalEngine, schema: dict[str, object]) -> None:
    with pytest.raises(EngineError) as caught:
        await collect(engine, PROMPT, sampling(0, schema))
    assert caught.value.status == 400 and "JSON schema" in str(caught.value)


def test_a_schema_is_compiled_once(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    cache, text = GrammarCache(tokenizer, 2048, [2]), json.dumps(SCHEMA)
    first = cache.matcher(text)
    start = first.compute_bitmask()
    assert first.consume_token(tokenizer.convert_tokens_to_ids("{"))
    assert first.compute_bitmask() != start
    second = cache.matcher(text)  # a copy of the compiled grammar at its start, not first's state
    assert second is not first and second.compute_bitmask() == start
    assert list(cache._compiled) == [text]


def test_unpack_bitmask() -> None:
    bitmask = torch.tensor([[0b101, -1], [0, -(2**31)]], dtype=torch.int32)
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, *range(32, 40)]
    assert allowed[1].nonzero().flatten().tolist() == []  # bit 31 of word 1 is token 63, past the vocab
    assert bool(unpack_bitmask(torch.tensor([[-(2**31)]], dtype=torch.int32), 32)[0, 31])  # the sign bit
