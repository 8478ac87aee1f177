"""Awa's schema as SQLAlchemy Core tables: the canonical plane, the queue-storage plane, and
the runtime's tables the test fixture lacks. Declarations only; every capability reads them."""
