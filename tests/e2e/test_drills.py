"""The fault drills of `benchmarks/drills.py` at short lengths: real `tandem serve` processes on
PostgreSQL under load from the openai client; no acknowledged answer or rating may be lost or
stored twice, and the clients must be answered again after each fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.drills import DrillConfig, Row, disk_full, engine_kill, gateway_kill, postgres_down
from tests.conftest import _in_ci

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.fixture
def config(postgres_url: str, tmp_path: Path) -> DrillConfig:
    return DrillConfig(postgres_url, tmp_path, clients=2, fault_s=4.0, steady_s=3.0, recovery_timeout_s=60.0)


def held(row: Row, acknowledged: int = 20) -> None:
    print(" | ".join(row.cells()))
    assert row.acknowledged > acknowledged, row
    assert (row.lost, row.duplicated) == (0, 0), row
    assert row.recovery_s is not None, row


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_gateway_sigkill_under_load(config: DrillConfig, stream: bool) -> None:
    row = gateway_kill(config, stream)
    held(row)
    assert set(row.failures) <= {"connection", "incomplete stream"}, row  # only while it was down


@pytest.mark.timeout(600)  # two engine processes start first
def test_engine_replica_sigkill_under_load(config: DrillConfig) -> None:
    row = engine_kill(config)
    held(row, acknowledged=5)  # 512-token streams: fewer, longer requests
    # Only streams under way on the killed replica fail (cut mid-way); new requests go to the other.
    assert set(row.failures) <= {"connection", "incomplete stream"}, row


def test_postgres_unreachable_under_load(config: DrillConfig) -> None:
    row = postgres_down(config)
    held(row)
    assert row.failures == {}, row  # the journal takes everything while the database is away


def test_journal_disk_full_under_load(config: DrillConfig) -> None:
    try:
        row = disk_full(config)
    except OSError as exc:  # no tmpfs without root
        if _in_ci():
            raise
        pytest.skip(str(exc))
    held(row)
    assert set(row.failures) == {"503"}, row  # refused while full, never a 500 or a lost answer
