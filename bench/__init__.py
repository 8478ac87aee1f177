"""Benchmark: awa-sa against the raw-psycopg floor, in one run on one throwaway database."""
