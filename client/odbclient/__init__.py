"""odbclient: trainer client and producer for odbd (no server dependencies)."""
