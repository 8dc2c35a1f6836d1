"""/openapi.json says what the API does, so a schema-based client or fuzzer can rely on it: media types,
every status a route answers, and the rules that tie one field to another."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from server.metrics import CONTENT_TYPE
from tests.server.conftest import Gateway


@pytest.fixture(scope="module")
def openapi(gateway: Gateway) -> dict[str, Any]:
    return httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()


def request_schema(openapi: dict[str, Any], path: str) -> dict[str, Any]:
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return openapi["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_metrics_is_documented_as_prometheus_text(openapi: dict[str, Any], gateway: Gateway) -> None:
    content = openapi["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == [CONTENT_TYPE]
    assert content[CONTENT_TYPE]["schema"] == {"type": "string"}


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("post", "/admin/tenants"),
        ("post", "/admin/schedules"),
        ("patch", "/admin/schedules/{schedule_id}"),
        ("post", "/admin/runs/{round_id}/cancel"),
        ("post", "/admin/models/{version_id}/promote"),
        ("post", "/admin/models/{version_id}/rollback"),
        ("post", "/admin/engines/{replica}/drain"),
        ("post", "/admin/weights"),
    ],
)
def test_conflicts_are_documented(openapi: dict[str, Any], method: str, path: str) -> None:
    assert "409" in openapi["paths"][path][method]["responses"]


def test_weights_source_rules_are_in_the_schema(openapi: dict[str, Any]) -> None:
    [rule] = request_schema(openapi, "/admin/weights")["allOf"]
    assert rule["if"] == {"properties": {"source": {"const": "delta"}}, "required": ["source"]}
    assert rule["then"]["required"] == ["delta_path"]
    assert rule["else"]["required"] == ["model_path", "weight_version"]  # so {} is invalid
    assert rule["else"]["not"]["required"] == ["delta_path"]


def test_top_logprobs_needs_logprobs_in_the_schema(openapi: dict[str, Any]) -> None:
    [rule] = request_schema(openapi, "/v1/chat/completions")["allOf"]
    assert rule["if"]["required"] == ["top_logprobs"]
    assert rule["if"]["properties"]["top_logprobs"]["minimum"] == 1
    assert rule["then"] == {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}


def test_feedback_takes_exactly_one_of_rating_or_score_in_the_schema(openapi: dict[str, Any]) -> None:
    assert [option["required"] for option in request_schema(openapi, "/v1/feedback")["oneOf"]] == [
        ["rating"],
        ["score"],
    ]


def test_every_operation_documents_its_answer_with_a_schema(openapi: dict[str, Any]) -> None:
    """Each operation of the full app (admin API included) has a 2xx answer with a media type and a
    schema that says something (``{}`` is what a route without a response model gets)."""
    components = openapi["components"]["schemas"]
    operations = [(method.upper(), path, op) for path, ops in openapi["paths"].items() for method, op in ops.items()]
    assert {"/v1/chat/completions", "/admin/keys", "/admin/schedules", "/metrics"} <= set(openapi["paths"])
    assert len(operations) >= 48
    undocumented = []
    for method, path, op in operations:
        answers = [answer for status, answer in op["responses"].items() if status.startswith("2")]
        contents = [content for answer in answers for content in answer.get("content", {}).values()]
        schemas = [content.get("schema") for content in contents]
        if not answers or len(contents) < len(answers) or not all(schemas):
            undocumented.append(f"{method} {path}")
        for schema in schemas:
            if schema and "$ref" in schema:
                assert schema["$ref"].rsplit("/", 1)[1] in components, f"{method} {path}: {schema['$ref']}"
    assert undocumented == []
