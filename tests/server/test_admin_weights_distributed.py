"""POST /admin/weights {"source": "distributed"}: a trainer broadcasts over gloo to the gateway's two
`tandem engine` replicas while the server pauses them, checks the version per replica and promotes it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from learner.round_config import RoundError
from learner.server_api import ServerApi
from learner.weight_broadcast import BroadcastConfig, EngineTarget, broadcast_weights, roll_out_by_broadcast
from server.weight_delta import read_checkpoint, tensor_sha256
from storage import get_version, list_versions
from tests.e2e.processes import start_tandem
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
GLOO = BroadcastConfig(backend="gloo", bucket_bytes=256 << 10, timeout_s=60)
LONG = 400  # tokens: still streaming when the rollout begins


@pytest.fixture(scope="module")
def engine_urls(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    data_dir = tmp_path_factory.mktemp("engines")
    processes = [
        start_tandem(["engine", "--model", str(tiny_model)], data_dir=data_dir, ready_path="/model_info")
        for _ in range(2)
    ]
    try:
        yield [p.url for p in processes]
    finally:
        for process in processes:
            process.stop()


@pytest.fixture(scope="module")
def pool_gateway(
    engine_urls: list[str], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    settings = gateway_settings(
        tmp_path_factory.mktemp("distributed-gateway"),
        tiny_model,
        admin_key=ADMIN_KEY,
        engine="sglang",
        engine_urls=engine_urls,
        health_interval_s=3600,
    )
    with run_gateway(settings, tenants=("acme",)) as gw:
        yield gw


@pytest.fixture
def api(pool_gateway: Gateway) -> ServerApi:
    return ServerApi(pool_gateway.url, ADMIN_KEY, timeout_s=120)


def checksums(url: str) -> tuple[str, dict[str, str]]:
    served = httpx.get(f"{url}/weights_checksum", timeout=60).json()
    return served["weight_version"], {name: entry["sha256"] for name, entry in served["tensors"].items()}


def as_served(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_sha256(t.to(torch.float32)) for name, t in tensors.items()}


def post(gateway: Gateway, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", json=body, headers=ADMIN, timeout=120)


def chat(gateway: Gateway, max_tokens: int = 24) -> str | None:
    reply = gateway.client(gateway.keys["acme"]).chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"
    return reply.system_fingerprint


def stream_chat(gateway: Gateway, streaming: threading.Event) -> tuple[int, str | None]:
    """Tokens and finish reason of a long streamed answer; ``streaming`` is set at its first token."""
    chunks = gateway.client(gateway.keys["acme"]).chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "tell me more"}],
        max_tokens=LONG,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    finish, tokens = None, 0
    for chunk in chunks:
        streaming.set()
        finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        tokens = chunk.usage.completion_tokens if chunk.usage else tokens
    return tokens, finish


def versions_of(gateway: Gateway) -> list[Any]:
    with gateway.sessions()() as session:
        return list_versions(session, model=gateway.model)


def assert_serving_the_start_up_weights(gateway: Gateway, engine_urls: list[str], tiny_model: Path) -> None:
    want = as_served(read_checkpoint(tiny_model))
    assert [checksums(url) for url in engine_urls] == [("default", want)] * 2
    assert httpx.get(f"{gateway.url}/admin/weights", headers=ADMIN).json()["weight_version"] == "default"
    assert chat(gateway) == "default"  # resumed


def test_a_broadcast_rollout_reaches_every_replica_and_fails_no_request(
    pool_gateway: Gateway, api: ServerApi, engine_urls: list[str], tiny_model: Path, perturbed_model: Path
) -> None:
    trained = {name: t.to(torch.float32) for name, t in read_checkpoint(perturbed_model).items()}
    with ThreadPoolExecutor(4) as users:
        # Streaming when the replicas pause: retracted, then finished under the new weights.
        streaming = threading.Event()
        before = users.submit(stream_chat, pool_gateway, streaming)
        assert streaming.wait(60)
        plan = api.begin_distributed("v-dist", str(perturbed_model))
        assert not before.done()
        during = [users.submit(chat, pool_gateway) for _ in range(2)]  # wait in the paused servers
        assert plan["world_size"] == 3 and plan["group_name"].startswith("tandem-")
        assert [(e["url"], e["rank_offset"], e["ranks"]) for e in plan["engines"]] == [
            (engine_urls[0], 1, 1),
            (engine_urls[1], 2, 1),
        ]
        engines = [EngineTarget(e["url"], e["ranks"]) for e in plan["engines"]]
        stats = broadcast_weights(
            engines, list(trained.items()), "v-dist", replace(GLOO, group_name=plan["group_name"])
        )
        assert stats.buckets > 3
        result = api.end_distributed(plan["session"], committed=True)
        assert [f.result() for f in during] == ["v-dist", "v-dist"]
        tokens, finish = before.result()
        assert (tokens, finish) == (LONG, "length")
    assert result["weight_version"] == "v-dist" and result["previous_version"] == "default"
    assert result["version"]["checkpoint_path"] == str(perturbed_model)
    assert [checksums(url) for url in engine_urls] == [("v-dist", as_served(trained))] * 2
    with pool_gateway.sessions()() as session:
        assert get_version(session, version_id="v-dist").status == "serving"

    # The helper does the same in one call: back to the start-up weights, sent as bfloat16.
    stats, result = roll_out_by_broadcast(
        api, list(read_checkpoint(tiny_model).items()), "default", str(tiny_model), GLOO
    )
    assert result["weight_version"] == "default" and stats.tensors == len(trained)
    assert_serving_the_start_up_weights(pool_gateway, engine_urls, tiny_model)


def test_an_aborted_or_incomplete_broadcast_leaves_serving_as_it_was(
    pool_gateway: Gateway, api: ServerApi, engine_urls: list[str], tiny_model: Path, perturbed_model: Path
) -> None:
    part = [("lm_head.weight", read_checkpoint(perturbed_model)["lm_head.weight"])]
    versions_before = versions_of(pool_gateway)

    # The trainer gives up halfway: the replicas reload the serving checkpoint from disk.
    plan = api.begin_distributed("v-abort", str(perturbed_model))
    engines = [EngineTarget(e["url"]) for e in plan["engines"]]
    broadcast_weights(engines, part, "v-abort", replace(GLOO, group_name=plan["group_name"]))
    assert {checksums(url)[0] for url in engine_urls} == {"v-abort"}
    aborted = api.end_distributed(plan["session"], committed=False, reason="out of memory, say")
    assert aborted["weight_version"] == "default"
    assert_serving_the_start_up_weights(pool_gateway, engine_urls, tiny_model)

    # Only one replica got the version: the commit is refused and both go back.
    plan = api.begin_distributed("v-split", str(perturbed_model))
    first = next(e for e in plan["engines"] if e["rank_offset"] == 1)
    broadcast_weights([EngineTarget(first["url"])], part, "v-split", replace(GLOO, group_name=plan["group_name"]))
    with pytest.raises(RoundError, match="answered 400: The broadcast of v-split did not reach every replica"):
        api.end_distributed(plan["session"], committed=True)
    assert_serving_the_start_up_weights(pool_gateway, engine_urls, tiny_model)
    assert versions_of(pool_gateway) == versions_before  # neither version was recorded


def test_a_trainer_that_never_commits_is_timed_out(
    pool_gateway: Gateway, api: ServerApi, engine_urls: list[str], tiny_model: Path, perturbed_model: Path
) -> None:
    body = {"source": "distributed", "weight_version": "v-late", "model_path": str(perturbed_model), "timeout_s": 3}
    opened = post(pool_gateway, "/admin/weights", body)
    assert opened.status_code == 200, opened.text
    again = post(pool_gateway, "/admin/weights", {**body, "weight_version": "v-other"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "weight_update_in_progress"
    time.sleep(6)  # the 3 s timeout, then the replicas leave the group and resume
    late = post(pool_gateway, f"/admin/weights/distributed/{opened.json()['session']}/commit")
    assert late.status_code == 404 and late.json()["error"]["code"] == "no_such_rollout"
    assert_serving_the_start_up_weights(pool_gateway, engine_urls, tiny_model)
    assert post(pool_gateway, "/admin/weights/distributed/nothing/abort").status_code == 404


def test_an_in_process_engine_cannot_take_a_broadcast(gateway: Gateway, perturbed_model: Path) -> None:
    body = {"source": "distributed", "weight_version": "v-x", "model_path": str(perturbed_model)}
    response = post(gateway, "/admin/weights", body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "unsupported_weight_source"
    missing = post(gateway, "/admin/weights", {"source": "distributed", "weight_version": "v-x"})
    assert missing.status_code == 400 and "needs model_path and weight_version" in missing.json()["error"]["message"]
