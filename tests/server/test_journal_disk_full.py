"""The journal's disk fills up under a live gateway: nothing is acknowledged that is not journaled,
the error says why, and everything works again once space returns."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from server.conversation_log.reader import read_batch
from server.conversation_log.segments import Position
from server.conversation_log.writer import JournalWriteError, JournalWriter
from tests.conftest import _in_ci
from tests.fixtures.small_disk import fill, small_disk
from tests.server.conftest import Gateway, gateway_settings, run_gateway
from tests.support.polling import wait_until

HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture
def journal_disk(tmp_path: Path) -> Iterator[Path]:
    try:
        with small_disk(tmp_path / "data" / "journal", size="1m") as folder:
            yield folder
    except OSError as exc:
        if _in_ci():
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))


@pytest.fixture
def gateway(journal_disk: Path, tiny_model: Path) -> Iterator[Gateway]:
    with run_gateway(gateway_settings(journal_disk.parent, tiny_model), tenants=("disk",)) as gw:
        yield gw


def test_a_full_journal_disk_answers_503_and_acknowledges_nothing(gateway: Gateway, journal_disk: Path) -> None:
    client = gateway.client(gateway.keys["disk"])
    kept = client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=2)
    filler = fill(journal_disk)

    with pytest.raises(openai.APIStatusError) as refused:
        for _ in range(20):  # the last page of the segment may still take a record or two
            client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=2)
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "5"
    error = refused.value.response.json()["error"]
    assert error["code"] == "log_unavailable"
    assert "No space left on device" in error["message"] and "nothing of this request was kept" in error["message"]

    with pytest.raises(openai.APIError, match="No space left on device"):  # no finish event: not an answer
        for _ in client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=2, stream=True):
            pass
    with pytest.raises(openai.APIStatusError, match="No space left on device") as rating:
        for _ in range(20):  # a rating's record is smaller than a chat's: the last page may still take one
            client.post("/feedback", cast_to=object, body={"completion_id": kept.id, "rating": "up"})
    assert rating.value.status_code == 503

    filler.unlink()
    after = client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=2)
    client.post("/feedback", cast_to=object, body={"completion_id": after.id, "rating": "up"})
    # The journal holds whole records only: a write cut short by the full disk was cut off again.
    journaled = [entry.record.id for entry in read_batch(journal_disk, Position(0, 0), 10_000).entries]
    assert kept.id in journaled and after.id in journaled
    wait_until(lambda: _stored(client, after.id), timeout_s=10, what="the answer after the disk had space again stored")
    assert _stored(client, kept.id)


def _stored(client: openai.OpenAI, completion_id: str) -> bool:
    return client.get(f"/completions/{completion_id}", cast_to=object)["id"] == completion_id  # type: ignore[index]


def test_a_write_cut_short_leaves_no_partial_line(journal_disk: Path) -> None:
    writer = JournalWriter(journal_disk, segment_bytes=1 << 30)
    writer.open(1)
    writer.append(b'{"first": true}\n')
    fill(journal_disk)
    with pytest.raises(JournalWriteError, match="No space left on device"):
        for _ in range(100):  # fills what is left of the segment's last page, then fails part-way
            writer.append(b"x" * 1500 + b"\n")
    written = writer.appended - 1  # the long lines that fitted
    assert written > 0  # the failing write was one that started: it got cut off again
    assert os.path.getsize(journal_disk / "segment-000000000001.jsonl") == 16 + 1501 * written
