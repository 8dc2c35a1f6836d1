"""Every operation of /openapi.json fuzzed by schemathesis against a live gateway (admin API included),
with the admin key, a tenant's key and no key: valid and invalid bodies, parameters and ids, bounded
examples per operation. No answer is a 5xx (an outside run once found bad ids answered as a database
outage), and every answer matches the schema its route declares (status code, content type, body).

The gateway is this module's own: the admin key's fuzzing creates, revokes and deletes at random.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway

EXAMPLES_PER_OPERATION = 12
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzzed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    settings_ = gateway_settings(tmp_path_factory.mktemp("fuzz"), tiny_model, admin_key=ADMIN_KEY)
    with run_gateway(settings_, tenants=("fuzz",)) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def api_schema(fuzzed: Gateway) -> Any:
    return schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.parametrize("caller", ["admin", "tenant", "anonymous"])
@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_no_5xx_and_answers_match_their_schema(case: Any, caller: str, fuzzed: Gateway) -> None:
    keys = {"admin": ADMIN_KEY, "tenant": fuzzed.keys["fuzz"], "anonymous": None}
    headers = {"Authorization": f"Bearer {keys[caller]}"} if keys[caller] else {}
    case.call_and_validate(base_url=fuzzed.url, headers=headers, checks=CHECKS, timeout=60)
