"""The callback calls' statements: canonical (``canonical``) and queue storage (``leases``)."""
