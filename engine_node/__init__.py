"""Engine node: one process per inference engine (see node.py)."""
