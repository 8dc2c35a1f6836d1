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
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup

from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway

EXAMPLES_PER_OPERATION = 25
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzzed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    settings_ = gateway_settings(tmp_path_factory.mktemp("fuzz"), tiny_model, admin_key=ADMIN_KEY)
    with run_gateway(settings_, tenants=("fuzz",)) as gateway:
        yield gateway


FUZZ = settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: the failure as found is reported
)


def fuzz(operation: Any, gateway: Gateway, key: str | None) -> None:
    """``EXAMPLES_PER_OPERATION`` cases of the operation, valid and invalid, each called and validated."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    cases = st.one_of(operation.as_strategy(mode) for mode in GenerationMode)

    @FUZZ
    @given(case=cases)
    def check(case: Any) -> None:
        case.call_and_validate(base_url=gateway.url, headers=headers, checks=CHECKS, timeout=60)

    check()


# schemathesis's pytest plugin does not run under pytest 9; its strategies, driven here, do.
@pytest.mark.parametrize("caller", ["admin", "tenant", "anonymous"])
def test_no_5xx_and_answers_match_their_schema(fuzzed: Gateway, caller: str) -> None:
    key = {"admin": ADMIN_KEY, "tenant": fuzzed.keys["fuzz"], "anonymous": None}[caller]
    api = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    failures = []
    for loaded in api.get_all_operations():
        operation = loaded.ok()
        try:
            fuzz(operation, fuzzed, key)
        except (Exception, FailureGroup) as exc:  # every operation is fuzzed; the report lists each failed
            failures.append(f"{operation.label}: {str(exc)[:1500]}")
    assert not failures, f"{len(failures)} operations failed:\n\n" + "\n\n".join(failures)
