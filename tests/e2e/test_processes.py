"""The gateway in front of a `tandem engine` process, and a gateway SIGKILLed right after answering."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from sqlalchemy import create_engine, text

from tests.e2e.processes import Process, start_tandem
from tests.fixtures.tiny_model import tiny_model_path


@pytest.fixture(scope="module")
def engine_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    process = start_tandem(
        ["engine", "--model", str(tiny_model_path())],
        data_dir=tmp_path_factory.mktemp("engine"),
        ready_path="/model_info",
    )
    yield process
    process.stop()


def start_gateway(data_dir: Path, engine_url: str) -> Process:
    return start_tandem(
        ["serve", "--engine-url", engine_url, "--model", str(tiny_model_path())],
        data_dir=data_dir,
        ready_path="/v1/models",
    )


def completion_ids(data_dir: Path) -> list[str]:
    db = create_engine(f"sqlite:///{data_dir / 'tandem.db'}")
    with db.connect() as connection:
        rows = connection.execute(text("SELECT id FROM completions ORDER BY created_at")).scalars().all()
    db.dispose()
    return list(rows)


def test_gateway_over_an_engine_process(engine_process: Process, tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path, engine_process.url)
    try:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0, logprobs=True
        )
        assert reply.usage is not None and reply.usage.completion_tokens == len(reply.choices[0].logprobs.content)
        streamed = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0, stream=True
        )
        text_parts = [c.choices[0].delta.content or "" for c in streamed if c.choices]
        assert "".join(text_parts) == reply.choices[0].message.content
    finally:
        gateway.stop()
    assert {reply.id} <= set(completion_ids(tmp_path))


def test_sigkill_right_after_answering_loses_nothing(engine_process: Process, tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path, engine_process.url)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    answered = [
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=3).id
        for i in range(5)
    ]
    gateway.popen.send_signal(signal.SIGKILL)
    assert gateway.popen.wait(timeout=10) == -signal.SIGKILL

    restarted = start_gateway(tmp_path, engine_process.url)  # replays the journal on start
    try:
        rated = openai.OpenAI(base_url=restarted.url + "/v1", api_key="unused", max_retries=0)
        logged = rated.get(f"/completions/{answered[-1]}", cast_to=object)
        assert logged["id"] == answered[-1]  # type: ignore[index]
    finally:
        restarted.stop()
    ids = completion_ids(tmp_path)
    assert sorted(ids) == sorted(answered)  # every answer exactly once
