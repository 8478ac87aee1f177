"""A testing kit for services that embed awa-sa: helpers here, fixtures in ``pytest_awa_sa``.

``pip install awa-sa[testing]`` registers the pytest plugin, whose fixtures (``awa_url``,
``awa_engine``, ``awa_async_engine`` on the driver ``awa_async_driver`` names) give each test a
fresh Awa v040 database; :func:`installed_async_drivers` lists the drivers a test can ask for.
These helpers work on any ``Connection`` to such a database, inside its transaction:

* :func:`running_attempt` -- a job in ``awa.jobs_hot`` as a worker's claim leaves it;
* :func:`contested_attempt` -- one whose unique key a newer duplicate holds;
* :func:`queue_storage_attempt` -- a receipt in a queue-storage schema, as a runtime's claim
  leaves it (:func:`job_of` gives the job its handler would receive);
* :func:`set_phase` -- a storage transition phase, as ``awa storage ...`` leaves it;
* :func:`locate` -- where a job is now (:class:`Location`).

The middle layer: the kit imports the core, the tools import the kit, never the reverse
(docs/architecture.md#modules).
"""

from awa_sa.testing.attempts import ContestedAttempt, contested_attempt, running_attempt
from awa_sa.testing.drivers import installed_async_drivers
from awa_sa.testing.locate import Location, locate
from awa_sa.testing.phases import Phase, set_phase
from awa_sa.testing.receipts import job_of, queue_storage_attempt

__all__ = [
    "ContestedAttempt",
    "Location",
    "Phase",
    "contested_attempt",
    "installed_async_drivers",
    "job_of",
    "locate",
    "queue_storage_attempt",
    "running_attempt",
    "set_phase",
]
