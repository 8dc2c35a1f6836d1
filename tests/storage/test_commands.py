"""`tandem db` and `tandem keys`, through typer's runner against real databases."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from migrations.migrate import current_revision, head_revision
from storage.api_keys import lookup_api_key
from storage.db import make_engine, make_session_factory
from tandem.cli import app
from tandem.commands.db import db_app
from tandem.commands.keys import keys_app
from tests.storage.factories import new_tenant

runner = CliRunner()


def test_upgrade_creates_the_data_dir_and_downgrade_empties(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new' / 'dir' / 'tandem.db'}"
    result = runner.invoke(db_app, ["upgrade", "--database-url", url])
    assert result.exit_code == 0, result.output
    assert current_revision(url) == head_revision()
    result = runner.invoke(db_app, ["downgrade", "--revision", "base", "--database-url", url])
    assert result.exit_code == 0, result.output
    assert current_revision(url) is None


def test_keys_need_the_schema(sqlite_url: str) -> None:
    result = runner.invoke(keys_app, ["create", "--tenant", "acme", "--database-url", sqlite_url])
    assert result.exit_code == 2, result.output
    assert f"the database {sqlite_url} has no tandem schema" in result.output
    assert "tandem db upgrade" in result.output


def test_learn_names_the_database_it_opened_when_it_is_not_the_servers(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once `tandem learn` against a fresh database died with SQLAlchemy's "no such table"."""
    monkeypatch.setenv("TANDEM_ADMIN_KEY", "an-admin-key-for-the-test")
    result = runner.invoke(app, ["learn", "--server", "http://127.0.0.1:9", "--database-url", sqlite_url])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert f"tandem learn: the database {sqlite_url} has no tandem schema: give the server's database" in result.output


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (["keys", "list"], "tandem keys: the database postgresql://postgres@127.0.0.1:9/none cannot be opened"),
        (["export", "--out", "-"], "tandem export: the database postgresql://postgres@127.0.0.1:9/none cannot be"),
        (["db", "upgrade"], "tandem db upgrade: the database postgresql://postgres@127.0.0.1:9/none failed"),
    ],
)
def test_an_unreachable_database_is_one_line(command: list[str], says: str) -> None:
    result = runner.invoke(app, [*command, "--database-url", "postgresql://postgres@127.0.0.1:9/none"])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output and "sqlalche.me" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_export_from_a_database_without_the_schema_says_so(sqlite_url: str) -> None:
    result = runner.invoke(app, ["export", "--out", "-", "--database-url", sqlite_url])
    assert result.exit_code == 2 and "has no tandem schema" in result.output, result.output


def test_create_list_revoke(database_url: str) -> None:
    tenant = new_tenant()
    created = runner.invoke(keys_app, ["create", "--tenant", tenant, "--name", "ci", "--database-url", database_url])
    assert created.exit_code == 0, created.output
    [plaintext] = re.findall(r"tdm-[A-Za-z0-9_-]{40,}", created.output)
    key_id = re.search(r"key_[0-9a-f]{16}", created.output).group(0)  # type: ignore[union-attr]

    listed = runner.invoke(keys_app, ["list", "--database-url", database_url])
    assert listed.exit_code == 0 and key_id in listed.output and plaintext not in listed.output

    engine = make_engine(database_url)
    with make_session_factory(engine)() as session:
        identity = lookup_api_key(session, plaintext)
    assert identity is not None and identity.tenant_id == tenant

    revoked = runner.invoke(keys_app, ["revoke", key_id, "--database-url", database_url])
    assert revoked.exit_code == 0, revoked.output
    with make_session_factory(engine)() as session:
        assert lookup_api_key(session, plaintext) is None
    engine.dispose()
    missing = runner.invoke(keys_app, ["revoke", "key_nope", "--database-url", database_url])
    assert missing.exit_code == 1 and "no API key" in missing.output
