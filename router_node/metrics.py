"""Prometheus metrics of the head, collected at scrape time.

Nothing is counted on the forwarding path for Prometheus: the collector reads
the router's own counters and registry when scraped (from the exporter's
thread; it only reads, and copies containers in one C-level call under the
GIL before iterating them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from router_node.router import Router

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric


class RouterCollector:
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        r = self.router
        counters = dict(r.counters)
        for name, value in counters.items():
            yield CounterMetricFamily(f"rollout_bus_{name}", f"rollout-bus head: {name.replace('_', ' ')}", value=value)
        yield GaugeMetricFamily(
            "rollout_bus_in_flight", "requests the head is forwarding", value=len(r.forwarding.flights)
        )
        yield GaugeMetricFamily("rollout_bus_sessions", "live sticky sessions", value=r.sessions.count())
        yield GaugeMetricFamily(
            "rollout_bus_cluster_weight_version",
            "version of the last committed model update",
            value=r.control.cluster.version,
        )
        yield GaugeMetricFamily(
            "rollout_bus_stale_engines",
            "engines below the cluster weight version (no traffic until synced)",
            value=sum(1 for e in r.engines.values() if e.state.value == "stale"),
        )
        engines = list(r.engines.values())
        healthy = GaugeMetricFamily("rollout_bus_engine_healthy", "1 when the engine gets traffic", labels=["engine"])
        outstanding = GaugeMetricFamily(
            "rollout_bus_engine_outstanding", "sequences in flight per engine", labels=["engine"]
        )
        version = GaugeMetricFamily("rollout_bus_engine_weight_version", "weight version per engine", labels=["engine"])
        kv = GaugeMetricFamily("rollout_bus_engine_kv_usage", "KV cache usage per engine (0-1)", labels=["engine"])
        for e in engines:
            healthy.add_metric([e.engine_id], 1.0 if e.healthy else 0.0)
            outstanding.add_metric([e.engine_id], e.outstanding)
            version.add_metric([e.engine_id], e.weight_version)
            kv.add_metric([e.engine_id], e.hb.kv_usage if e.hb else 0.0)
        yield from (healthy, outstanding, version, kv)


def serve_metrics(router: Router, port: int, host: str = "127.0.0.1") -> int:
    """Expose /metrics on host:port (0: any free port); returns the port."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(RouterCollector(router))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server.server_port
