"""tests/cluster.py's own promises: Cluster.wait_ready fails at once, naming
what exited, when the engines it waits for can no longer come (a real head and
a real engine process whose backend refuses its options and exits)."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.timeout(90)]


def test_wait_ready_fails_at_once_when_an_engine_cannot_start(cluster_factory) -> None:
    cl = cluster_factory(1, backend="null", backend_options={"vocab": 1})  # null backend: vocab >= 2
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="can no longer become ready") as e:
        cl.wait_ready(1, timeout_s=60)
    assert time.monotonic() - t0 < 30, "waited for an engine that had exited"
    assert "'e0'" in str(e.value) and "vocab" in str(e.value)  # which process, and its log's reason
    assert cl.head.poll() is None  # the head serves on
