"""Administering jobs in the caller's transaction: cancel, retry, discard.

``api`` holds the public calls; ``queue_storage`` and ``callback_leases`` the queue-storage
branches; ``statements`` the builders. Cancelling a running attempt is settling it, so this
capability builds on :mod:`awa_sa.settle`, the one edge between capabilities.
"""
