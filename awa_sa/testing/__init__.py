"""A testing kit for services that embed awa-sa: helpers here, fixtures in ``pytest_awa_sa``.

``pip install awa-sa[testing]`` registers the pytest plugin, whose fixtures (``awa_url``,
``awa_engine``, ``awa_async_engine``) give each test a fresh Awa v040 database. These helpers
work on any ``Connection`` to such a database, inside its transaction:

* :func:`running_attempt` -- a job in ``awa.jobs_hot`` as a worker's claim leaves it;
* :func:`set_phase` -- a storage transition phase, as ``awa storage ...`` leaves it;
* :func:`locate` -- where a job is now (:class:`Location`).

The middle layer: the kit imports the core, the tools import the kit, never the reverse
(docs/architecture.md#modules).
"""

from awa_sa.testing.attempts import running_attempt
from awa_sa.testing.locate import Location, locate
from awa_sa.testing.phases import Phase, set_phase

__all__ = ["Location", "Phase", "locate", "running_attempt", "set_phase"]
