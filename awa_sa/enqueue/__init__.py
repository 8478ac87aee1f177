"""Enqueueing jobs in the caller's transaction, writing what awa-pg's producer writes.

``api`` (and ``api_async``) hold the public calls, ``new_jobs`` the values they take and
answer, ``statements`` the builders.
"""
