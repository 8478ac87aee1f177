"""The kit's server start: a port taken meanwhile costs a retry, any other failure says why."""

from __future__ import annotations

import socket

import pytest
import sqlalchemy as sa

from awa_sa.testing.errors import EmbeddedPostgresError
from awa_sa.testing.server import EmbeddedPostgres


def test_a_port_taken_before_the_server_binds_it_is_traded_for_another() -> None:
    server = EmbeddedPostgres()
    with socket.socket() as squatter:
        squatter.bind((server.host, server.port))
        squatter.listen()
        taken = server.port
        try:
            server.start()
            assert server.port != taken
            engine = sa.create_engine(server.url, poolclass=sa.NullPool)
            with engine.connect() as conn:
                assert conn.exec_driver_sql("SELECT 1").scalar() == 1
            engine.dispose()
        finally:
            server.stop()


def test_a_server_that_will_not_start_names_the_reason_from_its_log() -> None:
    server = EmbeddedPostgres(settings=("no_such_setting=1",))
    try:
        with pytest.raises(EmbeddedPostgresError, match='"no_such_setting"'):
            server.start()
    finally:
        server.stop()
