"""From a manifest and this machine to a stored entry without tracing: the store to open,
the toolchain facts, the key factors and the lookup, and why a key missed."""
