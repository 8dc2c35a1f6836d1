"""Alembic environment: the URL comes from the Config that ``migrations.migrate`` builds."""

from __future__ import annotations

from alembic import context

from storage.db import make_engine
from storage.models import Base

config = context.config


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: run migrations through migrations.migrate or `tandem db upgrade`")
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=Base.metadata,
                compare_type=True,
                # SQLite cannot ALTER most things; batch mode copies the table instead.
                render_as_batch=connection.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (--sql) migrations are not supported")
run_migrations_online()
