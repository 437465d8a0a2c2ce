"""odbd: online dynamic batching daemon."""
