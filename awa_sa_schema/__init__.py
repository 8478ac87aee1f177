"""The Awa v040 test fixture, built by Alembic: a minimal but faithful subset of the schema.

``build`` runs the migrations on a connection, ``install_queue_storage`` adds the queue-storage
substrate for a schema name, and ``set_phase`` moves the storage transition state the way the
published awa CLI would. What is included and why: docs/architecture.md#fixture.
"""

from .build import build
from .phases import PHASES, set_phase
from .queue_storage import has_queue_storage, install_queue_storage

__all__ = ["PHASES", "build", "has_queue_storage", "install_queue_storage", "set_phase"]
