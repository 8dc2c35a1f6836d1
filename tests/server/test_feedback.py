"""Feedback and completion lookup: ratings with history, and each tenant seeing only its own."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.server.conftest import ADMIN_KEY, Gateway

HELLO = [{"role": "user", "content": "Rate me."}]


def complete(client: OpenAI, gateway: Gateway, **kwargs: Any) -> str:
    return client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=3, **kwargs).id


def rate(client: OpenAI, **body: Any) -> dict[str, Any]:
    return client.post("/feedback", body=body, cast_to=object)  # type: ignore[return-value]


def lookup(client: OpenAI, completion_id: str) -> dict[str, Any]:
    return client.get(f"/completions/{completion_id}", cast_to=object)  # type: ignore[return-value]


def test_rating_again_updates_and_keeps_history(client: OpenAI, gateway: Gateway) -> None:
    completion_id = complete(client, gateway)
    first = rate(client, completion_id=completion_id, rating="up")
    assert first["object"] == "feedback" and first["id"].startswith("fb-")
    assert (first["completion_id"], first["choice_index"], first["score"], first["rating"]) == (
        completion_id,
        0,
        1.0,
        "up",
    )
    assert first["revision"] == 1 and len(first["history"]) == 1
    # One timestamp format throughout: ISO 8601 with its offset, like the history's events.
    for stamp in (first["created_at"], first["history"][0]["created_at"]):
        assert datetime.fromisoformat(stamp).utcoffset() == timedelta(0), stamp
    assert datetime.fromisoformat(first["created_at"]) == datetime.fromisoformat(first["history"][0]["created_at"])
    second = rate(client, completion_id=completion_id, rating="down", comment="wrong", corrected_answer="It is 5.")
    assert second["score"] == -1.0 and second["revision"] == 2
    assert [e["rating"] for e in second["history"]] == ["up", "down"]
    third = rate(client, completion_id=completion_id, score=0.25)
    assert third["rating"] is None and third["revision"] == 3

    logged = lookup(client, completion_id)
    assert logged["id"] == completion_id and logged["object"] == "chat.completion.log"
    feedback = logged["choices"][0]["feedback"]
    assert feedback["score"] == 0.25 and feedback["revision"] == 3
    assert [e["score"] for e in feedback["history"]] == [1.0, -1.0, 0.25]
    assert feedback["history"][1]["corrected_answer"] == "It is 5."


def test_feedback_on_another_choice(client: OpenAI, gateway: Gateway) -> None:
    completion_id = complete(client, gateway, n=2)
    assert rate(client, completion_id=completion_id, choice_index=1, rating="up")["revision"] == 1
    with pytest.raises(openai.BadRequestError) as caught:
        rate(client, completion_id=completion_id, choice_index=2, rating="up")
    assert caught.value.response.json()["error"]["param"] == "choice_index"
    choices = lookup(client, completion_id)["choices"]
    assert choices[0]["feedback"] is None and choices[1]["feedback"]["score"] == 1.0


def test_feedback_right_after_the_completion(client: OpenAI, gateway: Gateway) -> None:
    # Usually still only journaled at this point: accepted on the journal's word.
    for _ in range(5):
        completion_id = complete(client, gateway)
        assert rate(client, completion_id=completion_id, rating="up")["completion_id"] == completion_id
        assert lookup(client, completion_id)["choices"][0]["feedback"]["rating"] == "up"


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"rating": "up", "score": 1.0},
        {"rating": "meh"},
        {"score": 1.5},
        {"score": -1.01},
        {"rating": "up", "choice_index": -1},
        {"rating": "up", "comment": 5},
        {"rating": "up", "index": 1},  # a misspelt choice_index must not rate choice 0
    ],
)
def test_bad_feedback_is_400(client: OpenAI, gateway: Gateway, body: dict[str, Any]) -> None:
    completion_id = complete(client, gateway)
    with pytest.raises(openai.BadRequestError):
        rate(client, completion_id=completion_id, **body)


def test_tenants_only_see_and_rate_their_own(gateway: Gateway) -> None:
    acme, globex = gateway.client(gateway.keys["acme"]), gateway.client(gateway.keys["globex"])
    admin = gateway.client(ADMIN_KEY)
    mine = complete(acme, gateway)
    for other in (globex, admin):
        with pytest.raises(openai.NotFoundError):
            rate(other, completion_id=mine, rating="down")
        with pytest.raises(openai.NotFoundError):
            lookup(other, mine)
    with pytest.raises(openai.NotFoundError):
        rate(acme, completion_id="chatcmpl-does-not-exist", rating="up")
    assert lookup(acme, mine)["tenant_id"] == "acme"

    # The admin key acts on the default tenant.
    admins = complete(admin, gateway)
    assert lookup(admin, admins)["tenant_id"] == "default"
    assert rate(admin, completion_id=admins, rating="up")["revision"] == 1
    with pytest.raises(openai.NotFoundError):
        lookup(acme, admins)


def test_keyless_quick_start_uses_the_default_tenant(keyless_gateway: Gateway) -> None:
    client = keyless_gateway.client("anything")
    completion_id = complete(client, keyless_gateway)
    assert rate(client, completion_id=completion_id, rating="up")["revision"] == 1
    assert lookup(client, completion_id)["tenant_id"] == "default"
