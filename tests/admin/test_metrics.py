"""GET /metrics on a live gateway (local engine, tiny model, SQLite): scraped and parsed after real
requests, requests held mid-generation, a real weight swap and real round rows; and on a pool of two
real engine servers, one drained and one stopped. Every family the admin API promises is asserted by
name, each with a value that changed."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client import generate_latest

from server.engines.local.engine import LocalEngine
from server.engines.sglang_server import create_engine_app
from server.metrics import GatewayMetrics
from storage.db import make_engine, make_session_factory
from storage.rounds import finish_round, start_round
from storage.times import utcnow
from tests.fixtures.tiny_model import perturb_weights, tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.support.open_streams import streams_in_progress
from tests.support.polling import wait_until
from tests.support.uvicorn_thread import serve_in_thread

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CHAT = (("method", "POST"), ("route", "/v1/chat/completions"))
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
LOCAL = (("replica", "local-0"),)

# What the issue asks /metrics for: requests, latency histograms, tokens in and out, cached tokens,
# queue depth, engine health, swap count and duration, rounds and their durations.
FAMILIES = {
    "tandem_http_requests_total": "counter",
    "tandem_http_request_duration_seconds": "histogram",
    "tandem_time_to_first_token_seconds": "histogram",
    "tandem_completions_total": "counter",
    "tandem_prompt_tokens_total": "counter",
    "tandem_completion_tokens_total": "counter",
    "tandem_cached_tokens_total": "counter",
    "tandem_engine_in_flight": "gauge",
    "tandem_engine_healthy": "gauge",
    "tandem_engine_drained": "gauge",
    "tandem_weight_swaps_total": "counter",
    "tandem_weight_swap_duration_seconds": "histogram",
    "tandem_rounds": "gauge",
    "tandem_round_duration_seconds": "histogram",
    "tandem_database_up": "gauge",
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    settings = gateway_settings(tmp_path_factory.mktemp("metrics"), tiny_model_path(), admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("acme",)) as gw:
        yield gw


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, sorted labels), and every metric's declared type."""
    samples: Samples = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        match = SAMPLE.match(line)
        assert match is not None, f"not a sample line: {line!r}"
        name, labels, value = match.groups()
        key = (name, tuple(sorted(LABEL.findall(labels or ""))))
        assert key not in samples, f"duplicate sample {key}"
        samples[key] = float(value)
    return samples, types


def scrape(gateway: Gateway) -> tuple[Samples, dict[str, str]]:
    response = httpx.get(f"{gateway.url}/metrics", headers=ADMIN)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(response.text)


def chat_count(samples: Samples) -> float:
    return samples.get(("tandem_http_requests_total", (*CHAT, ("status", "200"))), 0.0)


def buckets(samples: Samples, name: str, labels: tuple[tuple[str, str], ...]) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of one histogram series, by bound."""
    found = [
        (float(dict(k[1])["le"]), v)
        for k, v in samples.items()
        if k[0] == f"{name}_bucket" and tuple(p for p in k[1] if p[0] != "le") == labels
    ]
    return sorted(found)


def test_needs_the_admin_key(gateway: Gateway) -> None:
    missing = httpx.get(f"{gateway.url}/metrics")
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    tenant = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {gateway.keys['acme']}"})
    assert tenant.status_code == 403
    assert tenant.json()["error"]["code"] == "admin_required"


def test_counters_rise_by_exactly_the_requests_made(gateway: Gateway) -> None:
    before, types = scrape(gateway)
    client = gateway.client(gateway.keys["acme"])
    usages = []
    for i in range(3):
        reply = client.chat.completions.create(
            model=gateway.model, messages=[{"role": "user", "content": f"count {i}"}], max_tokens=4, user="metrics-a"
        )
        usages.append(reply.usage)
    for i in range(2):
        stream = client.chat.completions.create(
            model=gateway.model,
            messages=[{"role": "user", "content": f"stream {i}"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        usages.append(next(c for c in stream if c.usage is not None).usage)
    bad = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": gateway.model}, headers=ADMIN)
    assert bad.status_code == 400
    after, types = scrape(gateway)

    assert types["tandem_http_requests_total"] == "counter"
    assert chat_count(after) - chat_count(before) == 5
    bad_key = ("tandem_http_requests_total", (*CHAT, ("status", "400")))
    assert after[bad_key] - before.get(bad_key, 0) == 1

    assert types["tandem_http_request_duration_seconds"] == "histogram"
    series = buckets(after, "tandem_http_request_duration_seconds", CHAT)
    assert len(series) > 5 and series[-1][0] == float("inf")
    counts = [count for _, count in series]
    assert counts == sorted(counts), "histogram buckets are cumulative"
    count_key = ("tandem_http_request_duration_seconds_count", CHAT)
    assert after[count_key] - before.get(count_key, 0) == 6  # five answered, one refused
    assert counts[-1] == after[count_key]
    assert after[("tandem_http_request_duration_seconds_sum", CHAT)] > 0

    replica = LOCAL
    completions = ("tandem_completions_total", replica)
    assert after[completions] - before.get(completions, 0) == 5
    # Every one of the five produced a token: each has its time to first token, within its latency.
    ttft_count, ttft_sum = (f"tandem_time_to_first_token_seconds_{part}" for part in ("count", "sum"))
    assert after[(ttft_count, replica)] - before.get((ttft_count, replica), 0) == 5
    ttft_rise = after[(ttft_sum, replica)] - before.get((ttft_sum, replica), 0)
    latency_rise = after[("tandem_http_request_duration_seconds_sum", CHAT)] - before.get(
        ("tandem_http_request_duration_seconds_sum", CHAT), 0
    )
    assert 0 < ttft_rise < latency_rise
    assert buckets(after, "tandem_time_to_first_token_seconds", replica)[-1] == (
        float("inf"),
        after[(ttft_count, replica)],
    )
    for metric, attribute in (
        ("tandem_prompt_tokens_total", "prompt_tokens"),
        ("tandem_completion_tokens_total", "completion_tokens"),
    ):
        rise = after[(metric, replica)] - before.get((metric, replica), 0)
        assert rise == sum(getattr(u, attribute) for u in usages), metric
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert cached > 0  # the prompts share the chat template's head, so the prefix cache has hits
    assert (
        after[("tandem_cached_tokens_total", replica)] - before.get(("tandem_cached_tokens_total", replica), 0)
        == cached
    )

    assert after[("tandem_database_up", ())] == 1


def test_queue_depth_counts_the_requests_in_progress(gateway: Gateway) -> None:
    depth = ("tandem_engine_in_flight", LOCAL)
    assert scrape(gateway)[0][depth] == 0
    with streams_in_progress(gateway.url, gateway.keys["acme"], gateway.model, count=2):
        assert scrape(gateway)[0][depth] == 2
    # The client went away: the engine drops them at its next step.
    wait_until(lambda: not scrape(gateway)[0][depth], timeout_s=30, what="cancelled requests leave the engine")


def test_a_weight_swap_is_counted_with_its_duration(gateway: Gateway, tmp_path: Path) -> None:
    before, _ = scrape(gateway)
    assert before.get(("tandem_weight_swaps_total", ()), 0) == 0
    model = perturb_weights(tiny_model_path(), tmp_path / "perturbed")
    response = httpx.post(
        f"{gateway.url}/admin/weights",
        json={"model_path": str(model), "weight_version": "metrics-v1"},
        headers=ADMIN,
        timeout=120,
    )
    assert response.status_code == 200, response.text
    after, types = scrape(gateway)
    assert types["tandem_weight_swap_duration_seconds"] == "histogram"
    assert after[("tandem_weight_swaps_total", ())] == 1
    assert after[("tandem_weight_swap_duration_seconds_count", ())] == 1
    assert after[("tandem_weight_swap_duration_seconds_sum", ())] == pytest.approx(response.json()["swap_s"])
    refused = httpx.post(
        f"{gateway.url}/admin/weights",
        json={"model_path": str(tmp_path / "missing"), "weight_version": "metrics-bad"},
        headers=ADMIN,
    )
    assert refused.status_code == 400
    assert scrape(gateway)[0][("tandem_weight_swaps_total", ())] == 1  # a refused checkpoint is no swap


def record_rounds(database_url: str) -> None:
    """Three finished rounds and a running one, ten minutes ago."""
    began = utcnow() - timedelta(minutes=10)
    with make_session_factory(make_engine(database_url)).begin() as session:
        for seconds, status in ((45, "succeeded"), (400, "succeeded"), (20, "failed")):
            run = start_round(session, model="m-metrics", worker_id="w", now=began)
            finish_round(
                session, round_id=run.id, status=status, watermark_to=0, now=began + timedelta(seconds=seconds)
            )
        start_round(session, model="m-metrics", worker_id="w", now=began)  # still running


def test_rounds_come_from_the_database(gateway: Gateway) -> None:
    model = ("model", "m-metrics")
    before, _ = scrape(gateway)
    assert not [key for key in before if model in key[1]]
    record_rounds(gateway.settings.resolved_database_url)
    samples, types = scrape(gateway)
    assert types["tandem_rounds"] == "gauge"
    assert samples[("tandem_rounds", (model, ("status", "succeeded")))] == 2
    assert samples[("tandem_rounds", (model, ("status", "failed")))] == 1
    assert samples[("tandem_rounds", (model, ("status", "running")))] == 1
    succeeded = (model, ("status", "succeeded"))
    assert samples[("tandem_round_duration_seconds_count", succeeded)] == 2
    assert samples[("tandem_round_duration_seconds_sum", succeeded)] == pytest.approx(445)
    series = dict(buckets(samples, "tandem_round_duration_seconds", succeeded))
    assert series[30.0] == 0 and series[60.0] == 1 and series[300.0] == 1 and series[600.0] == 2


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, dict[str, ExitStack]]]:
    """A gateway over two real engine servers, by URL (the replica's name); closing its stack stops one."""
    model = tiny_model_path()
    servers = [ExitStack() for _ in range(2)]
    with ExitStack() as stack:
        for server in servers:
            stack.push(server)  # stopped last, if the test did not stop it
        urls = [
            server.enter_context(
                serve_in_thread(create_engine_app(lambda: LocalEngine.open(model, torch_threads=1, max_batch_size=4)))
            )
            for server in servers
        ]
        settings = gateway_settings(
            tmp_path_factory.mktemp("metrics-pool"),
            model,
            admin_key=ADMIN_KEY,
            engine="sglang",
            engine_urls=urls,
            health_interval_s=2.0,
            healthy_after=1,
        )
        yield stack.enter_context(run_gateway(settings, tenants=("acme",))), dict(zip(urls, servers, strict=True))


def healthy(samples: Samples, replica: str) -> float:
    return samples[("tandem_engine_healthy", (("replica", replica),))]


def drained(samples: Samples, replica: str) -> float:
    return samples[("tandem_engine_drained", (("replica", replica),))]


def test_engine_health_and_drain_follow_the_pool(pool: tuple[Gateway, dict[str, ExitStack]]) -> None:
    gateway, servers = pool
    names = list(servers)
    before, _ = scrape(gateway)
    assert [(healthy(before, n), drained(before, n)) for n in names] == [(1, 0), (1, 0)]

    assert httpx.post(f"{gateway.url}/admin/engines/{names[1]}/drain", headers=ADMIN).status_code == 200
    assert [drained(scrape(gateway)[0], n) for n in names] == [0, 1]
    assert httpx.post(f"{gateway.url}/admin/engines/{names[1]}/undrain", headers=ADMIN).status_code == 200
    assert [drained(scrape(gateway)[0], n) for n in names] == [0, 0]

    servers[names[0]].close()  # the first engine server stops: its next health probe fails
    wait_until(
        lambda: not healthy(scrape(gateway)[0], names[0]),
        timeout_s=30,
        what="the stopped replica is unhealthy",
        interval_s=0.1,
    )
    assert healthy(scrape(gateway)[0], names[1]) == 1


def test_every_promised_family_is_declared(gateway: Gateway) -> None:
    """Each by name and type, series or not yet (the tests above assert a change of each one's value)."""
    assert {name: scrape(gateway)[1].get(name) for name in FAMILIES} == FAMILIES


def test_a_database_outage_reports_database_up_zero_and_no_rounds() -> None:
    """What a scrape renders when the rounds could not be read (``ScrapeState.rounds`` None)."""
    metrics = GatewayMetrics()
    metrics.state.replicas, metrics.state.rounds = [], None
    samples, types = parse(generate_latest(metrics.registry).decode())
    assert samples[("tandem_database_up", ())] == 0
    assert types["tandem_database_up"] == "gauge"
    assert "tandem_rounds" not in types and "tandem_round_duration_seconds" not in types
