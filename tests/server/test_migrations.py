"""Alembic: upgrade/downgrade round trips on SQLite and PostgreSQL; the migrated schema matches
the ORM models exactly; `blendserve migrate` applies it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from server.config import Settings
from server.db import downgrade, make_engine, upgrade
from server.models import Base
from tests.server.conftest import fresh_pg_database

TABLES = {"files", "batches", "batch_results", "webhook_events", "batch_shards"}


@pytest.fixture(params=["sqlite", "postgresql"])
def db_settings(request: pytest.FixtureRequest, make_settings: Callable[..., Settings]) -> Settings:
    return (
        request.getfixturevalue("pg_settings") if request.param == "postgresql" else make_settings()
    )


def _tables(settings: Settings) -> set[str]:
    engine = make_engine(settings)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_round_trip(db_settings: Settings) -> None:
    upgrade(db_settings)
    assert _tables(db_settings) == TABLES
    downgrade(db_settings, "base")
    assert _tables(db_settings) == set()
    upgrade(db_settings)
    assert _tables(db_settings) == TABLES


def test_upgrade_twice_is_harmless(db_settings: Settings) -> None:
    upgrade(db_settings)
    upgrade(db_settings)
    assert _tables(db_settings) == TABLES


def test_migrated_schema_matches_the_models(db_settings: Settings) -> None:
    upgrade(db_settings)
    engine = make_engine(db_settings)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
            )
    finally:
        engine.dispose()
    assert diff == []


def test_sqlite_runs_in_wal_mode(settings: Settings) -> None:
    upgrade(settings)
    engine = make_engine(settings)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
    engine.dispose()


def test_blendserve_migrate_command(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from server.cli import main

    monkeypatch.setenv("BLENDSERVE_DATA_DIR", str(settings.data_dir))
    monkeypatch.delenv("BLENDSERVE_DATABASE_URL", raising=False)
    monkeypatch.delenv("BLENDSERVE_API_KEYS", raising=False)
    monkeypatch.delenv("BLENDSERVE_HOST", raising=False)
    assert main(["migrate"]) == 0
    assert "database at head" in capsys.readouterr().out
    assert _tables(settings) == TABLES


def test_concurrent_upgrades_on_postgresql_do_not_collide(
    make_settings: Callable[..., Settings],
) -> None:
    """An API and workers may all migrate at start; the advisory lock lets one win, the rest no-op."""
    import threading
    import time

    errors: list[BaseException] = []

    def run(settings: Settings) -> None:
        try:
            upgrade(settings)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    # Its own database, dropped with FORCE, plus daemon threads and a bounded join: without
    # the lock, concurrent DDL can block for good and must not hang the suite.
    with fresh_pg_database() as url:
        pg_settings = make_settings(database_url=url)
        threads = [threading.Thread(target=run, args=(pg_settings,), daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "migrations blocked each other"
        assert errors == []
        assert _tables(pg_settings) == TABLES
