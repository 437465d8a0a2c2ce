"""The node daemon: ingest bookkeeping, the round loop, and wiring of the services."""
