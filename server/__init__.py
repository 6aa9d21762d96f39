"""tilevox: server."""
