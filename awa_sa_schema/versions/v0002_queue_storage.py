"""Queue-storage substrate of Awa v040: the default one in awa, plus any extra schemas.

Extra names come from ``build(conn, names)`` or ``alembic -x qs_schema=a,b upgrade head``.

Revision ID: v040_0002_queue_storage
Revises: v040_0001_canonical
"""

from alembic import context, op

from awa_sa_schema.build import (  # type: ignore[import-not-found, unused-ignore]
    queue_storage_schemas,
)
from awa_sa_schema.queue_storage import (  # type: ignore[import-not-found, unused-ignore]
    install_queue_storage,
    installed_queue_storage_schemas,
    uninstall_queue_storage,
)

revision = "v040_0002_queue_storage"
down_revision = "v040_0001_canonical"
branch_labels = None
depends_on = None


def upgrade() -> None:
    connection = op.get_bind()
    x_arguments = context.get_x_argument(as_dictionary=True)
    for schema in queue_storage_schemas(context.config, x_arguments):
        install_queue_storage(connection, schema)


def downgrade() -> None:
    connection = op.get_bind()
    for schema in installed_queue_storage_schemas(connection):
        uninstall_queue_storage(connection, schema)
