"""Callbacks: ending a job that waits on an external callback in the caller's transaction,
as awa-pg 0.6.9's ``Client.complete_external`` and its siblings do (docs/callbacks.md)."""
