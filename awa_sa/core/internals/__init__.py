"""Every place awa-sa reaches past SQLAlchemy's or a driver's public API, each with its reason.

One package, so that a SQLAlchemy or driver upgrade has one place to look, split by concern:
which private names this process may use (:mod:`~awa_sa.core.internals.lookup`, where each is
checked once, at import, with the public path each falls back to), the kept greenlet of the
async faces (:mod:`~awa_sa.core.internals.greenlet`), a connection's state
(:mod:`~awa_sa.core.internals.connecting`), a function under a translated schema
(:mod:`~awa_sa.core.internals.schema`), the lean execution of a statement's text
(:mod:`~awa_sa.core.internals.lean`) and the Engine form's direct path
(:mod:`~awa_sa.core.internals.direct`). Each use is covered by the suite on every supported line
(SQLAlchemy 2.0 and 2.1, every driver), the test named beside it, and the suite runs with
``AWA_SA_PUBLIC_ONLY=1`` too, on the public paths alone.
"""

from awa_sa.core.internals import lookup
from awa_sa.core.internals.connecting import (
    UNKNOWN_LEVEL,
    autocommit_off,
    autocommit_on,
    connect_isolation_level,
    driver_isolation_level,
    in_autocommit,
    while_connecting,
)
from awa_sa.core.internals.direct import Direct, checkin_idle, checkout, direct_allowed
from awa_sa.core.internals.greenlet import run_in_greenlet
from awa_sa.core.internals.lean import fetched, lean_execute, positional_rows
from awa_sa.core.internals.lookup import PrivatePathUnavailable
from awa_sa.core.internals.schema import SchemaTranslatedFunction

__all__ = [
    "UNKNOWN_LEVEL",
    "Direct",
    "PrivatePathUnavailable",
    "SchemaTranslatedFunction",
    "autocommit_off",
    "autocommit_on",
    "checkin_idle",
    "checkout",
    "connect_isolation_level",
    "direct_allowed",
    "driver_isolation_level",
    "fetched",
    "in_autocommit",
    "lean_execute",
    "lookup",
    "positional_rows",
    "run_in_greenlet",
    "while_connecting",
]
