"""docs/data-format.md's example, run as written against the log of a live gateway: its JSONL holds the
same token ids and logprobs as the API answers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from tandem.cli import app
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import Gateway, gateway_settings, run_gateway

DOC = Path(__file__).resolve().parents[1] / "docs" / "data-format.md"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    settings = gateway_settings(tmp_path_factory.mktemp("data-format"), tiny_model_path())
    with run_gateway(settings, tenants=("acme",)) as gw:
        yield gw


def test_the_documented_export_reads_what_the_api_answers(gateway: Gateway, tmp_path: Path) -> None:
    [example] = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    client = gateway.client(gateway.keys["acme"])
    reply = client.chat.completions.create(
        model=gateway.model, messages=[{"role": "user", "content": "Count to three."}], max_tokens=6, n=2
    )
    logged: Any = client.get(f"/completions/{reply.id}", cast_to=object)  # flushes the conversation log
    database = gateway.settings.resolved_database_url.removeprefix("sqlite:///")
    subprocess.run(
        [sys.executable, "-c", example],
        cwd=tmp_path,
        env={**os.environ, "TANDEM_DB": database},
        check=True,
        timeout=120,
    )
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    mine = sorted((r for r in records if r["completion_id"] == reply.id), key=lambda r: r["choice"])
    assert len(mine) == 2
    for record, choice in zip(mine, logged["choices"], strict=True):
        assert record["token_ids"] == choice["token_ids"] and record["text"] == choice["text"]
        assert record["logprobs"] == pytest.approx(choice["logprobs"], abs=1e-6)
        assert record["prompt_token_ids"] == logged["prompt_token_ids"]


def test_tandem_export_writes_what_the_api_answers_with_the_rating(gateway: Gateway, tmp_path: Path) -> None:
    client = gateway.client(gateway.keys["acme"])
    reply = client.chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=5,
        n=2,
        user="dana",
    )
    client.post("/feedback", body={"completion_id": reply.id, "choice_index": 1, "rating": "down"}, cast_to=object)
    logged: Any = client.get(f"/completions/{reply.id}", cast_to=object)  # flushes the conversation log
    out = tmp_path / "export" / "log.jsonl"
    database = gateway.settings.resolved_database_url
    done = CliRunner().invoke(app, ["export", "--out", str(out), "--tenant", "acme", "--database-url", database])
    assert done.exit_code == 0, done.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    mine = [r for r in records if r["completion_id"] == reply.id]
    assert [r["choice"] for r in mine] == [0, 1] and {r["tenant_id"] for r in records} == {"acme"}
    for record, choice in zip(mine, logged["choices"], strict=True):
        assert record["token_ids"] == choice["token_ids"] and record["text"] == choice["text"]
        assert record["logprobs"] == pytest.approx(choice["logprobs"], abs=1e-6)
        assert record["prompt_token_ids"] == logged["prompt_token_ids"] and record["user"] == "dana"
        assert record["messages"] == [{"role": "user", "content": "Name a colour."}]
    assert mine[0]["feedback"] is None and mine[1]["feedback"]["rating"] == "down"
    assert f"{len(records)} answers written" in done.output

    later = CliRunner().invoke(
        app, ["export", "--out", "-", "--since", "2999-01-01T00:00:00", "--database-url", database]
    )
    assert later.exit_code == 0 and later.output.strip().endswith("0 answers written to standard output")
    empty = tmp_path / "empty.db"  # a database tandem never migrated: no tables
    broken = CliRunner().invoke(app, ["export", "--out", "-", "--database-url", f"sqlite:///{empty}"])
    assert broken.exit_code == 2 and "has no tandem schema" in broken.output
