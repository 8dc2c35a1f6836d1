"""Canary rollout of adapters on a live gateway (tiny model, SQLite, the local engine serving real peft
LoRA folders), decided from simulated users' ratings sent through the public API only.

Two adapters: a *faithful* one (peft's default init, B = 0: it answers exactly as the base does) and a
*noisy* one (random factors: different answers). The simulated users like an answer when it is the
base's answer to that question and dislike it otherwise, so the faithful adapter is the better one. The
gateway's judge checks every 0.3 s; every decision here is the judge's, reached from those ratings.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from admin import schemas
from storage.model_versions import record_model_version
from tests.admin.test_adapters import ENDPOINTS as ADAPTER_ENDPOINTS
from tests.admin.test_adapters import TARGETS, Folders, admin, error, ok, promote, register, status_of, typed
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.server.test_response_models import declared
from tests.support.polling import wait_until
from tests.support.streaming_load import StreamingLoad

CANARY_HEADER = "x-tandem-canary"
QUESTIONS = [f"Question {i}: name a thing that is {colour}." for i, colour in enumerate(("red", "green", "blue"))]
USERS = [f"user-{i}" for i in range(24)]
QUICK = {"share": 0.5, "min_ratings": 6, "confidence": 0.95, "margin": 0.05}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    settings = gateway_settings(
        tmp_path_factory.mktemp("canary-gw"),
        tiny_model_path(),
        admin_key=ADMIN_KEY,
        adapter_refresh_s=3600,
        adapter_canary_check_s=0.3,
    )
    with run_gateway(settings, tenants=("acme", "globex", "initech", "umbrella")) as gw:
        yield gw


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Folders:
    return Folders(tmp_path_factory.mktemp("canary-loras"))


@pytest.fixture(scope="module")
def faithful(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA whose B factors are zero: the base's answers exactly, through the adapter path."""
    folder = tmp_path_factory.mktemp("faithful") / "lora"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)).save_pretrained(folder)
    return folder


def ask(client: OpenAI, model: str, question: str, user: str) -> tuple[str, str, str | None]:
    """One greedy answer of ``user``: (completion id, text, X-Tandem-Canary)."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0, user=user
    )
    reply = raw.parse()
    return reply.id, reply.choices[0].message.content or "", raw.headers.get(CANARY_HEADER)


def base_answers(gateway: Gateway) -> dict[str, str]:
    """What the base alone answers (umbrella never has an adapter)."""
    client = gateway.client(gateway.keys["umbrella"])
    return {q: ask(client, gateway.model, q, "reference")[1] for q in QUESTIONS}


class SimulatedUsers:
    """Users who ask the questions in turn and rate each answer: up when it is the base's answer."""

    def __init__(self, gateway: Gateway, tenant: str, reference: dict[str, str]) -> None:
        self.client = gateway.client(gateway.keys[tenant])
        self.model, self.reference = gateway.model, reference
        self.arms: dict[tuple[str, str], set[str]] = {}  # (canary, user) -> the arms they were served
        self.rated = 0

    def round(self, canary_id: str) -> None:
        for turn, user in enumerate(USERS):
            question = QUESTIONS[(turn + self.rated) % len(QUESTIONS)]
            completion_id, answer, canary = ask(self.client, self.model, question, user)
            if canary is not None:
                match = re.fullmatch(rf"{canary_id}; arm=(canary|control)", canary)
                assert match, canary
                self.arms.setdefault((canary_id, user), set()).add(match.group(1))
            rating = "up" if answer == self.reference[question] else "down"
            self.client.post("/feedback", body={"completion_id": completion_id, "rating": rating}, cast_to=object)
            self.rated += 1


def canary(gateway: Gateway, canary_id: str) -> dict[str, Any]:
    return typed(schemas.Canary, ok(admin(gateway, "GET", f"/admin/canaries/{canary_id}")))  # type: ignore[no-any-return]


def start(gateway: Gateway, adapter_id: str, **body: Any) -> dict[str, Any]:
    started = typed(
        schemas.CanaryStarted, ok(admin(gateway, "POST", f"/admin/adapters/{adapter_id}/canary", json=body), 201)
    )
    assert started["canary"]["status"] == "running" and started["canary"]["candidate_id"] == adapter_id
    return started  # type: ignore[no-any-return]


def rate_until_decided(gateway: Gateway, users: SimulatedUsers, canary_id: str) -> dict[str, Any]:
    for _ in range(20):
        users.round(canary_id)
        decided = canary(gateway, canary_id)
        if decided["status"] != "running":
            return decided
    raise AssertionError(f"undecided after {users.rated} ratings: {canary(gateway, canary_id)}")


def audited(gateway: Gateway, action: str, target: str) -> list[dict[str, Any]]:
    entries = ok(admin(gateway, "GET", "/admin/audit", params={"action": action}))["data"]
    return [e for e in entries if e["target"] == target and e["status_code"] < 400]  # refusals are audited too


def test_a_better_candidate_is_promoted_from_live_ratings_under_streaming_load(
    gateway: Gateway, folders: Folders, faithful: Path
) -> None:
    reference = base_answers(gateway)
    noisy = register(gateway, folders(), "acme", "tenant", "acme")
    promote(gateway, noisy)
    better = register(gateway, faithful, "acme", "tenant", "acme")
    users = SimulatedUsers(gateway, "acme", reference)
    with StreamingLoad(gateway.client(gateway.keys["acme"]), gateway.model, clients=2, user="streamer") as load:
        wait_until(lambda: noisy in load.adapters, timeout_s=60, what="the streams are served by the control")
        canary_id = start(gateway, better, **QUICK)["canary"]["id"]
        decided = rate_until_decided(gateway, users, canary_id)
    assert load.failures == [] and load.completed > 0
    assert load.adapters_after_mark == {better}

    assert decided["status"] == "promoted", decided
    assert decided["decided_by"] == "canary-judge" and decided["decided_at"] is not None
    numbers = decided["numbers"]
    assert all(numbers[arm]["up"] + numbers[arm]["down"] >= 6 for arm in ("canary", "control"))
    assert numbers["canary"]["up"] > numbers["control"]["up"]
    assert numbers["p_not_worse"] >= 0.95
    assert decided["reason"].startswith("not worse: ") and "P(not worse by 0.05)" in decided["reason"]
    assert status_of(gateway, better) == "serving" and status_of(gateway, noisy) == "retired"

    # Every user stayed on one side for the whole canary, and both sides were used.
    assert all(len(arms) == 1 for arms in users.arms.values()), users.arms
    assert {arm for arms in users.arms.values() for arm in arms} == {"canary", "control"}
    # After the decision the candidate serves everyone, outside any split.
    for user in USERS[:4]:
        raw = gateway.client(gateway.keys["acme"]).chat.completions.with_raw_response.create(
            model=gateway.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, user=user
        )
        assert raw.headers["x-tandem-adapter"] == better and CANARY_HEADER not in raw.headers
    [entry] = audited(gateway, "canary.promoted", canary_id)
    assert entry["actor"] == "canary-judge" and entry["details"]["p_not_worse"] >= 0.95
    listed = typed(schemas.CanaryList, ok(admin(gateway, "GET", "/admin/canaries", params={"tenant_id": "acme"})))
    assert canary_id in [c["id"] for c in listed["data"]]


def test_a_worse_candidate_is_rolled_back_and_the_control_keeps_serving(
    gateway: Gateway, folders: Folders, faithful: Path
) -> None:
    reference = base_answers(gateway)
    good = register(gateway, faithful, "globex", "tenant", "globex")
    promote(gateway, good)
    worse = register(gateway, folders(), "globex", "tenant", "globex")
    users = SimulatedUsers(gateway, "globex", reference)
    with StreamingLoad(gateway.client(gateway.keys["globex"]), gateway.model, clients=2, user="streamer") as load:
        wait_until(lambda: good in load.adapters, timeout_s=60, what="the streams are served by the control")
        canary_id = start(gateway, worse, **QUICK)["canary"]["id"]
        decided = rate_until_decided(gateway, users, canary_id)
    assert load.failures == [] and load.completed > 0
    assert load.adapters_after_mark == {good}

    assert decided["status"] == "rolled_back", decided
    assert decided["numbers"]["p_not_worse"] <= 0.05 and decided["reason"].startswith("worse: ")
    assert status_of(gateway, worse) == "rejected" and status_of(gateway, good) == "serving"
    assert all(len(arms) == 1 for arms in users.arms.values()), users.arms
    [entry] = audited(gateway, "canary.rolled_back", canary_id)
    assert entry["actor"] == "canary-judge"


def test_an_undecided_canary_times_out_to_the_safe_side(gateway: Gateway, folders: Folders) -> None:
    control = register(gateway, folders(), "initech", "user", "kim")
    promote(gateway, control)
    candidate = register(gateway, folders(), "initech", "user", "kim")
    canary_id = start(gateway, candidate, share=0.5, max_duration_s=1)["canary"]["id"]
    wait_until(lambda: canary(gateway, canary_id)["status"] != "running", timeout_s=30, what="the deadline passes")
    decided = canary(gateway, canary_id)
    assert decided["status"] == "rolled_back" and "timed out" in decided["reason"], decided
    assert status_of(gateway, candidate) == "rejected" and status_of(gateway, control) == "serving"


def test_an_operator_decides_first_and_a_second_canary_supersedes_the_first(gateway: Gateway, folders: Folders) -> None:
    first = register(gateway, folders(), "initech", "user", "lou")
    second = register(gateway, folders(), "initech", "user", "lou")
    slow = {"share": 0.3, "min_ratings": 1000}
    first_canary = start(gateway, first, **slow)["canary"]["id"]
    replaced = start(gateway, second, **slow, reason="a newer round")
    assert replaced["superseded_canary_id"] == first_canary
    assert canary(gateway, first_canary)["status"] == "superseded"
    assert status_of(gateway, first) == "candidate"  # it may be canaried again

    second_canary = replaced["canary"]["id"]
    body = {"reason": "looks right"}
    decided = typed(schemas.Canary, ok(admin(gateway, "POST", f"/admin/canaries/{second_canary}/promote", json=body)))
    assert decided["status"] == "promoted" and decided["decided_by"].startswith("admin:")
    assert decided["reason"].startswith("looks right")
    assert status_of(gateway, second) == "serving"
    for action in ("promote", "rollback"):
        error(admin(gateway, "POST", f"/admin/canaries/{second_canary}/{action}"), 409, "canary_state")
    error(admin(gateway, "POST", f"/admin/adapters/{second}/canary", json={"share": 0.5}), 409, "version_state")
    [entry] = audited(gateway, "canary.promote", second_canary)
    assert entry["actor"].startswith("admin:") and entry["details"]["reason"].startswith("looks right")
    [entry] = audited(gateway, "canary.start", second)
    assert entry["details"]["superseded"] == first_canary

    third = register(gateway, folders(), "initech", "user", "lou")
    third_canary = start(gateway, third, share=0.5)["canary"]["id"]
    ok(admin(gateway, "POST", f"/admin/canaries/{third_canary}/rollback"))
    assert status_of(gateway, third) == "rejected" and status_of(gateway, second) == "serving"


def test_bad_inputs_are_refused_with_their_codes(gateway: Gateway, folders: Folders) -> None:
    candidate = register(gateway, folders(), "umbrella", "user", "max")
    path = f"/admin/adapters/{candidate}/canary"
    for body, param in (
        ({}, "share"),
        ({"share": 0}, "share"),
        ({"share": 1}, "share"),
        ({"share": "half"}, "share"),
        ({"share": 0.5, "min_ratings": 0}, "min_ratings"),
        ({"share": 0.5, "confidence": 0.5}, "confidence"),
        ({"share": 0.5, "margin": 1}, "margin"),
        ({"share": 0.5, "max_duration_s": 0}, "max_duration_s"),
        ({"share": 0.5, "colour": "blue"}, "colour"),
    ):
        refused = error(admin(gateway, "POST", path, json=body), 400, "invalid_request")
        assert refused["param"] == param, (body, refused)
    error(admin(gateway, "POST", "/admin/adapters/ad-unknown/canary", json={"share": 0.5}), 404, "adapter_not_found")
    for method, action in (("GET", ""), ("POST", "/promote"), ("POST", "/rollback")):
        error(admin(gateway, method, f"/admin/canaries/cnr-unknown{action}"), 404, "canary_not_found")
    for params, param in (({"status": "done"}, "status"), ({"limit": 0}, "limit"), ({"limit": 1001}, "limit")):
        assert error(admin(gateway, "GET", "/admin/canaries", params=params), 400)["param"] == param
    assert ok(admin(gateway, "GET", "/admin/canaries", params={"tenant_id": "umbrella"}))["data"] == []
    assert status_of(gateway, candidate) == "candidate"

    # A base canary needs an engine pool (tests/e2e/test_base_canary.py); this gateway has one engine.
    with gateway.sessions().begin() as session:
        record_model_version(session, version_id="v-local", model=gateway.model, checkpoint_path=str(tiny_model_path()))
    refused = error(admin(gateway, "POST", "/admin/models/v-local/canary", json={"share": 0.5}), 409)
    assert refused["code"] == "canary_unsupported" and "engine pool" in refused["message"]
    assert [c for c in ok(admin(gateway, "GET", "/admin/canaries"))["data"] if c["scope_kind"] == "base"] == []


CANARY_ENDPOINTS = [
    ("POST", "/admin/adapters/ad-000000000000/canary"),
    ("POST", "/admin/models/v-0/canary"),
    ("GET", "/admin/canaries"),
    ("GET", "/admin/canaries/cnr-0"),
    ("POST", "/admin/canaries/cnr-0/promote"),
    ("POST", "/admin/canaries/cnr-0/rollback"),
]
assert not set(CANARY_ENDPOINTS) & set(ADAPTER_ENDPOINTS)


@pytest.mark.parametrize(("method", "path"), CANARY_ENDPOINTS)
def test_admin_key_required(gateway: Gateway, method: str, path: str) -> None:
    url = f"{gateway.url}{path}"
    body = {"share": 0.5} if path.endswith("canary") else None
    error(httpx.request(method, url, json=body), 401, "missing_api_key")
    tenant = {"Authorization": f"Bearer {gateway.keys['acme']}"}
    error(httpx.request(method, url, headers=tenant, json=body), 403, "admin_required")


def test_every_route_declares_its_answer(gateway: Gateway) -> None:
    openapi = httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()
    for method, template, status, model in (
        ("POST", "/admin/adapters/{adapter_id}/canary", 201, schemas.CanaryStarted),
        ("POST", "/admin/models/{version_id}/canary", 201, schemas.CanaryStarted),
        ("GET", "/admin/canaries", 200, schemas.CanaryList),
        ("GET", "/admin/canaries/{canary_id}", 200, schemas.Canary),
        ("POST", "/admin/canaries/{canary_id}/promote", 200, schemas.Canary),
        ("POST", "/admin/canaries/{canary_id}/rollback", 200, schemas.Canary),
    ):
        assert declared(openapi, method, template, status) == model.__name__, (method, template)
        refusals = (400, 401, 404, 409) if method == "POST" else (400, 401, 404)
        for refusal in refusals:
            assert str(refusal) in openapi["paths"][template][method.lower()]["responses"], (method, template)
