"""A base canary on a live gateway over a pool of two `tandem engine` replicas (tiny model, SQLite):
a candidate model version loads on one replica, serves a sticky share of every session, and the
gateway's judge promotes or rolls it back from simulated users' ratings sent through the public API.

The users like an answer when it is the start-up weights' answer to that question. The start-up
weights are registered as a version of their own ("original"), and a perturbed copy as another: with
the perturbed one serving, the original is the better candidate and is promoted; with the original
serving, a perturbed candidate is worse and is rolled back. Streaming clients run throughout: no
request fails across the split, the promotion and the rollback.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from admin import schemas
from learner.round import run_round
from storage.model_versions import record_model_version
from tests.admin.test_adapters import admin, error, ok, typed
from tests.admin.test_canaries import QUESTIONS, USERS, SimulatedUsers, ask, audited, canary, rate_until_decided
from tests.e2e.test_learning_round import round_config
from tests.e2e.test_replica_failover import engine_config
from tests.fixtures.tiny_model import perturb_weights, tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.support.polling import wait_until
from tests.support.streaming_load import StreamingLoad

QUICK = {"share": 0.5, "min_ratings": 6, "confidence": 0.95, "margin": 0.05}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("base-canary")
    settings = gateway_settings(
        root,
        tiny_model_path(),
        admin_key=ADMIN_KEY,
        engine="sglang",
        engine_config=engine_config(root, replicas=2),
        health_interval_s=2.0,  # a short probe of a busy replica ejects it, and its arm's traffic moves
        healthy_after=2,
        engine_stall_timeout_s=30,
        engine_start_timeout_s=180,
        adapter_canary_check_s=0.3,
    )
    with run_gateway(settings, tenants=("acme",), startup_timeout_s=240) as gw:
        wait_until(lambda: len(in_rotation(gw)) == 2, timeout_s=120, what="both replicas are in rotation")
        yield gw


def in_rotation(gateway: Gateway) -> list[dict[str, Any]]:
    engines = ok(admin(gateway, "GET", "/admin/engines"))["data"]
    return [e for e in engines if e["healthy"]]


@pytest.fixture(scope="module")
def versions(gateway: Gateway, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Candidate versions of the served model: the start-up weights and two perturbed copies."""
    root = tmp_path_factory.mktemp("versions")
    folders = {
        "original": Path(shutil.copytree(tiny_model_path(), root / "original")),
        "noisy-1": perturb_weights(tiny_model_path(), root / "noisy-1", std=0.2, seed=1),
        "noisy-2": perturb_weights(tiny_model_path(), root / "noisy-2", std=0.2, seed=2),
    }
    with gateway.sessions().begin() as session:
        for name, folder in folders.items():
            record_model_version(session, version_id=name, model=gateway.model, checkpoint_path=str(folder))
    return {name: str(folder) for name, folder in folders.items()}


@pytest.fixture(scope="module")
def reference(gateway: Gateway) -> dict[str, str]:
    """The start-up weights' answers (before any version is rolled out)."""
    client = gateway.client(gateway.keys["acme"])
    return {q: ask(client, gateway.model, q, "reference")[1] for q in QUESTIONS}


def fingerprints_by_arm(gateway: Gateway) -> dict[str, set[str]]:
    """Each canary side's system_fingerprint (the weight version that answered), one request per user."""
    seen: dict[str, set[str]] = {}
    client = gateway.client(gateway.keys["acme"])
    for user in USERS[:12]:
        raw = client.chat.completions.with_raw_response.create(
            model=gateway.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, user=user
        )
        arm = raw.headers["x-tandem-canary"].rsplit("arm=", 1)[1]
        seen.setdefault(arm, set()).add(raw.parse().system_fingerprint or "")
    return seen


def serving_version(gateway: Gateway) -> str:
    return str(ok(admin(gateway, "GET", "/admin/weights"))["weight_version"])


def start_base(gateway: Gateway, version: str, **body: Any) -> str:
    started = typed(
        schemas.CanaryStarted, ok(admin(gateway, "POST", f"/admin/models/{version}/canary", json=body), 201)
    )
    assert started["canary"]["scope_kind"] == "base" and started["canary"]["tenant_id"] is None
    return str(started["canary"]["id"])


def test_a_better_base_version_is_promoted_and_a_worse_one_rolled_back(
    gateway: Gateway, versions: dict[str, str], reference: dict[str, str]
) -> None:
    ok(admin(gateway, "POST", "/admin/models/noisy-1/promote"))
    assert serving_version(gateway) == "noisy-1"
    users = SimulatedUsers(gateway, "acme", reference)
    with StreamingLoad(gateway.client(gateway.keys["acme"]), gateway.model, clients=2) as load:
        wait_until(lambda: load.completed > 2, timeout_s=60, what="the streams run")
        first = start_base(gateway, "original", **QUICK)
        assert fingerprints_by_arm(gateway) == {"canary": {"original"}, "control": {"noisy-1"}}
        assert serving_version(gateway) == "noisy-1"  # the pool's own weights are still the control's
        promoted = rate_until_decided(gateway, users, first)
        assert promoted["status"] == "promoted", promoted
        assert serving_version(gateway) == "original"

        second = start_base(gateway, "noisy-2", **QUICK)
        rolled_back = rate_until_decided(gateway, users, second)
        assert rolled_back["status"] == "rolled_back", rolled_back
    assert load.failures == [] and load.completed > 0
    assert load.fingerprints >= {"noisy-1", "original"}

    assert promoted["decided_by"] == "canary-judge" and promoted["numbers"]["p_not_worse"] >= 0.95
    assert rolled_back["numbers"]["p_not_worse"] <= 0.05 and rolled_back["reason"].startswith("worse: ")
    assert serving_version(gateway) == "original"
    statuses = {v: ok(admin(gateway, "GET", f"/admin/models/{v}"))["status"] for v in versions}
    assert statuses == {"original": "serving", "noisy-1": "retired", "noisy-2": "rejected"}
    assert all(len(arms) == 1 for arms in users.arms.values()), users.arms
    # After the decisions nothing is split: every request is answered by the serving version.
    raw = gateway.client(gateway.keys["acme"]).chat.completions.with_raw_response.create(
        model=gateway.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, user=USERS[0]
    )
    assert "x-tandem-canary" not in raw.headers and raw.parse().system_fingerprint == "original"
    [entry] = audited(gateway, "canary.promoted", first)
    assert entry["actor"] == "canary-judge"


def test_an_operator_rolls_a_base_canary_back_and_bad_starts_are_refused(
    gateway: Gateway, versions: dict[str, str]
) -> None:
    serving = serving_version(gateway)
    with gateway.sessions().begin() as session:
        record_model_version(session, version_id="noisy-3", model=gateway.model, checkpoint_path=versions["noisy-1"])
    canary_id = start_base(gateway, "noisy-3", share=0.5, min_ratings=1000)
    assert canary(gateway, canary_id)["control_id"] == serving
    body = {"reason": "not today"}
    decided = typed(schemas.Canary, ok(admin(gateway, "POST", f"/admin/canaries/{canary_id}/rollback", json=body)))
    assert decided["status"] == "rolled_back" and decided["reason"].startswith("not today")
    assert ok(admin(gateway, "GET", "/admin/models/noisy-3"))["status"] == "rejected"
    assert {e["weight_version"] for e in in_rotation(gateway)} == {serving}
    error(admin(gateway, "POST", f"/admin/canaries/{canary_id}/promote"), 409, "canary_state")

    error(admin(gateway, "POST", f"/admin/models/{serving}/canary", json={"share": 0.5}), 409, "version_state")
    error(admin(gateway, "POST", "/admin/models/v-unknown/canary", json={"share": 0.5}), 404, "version_not_found")
    error(admin(gateway, "POST", "/admin/models/noisy-3/canary", json={"share": 1.5}), 400, "invalid_request")
    with gateway.sessions().begin() as session:
        record_model_version(session, version_id="broken", model=gateway.model, checkpoint_path="/nowhere")
    refused = error(admin(gateway, "POST", "/admin/models/broken/canary", json={"share": 0.5}), 400)
    assert refused["code"] == "invalid_checkpoint", refused
    listed = ok(admin(gateway, "GET", "/admin/canaries", params={"limit": 1}))["data"]
    assert listed[0]["candidate_id"] == "broken" and listed[0]["status"] == "superseded"
    assert "could not load it" in listed[0]["reason"]
    assert {e["weight_version"] for e in in_rotation(gateway)} == {serving}
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200


def test_a_learning_round_with_a_canary_share_starts_a_base_canary(gateway: Gateway, tmp_path: Path) -> None:
    client = gateway.client(gateway.keys["acme"])
    for seed, question in enumerate(QUESTIONS * 2):
        reply = client.chat.completions.create(
            model=gateway.model,
            messages=[{"role": "user", "content": question}],
            max_tokens=8,
            seed=seed,
            user=f"learner-{seed % 2}",
        )
        rating = "up" if seed % 2 else "down"
        client.post("/feedback", body={"completion_id": reply.id, "rating": rating}, cast_to=object)
    client.get(f"/completions/{reply.id}", cast_to=object)  # flushes the conversation log
    serving = serving_version(gateway)
    result = run_round(round_config(gateway, tmp_path, canary_share=0.5))
    assert result.status == "canary", result.error
    running = ok(admin(gateway, "GET", "/admin/canaries", params={"status": "running"}))["data"]
    [base] = [c for c in running if c["scope_kind"] == "base"]
    assert base["candidate_id"] == result.version_id and base["control_id"] == serving
    assert serving_version(gateway) == serving  # the pool's own weights stay until the canary is decided
    assert {e["weight_version"] for e in in_rotation(gateway)} == {serving, result.version_id}
    ok(admin(gateway, "POST", f"/admin/canaries/{base['id']}/rollback"))
    assert {e["weight_version"] for e in in_rotation(gateway)} == {serving}
