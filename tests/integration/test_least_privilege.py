"""An application role with only the GRANTs docs/deploying.md gives runs the whole driver walk.

The GRANTs are read out of the docs (the ``sql`` block under "Least privilege") and run on a
clone of an ``awa migrate`` cluster; the role is no superuser, owns nothing and may create
nothing. The walk of ``test_drivers.py`` (every outcome, the batch, errors, both routings) as
that role, on every driver, gives the outcomes, statements and rows the superuser gets.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from calling import DRIVERS
from conftest import Cluster, _janitor
from test_drivers import Face, Walk, seeded_database, walk

from awa_sa.testing.server import EmbeddedPostgres

DOCS = Path(__file__).parents[2] / "docs" / "deploying.md"
ROLE_IN_DOCS = "awa_app"


def documented_grants() -> list[str]:
    """The statements of the docs' least-privilege block, in order."""
    text = DOCS.read_text()
    section = text[text.index("## Least privilege") :]
    block = re.search(r"```sql\n(.*?)```", section, re.S)
    assert block is not None, "no sql block under '## Least privilege' in docs/deploying.md"
    return [s.strip() for s in block.group(1).split(";") if s.strip()]


@pytest.fixture(scope="module")
def seeded_real(pg: EmbeddedPostgres, real_template: str) -> Iterator[tuple[str, Any]]:
    """The walk's seeded database on an ``awa migrate`` cluster, a source for clones."""
    with seeded_database(pg, real_template, f"privilege_{uuid.uuid4().hex[:12]}") as source:
        yield source


def _walk(
    pg: EmbeddedPostgres,
    source: tuple[str, Any],
    driver: str,
    role: str | None,
    leave_out: str = "",
) -> Walk:
    """*driver*'s walk on a fresh clone, as *role* (granted as the docs say, but for the GRANT
    starting with *leave_out*) or the superuser."""
    name = f"privilege_{uuid.uuid4().hex[:12]}"
    janitor = _janitor(pg, name, template=source[0])
    janitor.init()
    observer = sa.create_engine(pg.database_url(name), poolclass=sa.NullPool)
    url = sa.make_url(pg.database_url(name))
    if role is not None:
        with observer.begin() as conn:
            for statement in documented_grants()[1:]:
                if not (leave_out and statement.startswith(leave_out)):
                    conn.exec_driver_sql(statement.replace(ROLE_IN_DOCS, role))
        url = url.set(username=role, password=role)
    face = Face(driver, url.render_as_string(hide_password=False))
    try:
        return walk(face, Cluster("real", pg, pg.database_url(name), observer), source[1])
    finally:
        face.dispose()
        observer.dispose()
        janitor.drop()


@pytest.fixture(scope="module")
def role(pg: EmbeddedPostgres) -> Iterator[str]:
    """The docs' role, under a name of its own (roles are shared by the whole server)."""
    name = f"app_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(pg.url, poolclass=sa.NullPool)
    create = documented_grants()[0].replace(ROLE_IN_DOCS, name).replace("change-me", name)
    with admin.begin() as conn:
        conn.exec_driver_sql(create)
    yield name
    with admin.begin() as conn:
        conn.exec_driver_sql(f"DROP ROLE {name}")
    admin.dispose()


@pytest.fixture(scope="module")
def superuser_walk(pg: EmbeddedPostgres, seeded_real: tuple[str, Any]) -> Walk:
    return _walk(pg, seeded_real, "psycopg", None)


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_walk_as_the_documented_role_matches_the_superuser(
    driver: str,
    pg: EmbeddedPostgres,
    seeded_real: tuple[str, Any],
    superuser_walk: Walk,
    role: str,
) -> None:
    got = _walk(pg, seeded_real, driver, role)
    assert got.results == superuser_walk.results
    assert got.sent == superuser_walk.sent
    for table, rows in superuser_walk.tables.items():
        assert got.tables[table] == rows, table


def test_the_documented_role_is_no_superuser_and_creates_only_lane_sequences() -> None:
    """CREATE on the queue-storage schema alone: Awa's ``ensure_lane_sequences``, which the
    queue-storage branch calls, creates a lane's sequences the first time the lane is used."""
    create, *grants = documented_grants()
    assert create == f"CREATE ROLE {ROLE_IN_DOCS} LOGIN PASSWORD 'change-me'"
    assert all(g.startswith("GRANT ") and g.endswith(f" TO {ROLE_IN_DOCS}") for g in grants)
    ddl = [
        g
        for g in grants
        if re.search(r"\b(CREATE|ALL PRIVILEGES|TRUNCATE|REFERENCES|TRIGGER)\b", g)
    ]
    assert ddl == [f"GRANT CREATE ON SCHEMA awa_qs TO {ROLE_IN_DOCS}"]


def test_without_create_on_the_queue_storage_schema_a_new_lane_is_refused(
    pg: EmbeddedPostgres, seeded_real: tuple[str, Any], superuser_walk: Walk, role: str
) -> None:
    got = _walk(pg, seeded_real, "psycopg", role, leave_out="GRANT CREATE")
    first_qs = next(i for i, r in enumerate(superuser_walk.results) if r != got.results[i])
    assert got.results[:first_qs] == superuser_walk.results[:first_qs]  # canonical: all alike
    assert got.results[first_qs] == ("DatabaseError", "42501", None)
