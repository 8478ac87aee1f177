"""Benchmark: awa-sa against each raw driver, the database's time, distance and concurrency."""
