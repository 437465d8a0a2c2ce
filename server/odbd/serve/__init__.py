"""Batch serving: per-rank step queues and the trainer service."""
