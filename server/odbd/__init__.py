"""odbd: online dynamic batching daemon."""

import os

# The daemon spawns its producers (fork + exec) while gRPC threads run. With gRPC's fork
# support on, every spawn logs "fork_posix.cc ... skipping fork() handlers"; the handlers only
# serve a child that keeps using gRPC without exec, which no odbd child does. gRPC reads this
# once, when it is imported: it must be set before any odbd module imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
