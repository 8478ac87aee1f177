"""awa-sa."""
