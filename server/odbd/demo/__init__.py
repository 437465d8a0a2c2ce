"""`odbd demo`: a local multi-node cluster on loopback with synthetic data (see command.py)."""
