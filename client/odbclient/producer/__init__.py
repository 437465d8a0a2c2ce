"""The producer side: what runs in a producer process, writing samples into shared memory.

A producer process (`python -m odbclient.producer.producer_main`, spawned by the daemon's
--workers or started by hand) loads the user's dataset (dataset), leases sample ids from its
node's daemon over the ingest socket, and writes each sample into its own lane of the daemon's
shared-memory arena (producer; the layout is planned once per sample structure in sample_plan
and the lane's bookkeeping is lane), then commits it so that the daemon can hand it to
trainers. The daemon reads a lane's header (lane.IDLE, LANE_HEADER_BYTES) and imports
producer_main and dataset for its --workers and --dataset, so this package's `__init__`
imports nothing. Nothing here reads batches; the trainer side (odbclient.trainer) does.
"""
