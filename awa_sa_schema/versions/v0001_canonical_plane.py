"""Canonical plane of Awa v040 in schema awa (tables, functions, triggers, seed rows).

Revision ID: v040_0001_canonical
Revises:
"""

from alembic import op

from awa_sa_schema.canonical import (  # type: ignore[import-not-found, unused-ignore]
    install_canonical,
    uninstall_canonical,
)

revision = "v040_0001_canonical"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    install_canonical(op.get_bind())


def downgrade() -> None:
    uninstall_canonical(op.get_bind())
