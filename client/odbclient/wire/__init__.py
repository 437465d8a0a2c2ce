"""Wire formats shared by odbclient and the daemon.

`odbclient.wire.odbd.v1` holds the gRPC stubs generated from `proto/odbd/v1/*.proto` by
`python proto/gen.py` (committed; `python proto/gen.py --check` fails when they are stale).
They live under odbclient, not odbd, so trainers and producers need no server code.
"""
