"""Backends of the engine node (see engine_node.backend.BACKENDS)."""
