"""Field mapping of SGLang 0.5.23's native ``/generate`` API, shared by our client and our server.

See shared/reference/sglang-http-api.md: ``sampling_params`` keys, ``meta_info.finish_reason``
shapes, ``output_token_logprobs`` as ``[logprob, token_id, text]`` and ``weight_versions`` spans
over output-token indices.
"""

from __future__ import annotations

from typing import Any

from server.engines.base import Finish, SamplingParams, TokenChunk

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when a request names none


def sampling_to_json(sampling: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "ignore_eos": sampling.ignore_eos,
        # Token in, token out: the gateway detokenizes, and special tokens must stay visible to stop matching.
        "skip_special_tokens": False,
    }
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        body["sampling_seed"] = sampling.seed
    if sampling.json_schema is not None:
        body["json_schema"] = sampling.json_schema
    return body


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """A JSON boolean field; anything else (the string "false", 0, null) is refused, not coerced."""
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, not {value!r}")
    return value


def sampling_from_json(body: dict[str, Any], top_logprobs: int = 0) -> SamplingParams:
    """Parse ``sampling_params``; raises ValueError/TypeError with a readable message on bad input."""
    for grammar in ("regex", "ebnf", "structural_tag"):
        if body.get(grammar) is not None:
            raise ValueError(f"sampling_params.{grammar} is not supported by this engine: send json_schema")
    schema = body.get("json_schema")
    if schema is not None and not isinstance(schema, str):
        raise ValueError("sampling_params.json_schema must be a JSON Schema as a string, as SGLang takes it")
    stop = body.get("stop") or ()
    return SamplingParams(
        max_new_tokens=int(body.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
        temperature=float(body.get("temperature", 1.0)),
        top_p=float(body.get("top_p", 1.0)),
        top_k=int(body.get("top_k", -1)),
        stop=(stop,) if isinstance(stop, str) else tuple(str(s) for s in stop),
        stop_token_ids=tuple(int(t) for t in body.get("stop_token_ids") or ()),
        seed=None if body.get("sampling_seed") is None else int(body["sampling_seed"]),
        top_logprobs=top_logprobs,
        ignore_eos=flag(body, "ignore_eos"),
        json_schema=schema,
    )


def finish_to_json(finish: Finish | None, completion_tokens: int) -> dict[str, Any] | None:
    if finish is None:
        return None
    if finish.type == "length":
        return {"type": "length", "length": completion_tokens}
    if finish.type == "abort":
        return {"type": "abort", "message": finish.message, "status_code": 503, "err_type": "abort"}
    return {"type": "stop", "matched": finish.matched}


def finish_from_json(data: dict[str, Any] | None) -> Finish | None:
    if not data:
        return None
    kind = data.get("type")
    if kind == "length":
        return Finish("length")
    if kind == "stop":
        return Finish("stop", matched=data.get("matched"))
    return Finish("abort", message=str(data.get("message") or "aborted by the engine"))


def spans_to_json(chunks: list[TokenChunk]) -> list[dict[str, Any]]:
    """Which weight version produced which output tokens, merged into runs."""
    spans: list[dict[str, Any]] = []
    position = 0
    for chunk in chunks:
        if not chunk.token_ids:
            continue
        end = position + len(chunk.token_ids)
        if spans and spans[-1]["version"] == chunk.weight_version:
            spans[-1]["end"] = end
        else:
            spans.append({"version": chunk.weight_version, "start": position, "end": end})
        position = end
    return spans
