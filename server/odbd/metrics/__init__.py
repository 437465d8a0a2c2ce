"""Metrics: plain stats updated on the hot path, turned into Prometheus families at scrape time."""
