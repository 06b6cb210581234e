"""Issue 36 row 2: every metric the head publishes (router_node/metrics.py)
moves with what it measures; a metric published as a constant fails here.

Two layers: the collector read against a router-shaped state whose sources are
set to two values in turn (each metric, each counter: no sockets), and a real
cluster (head + null engines, the Prometheus endpoint scraped over HTTP) whose
gauges rise under long streams and fall back after."""

from __future__ import annotations

import json
import threading
import types
import urllib.request

import pytest

from bus import protocol as P
from router_node.metrics import RouterCollector
from router_node.registry import EngineEntry, EngineState
from tests.cluster import wait_until


def _entry(eid: str) -> EngineEntry:
    reg = types.SimpleNamespace(engine_id=eid, capacity=8)
    return EngineEntry(reg=reg, sock=None, registered_at=0.0)  # type: ignore[arg-type]


def _router(entries: list[EngineEntry]) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        counters={"requests": 0, "failovers": 0, "engine_dead": 0, "errors": 0},
        forwarding=types.SimpleNamespace(flights={}),
        sessions=types.SimpleNamespace(n=0, count=lambda: 0),
        control=types.SimpleNamespace(cluster=types.SimpleNamespace(version=0)),
        engines={e.engine_id: e for e in entries},
    )


def _scrape(r) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in RouterCollector(r).collect():
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _set_sessions(r, n):
    r.sessions.count = lambda: n


SETTERS = {
    "rollout_bus_in_flight": lambda r, v: setattr(r.forwarding, "flights", {i: None for i in range(v)}),
    "rollout_bus_sessions": _set_sessions,
    "rollout_bus_cluster_weight_version": lambda r, v: setattr(r.control.cluster, "version", v),
    "rollout_bus_stale_engines": lambda r, v: [
        setattr(e, "state", EngineState.STALE if i < v else EngineState.HEALTHY)
        for i, e in enumerate(r.engines.values())
    ],
}
PER_ENGINE = {
    "rollout_bus_engine_healthy": (
        lambda e, v: setattr(e, "state", EngineState.HEALTHY if v else EngineState.SILENT),
        (1, 0),
    ),
    "rollout_bus_engine_outstanding": (lambda e, v: setattr(e, "outstanding", v), (3, 7)),
    "rollout_bus_engine_weight_version": (lambda e, v: setattr(e, "weight_version", v), (2, 5)),
    "rollout_bus_engine_kv_usage": (
        lambda e, v: setattr(e, "hb", P.Heartbeat(engine_id=e.engine_id, incarnation="i0", kv_usage=v)),
        (0.125, 0.75),
    ),
}


@pytest.mark.parametrize("name", sorted(SETTERS))
def test_each_cluster_gauge_follows_its_source(name):
    r = _router([_entry("e0"), _entry("e1")])
    seen = []
    for v in (1, 2):
        SETTERS[name](r, v)
        seen.append(_scrape(r)[(name, ())])
    assert seen == [1, 2]


@pytest.mark.parametrize("name", sorted(PER_ENGINE))
def test_each_per_engine_gauge_follows_its_engine(name):
    r = _router([_entry("e0"), _entry("e1")])
    setter, values = PER_ENGINE[name]
    for e, v in zip(r.engines.values(), values, strict=True):
        setter(e, v)
    got = _scrape(r)
    assert [got[(name, (("engine", eid),))] for eid in ("e0", "e1")] == list(values)


def test_every_counter_is_published_with_its_value():
    r = _router([_entry("e0")])
    for step in (1, 2):
        for i, k in enumerate(sorted(r.counters)):
            r.counters[k] = step * 10 + i
        got = _scrape(r)
        assert {k: got[(f"rollout_bus_{k}_total", ())] for k in r.counters} == r.counters


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


@pytest.mark.timeout(90)
def test_the_heads_gauges_rise_under_load_and_fall_after(cluster_factory, tmp_path):
    """Real head and null engines: while 12 long streams run, in_flight,
    outstanding and kv_usage (the engines' own report, through heartbeats) are
    above 0 on /metrics; after, they are back to 0 and requests_total counted
    every request."""
    ready = tmp_path / "head.json"
    opts = {"tokens_per_step": 1, "step_delay_s": 0.02, "capacity": 8}
    cl = cluster_factory(
        2, backend="null", backend_options=opts, router_args=["--metrics-port", "0", "--ready-file", str(ready)]
    )
    cl.wait_ready(2)
    url = json.loads(ready.read_text())["metrics"]
    c = cl.client()
    before = _metrics(url)
    done = threading.Event()
    results: list = []

    def load() -> None:
        try:
            results.extend(c.generate([[4, 5, i] for i in range(12)], {"max_tokens": 120, "ignore_eos": True}))
        finally:
            done.set()

    t = threading.Thread(target=load, daemon=True)
    t.start()

    def busy():
        m = _metrics(url)
        kv = [m.get(f'rollout_bus_engine_kv_usage{{engine="{e}"}}', 0.0) for e in ("e0", "e1")]
        out = [m.get(f'rollout_bus_engine_outstanding{{engine="{e}"}}', 0.0) for e in ("e0", "e1")]
        return m if m["rollout_bus_in_flight"] > 0 and min(kv) > 0 and min(out) > 0 else None

    during = wait_until(busy, 30, "the gauges to rise under load", interval=0.05)
    assert not done.is_set() or len(results) == 12
    t.join(60)
    assert len(results) == 12

    def idle():
        m = _metrics(url)
        kv = [m[f'rollout_bus_engine_kv_usage{{engine="{e}"}}'] for e in ("e0", "e1")]
        return m if m["rollout_bus_in_flight"] == 0 and max(kv) == 0.0 else None

    after = wait_until(idle, 15, "the gauges to fall after the load", interval=0.1)
    assert after["rollout_bus_requests_total"] - before["rollout_bus_requests_total"] == 12
    assert during['rollout_bus_engine_kv_usage{engine="e0"}'] > 0
