"""odbd: online dynamic batching daemon."""

import os

# gRPC's fork support (its pthread_atfork handlers) only serves a child that keeps using gRPC
# without exec, which no odbd child does: producers are spawned with vfork + exec, which runs
# no at-fork handler (odbd.ingest.spawn). gRPC reads this once, when it is imported: it must
# be set before any odbd module imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
