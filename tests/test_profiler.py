"""bus/profiler.py: the benchmark sampling profiler sees a busy thread's
function, and start_from_env is off without its variable."""

from __future__ import annotations

import threading
import time

import pytest

from bus.profiler import ENV_DIR, StackSampler, start_from_env

pytestmark = pytest.mark.timeout(30)


def _spin_here(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def test_sampler_attributes_time_to_the_busy_function():
    stop = threading.Event()
    t = threading.Thread(target=_spin_here, args=(stop,), name="busy")
    t.start()
    s = StackSampler(0.001).start()
    try:
        time.sleep(0.3)
    finally:
        s.stop()
        stop.set()
        t.join()
    assert s.samples["busy"] > 20
    top_incl = s.incl["busy"].most_common(3)
    assert any(k.startswith("_spin_here ") for k, _ in top_incl), top_incl
    text = s.report()
    assert "== thread busy" in text and "_spin_here (test_profiler.py:" in text


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(ENV_DIR, raising=False)
    assert start_from_env("x") is None
