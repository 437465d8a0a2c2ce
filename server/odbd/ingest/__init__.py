"""Ingest: the node's shared-memory arena (`arena`), where producers write samples.

Byte layouts and the attach side are in `odbclient.shm`, shared with producers and trainers.
"""
