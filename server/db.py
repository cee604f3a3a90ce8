"""Database engine, sessions and migrations. SQLite runs in WAL mode with a busy timeout because
the API process and a worker process write the same file; PostgreSQL needs nothing special."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

from server.config import Settings

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000
# Sync routes run in AnyIO's 40-thread pool, each holding one session: a smaller pool makes
# threads queue for connections under load (100 concurrent clients timed out at the default 5+10).
POOL_SIZE, POOL_OVERFLOW = 20, 40
MIGRATION_LOCK_KEY = 0x626C656E64  # "blend": the PostgreSQL advisory lock around migrations


def make_engine(settings: Settings) -> Engine:
    """A new Engine for settings.sqlalchemy_url (one per process; share it)."""
    url = settings.sqlalchemy_url
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            pool_size=POOL_SIZE,
            max_overflow=POOL_OVERFLOW,
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=POOL_SIZE, max_overflow=POOL_OVERFLOW)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def session_factory(settings: Settings, engine: Engine | None = None) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit (rows are rendered after the commit)."""
    return sessionmaker(bind=engine or make_engine(settings), expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction: commit on success, roll back on any error."""
    with factory() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def alembic_config(url: str) -> Config:
    """Alembic configured in code (no alembic.ini): scripts in migrations/, the URL given."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(settings: Settings, revision: str = "head") -> None:
    """Bring the schema to `revision` (idempotent; run at serve start and by `blendserve migrate`)."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    _run_alembic(settings, lambda cfg: command.upgrade(cfg, revision))


def downgrade(settings: Settings, revision: str = "base") -> None:
    _run_alembic(settings, lambda cfg: command.downgrade(cfg, revision))


def _run_alembic(settings: Settings, step: Callable[[Config], None]) -> None:
    """Run an Alembic command in one transaction. On PostgreSQL an advisory lock serialises
    processes that migrate at the same moment (an API and workers starting together)."""
    engine = make_engine(settings)
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
            cfg = alembic_config(settings.sqlalchemy_url)
            cfg.attributes["connection"] = conn
            step(cfg)
    finally:
        engine.dispose()


def migrate_main(args: argparse.Namespace) -> int:
    """`blendserve migrate`: apply migrations to BLENDSERVE_DATABASE_URL and exit."""
    settings = Settings()
    upgrade(settings)
    print(f"database at head: {_redacted(settings.sqlalchemy_url)}")
    return 0


def _redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
