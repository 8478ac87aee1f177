"""The throwaway server takes extra settings (the bench loads pg_stat_statements with them)."""

from __future__ import annotations

import sqlalchemy as sa

from awa_sa.testing.server import embedded_postgres


def test_extra_settings_reach_the_server_and_it_is_removed_after() -> None:
    settings = ("shared_preload_libraries=pg_stat_statements", "work_mem=7MB")
    with embedded_postgres(settings) as server:
        engine = sa.create_engine(server.url, poolclass=sa.NullPool)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW work_mem")).scalar() == "7MB"
            loaded = conn.execute(sa.text("SHOW shared_preload_libraries")).scalar()
            assert loaded == "pg_stat_statements"
            assert conn.execute(sa.text("SHOW fsync")).scalar() == "off"  # ours still apply
        engine.dispose()
        root = server.root
    assert not root.exists()
