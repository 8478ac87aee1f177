"""One server per test session, one template database on it, a fresh clone for every test.

Building the v040 fixture runs Alembic over some 1,300 lines of DDL and takes about a second;
``CREATE DATABASE ... TEMPLATE`` copies the built database in a few tens of milliseconds. So the
schema is built once per session and each test gets a copy it may commit into and forget.

The server is the throwaway one of :mod:`awa_sa.testing.server` unless the caller names an existing
one. There the kit needs a role with CREATEDB, and it names every database it makes with a token
drawn per session, so concurrent sessions on one server (pytest-xdist workers, two CI jobs) never
touch each other's databases.
"""

from __future__ import annotations

import itertools
import uuid
from contextlib import suppress
from dataclasses import dataclass, field

import sqlalchemy as sa

from awa_sa.testing.errors import UnusableServer
from awa_sa.testing.server import EmbeddedPostgres

FIXTURE_SCHEMAS = ("awa", "awa_qs")
"""Queue-storage substrates the template gets: the v040 default and one named schema."""

INSUFFICIENT_PRIVILEGE = "42501"

NAME_PREFIX = "awa_sa_kit_"
"""Every database the kit creates starts with this, so leftovers of a killed run are findable."""


def psycopg_url(url: str | sa.URL) -> sa.URL:
    """*url* with the psycopg 3 driver, whatever scheme it was given with (``postgres://`` too)."""
    return sa.make_url(url).set(drivername="postgresql+psycopg")


@dataclass
class Databases:
    """The databases of one test session on one server.

    :meth:`open` starts (or connects to) the server and builds the template; :meth:`create`
    clones it; :meth:`close` drops the template and stops a server the kit started.
    """

    admin: sa.Engine
    """AUTOCOMMIT connections to the maintenance database: CREATE/DROP DATABASE cannot run in
    a transaction."""
    server: EmbeddedPostgres | None = None
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    _numbers: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def template(self) -> str:
        return f"{NAME_PREFIX}{self.token}_template"

    @classmethod
    def open(cls, server_url: str | None = None) -> Databases:
        """Use the server at *server_url* (a maintenance database URL), or start a throwaway one.

        Raises :class:`~awa_sa.testing.errors.EmbeddedPostgresError` when no server can be
        started and :class:`~awa_sa.testing.errors.UnusableServer` when the given one cannot be
        used.
        """
        server = None
        if server_url is None:
            server = EmbeddedPostgres()
            try:
                server.start()
            except BaseException:
                server.stop()
                raise
            server_url = server.url
        admin = sa.create_engine(
            psycopg_url(server_url), isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=0
        )
        databases = cls(admin=admin, server=server)
        try:
            databases._check_createdb()
            databases._build_template()
        except BaseException:
            with suppress(Exception):  # keep the reason it failed, not a cleanup error
                databases.close()
            raise
        return databases

    def url(self, dbname: str) -> str:
        """The psycopg 3 URL of database *dbname* on this server, password included."""
        return self.admin.url.set(database=dbname).render_as_string(hide_password=False)

    def create(self, template: str | None = None) -> str:
        """A new database cloned from *template* (the kit's own by default); returns its name.

        On a server the kit started, the clone copies the template's files (``STRATEGY
        FILE_COPY``) rather than logging every page: for a 30 MB v040 database half the time,
        where the checkpoints it forces cost nothing (no fsync, nothing else on the server). An
        existing server keeps PostgreSQL's default, as a checkpoint there is everyone's.
        """
        name = f"{NAME_PREFIX}{self.token}_{next(self._numbers)}"
        strategy = " STRATEGY FILE_COPY" if self.server is not None else ""
        self._admin_sql(
            f'CREATE DATABASE "{name}" TEMPLATE "{template or self.template}"{strategy}'
        )
        return name

    def drop(self, dbname: str) -> None:
        """Drop *dbname*, ending any connection a test left open to it.

        ``FORCE`` ends every backend on the database, an autovacuum worker too, and a role
        without superuser or ``pg_signal_backend`` may not signal one (on a server the kit was
        given, the template it just built draws autovacuum). A plain ``DROP DATABASE`` ends an
        autovacuum worker by itself, so that is the fallback when ``FORCE`` is refused.
        """
        try:
            self._admin_sql(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        except sa.exc.DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) != INSUFFICIENT_PRIVILEGE:
                raise
            self._admin_sql(f'DROP DATABASE IF EXISTS "{dbname}"')

    def close(self) -> None:
        """Drop the template, then stop the throwaway server (which removes all of it)."""
        try:
            if self.server is None:
                self._drop_template()
        finally:
            self.admin.dispose()
            if self.server is not None:
                self.server.stop()

    def _admin_sql(self, sql: str) -> None:
        with self.admin.connect() as conn:
            conn.exec_driver_sql(sql)

    def _check_createdb(self) -> None:
        where = self.admin.url.render_as_string(hide_password=True)
        try:
            with self.admin.connect() as conn:
                allowed = conn.exec_driver_sql(
                    "SELECT rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user"
                ).scalar_one()
        except sa.exc.DBAPIError as exc:
            raise UnusableServer(f"cannot connect to {where}: {exc.orig}") from exc
        if not allowed:
            raise UnusableServer(
                f"the role of {where} lacks CREATEDB, and the kit creates a database for every "
                "test (ALTER ROLE ... CREATEDB)"
            )

    def _build_template(self) -> None:
        import awa_sa_schema  # Alembic: loaded only once a test asks for a database

        self._admin_sql(f'CREATE DATABASE "{self.template}"')
        engine = sa.create_engine(self.url(self.template), poolclass=sa.NullPool)
        try:
            with engine.begin() as conn:
                awa_sa_schema.build(conn, FIXTURE_SCHEMAS)
        finally:
            engine.dispose()
        # Nobody can connect to it any more, so no stray session can make a clone fail.
        self._admin_sql(
            f'ALTER DATABASE "{self.template}" WITH IS_TEMPLATE true ALLOW_CONNECTIONS false'
        )

    def _drop_template(self) -> None:
        with self.admin.connect() as conn:
            exists = conn.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": self.template}
            ).first()
        if exists:
            self._admin_sql(f'ALTER DATABASE "{self.template}" WITH IS_TEMPLATE false')
            self.drop(self.template)
