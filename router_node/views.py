"""The head's answers to queries (bus/views.py): health, engines, stats.
I/O-free: the router loop calls these with its registry, intended state,
weight coordinator and counters and sends what they return.

Ownership: the router loop thread (everything read here is its state).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import msgspec

from bus import protocol as P
from router_node.cluster_state import ClusterWeights
from router_node.intended_state import IntendedState, Intent
from router_node.policies import Sessions
from router_node.prefix import PrefixPlacement
from router_node.registry import EngineEntry, EngineState


def intent_view(it: Intent) -> P.IntentView:
    return P.IntentView(paused=sorted(it.paused), sleeping=it.sleep, asleep=sorted(it.asleep))


def engine_view(e: EngineEntry, now: float, intended: IntendedState, sessions: Sessions) -> P.EngineView:
    """An engine's registry view plus the head's intent for it. The paused /
    sleep state an ack confirmed, newer than the last heartbeat, wins over the
    heartbeat's."""
    v = e.view(now)
    iv = intended.engines.get(e.engine_id)
    if iv is None:
        return msgspec.structs.replace(v, sessions=sessions.count(e.engine_id))
    known = iv.known
    confirmed = (
        {"paused": sorted(known.gate), "sleeping": known.sleeping, "asleep": sorted(known.tags)} if known.valid else {}
    )
    return msgspec.structs.replace(
        v,
        sessions=sessions.count(e.engine_id),
        intended=intent_view(iv.intent),
        converging=iv.converging,
        corrections=iv.corrections,
        **confirmed,
    )


def health_view(
    engines: Mapping[str, EngineEntry],
    intended: IntendedState,
    sessions: Sessions,
    cluster: ClusterWeights,
    vocab_size: int,
) -> P.HealthView:
    now = time.monotonic()
    return P.HealthView(
        healthy=any(e.healthy for e in engines.values()),
        engines={eid: engine_view(e, now, intended, sessions) for eid, e in engines.items()},
        weight_version=cluster.version,
        source=cluster.source,
        updates_committed=cluster.updates_committed,
        weight_update=cluster.current_view(),
        stale=sorted(eid for eid, e in engines.items() if e.state is EngineState.STALE),
        intended=intent_view(intended.cluster),
        converging=sorted(eid for eid, e in engines.items() if e.state is EngineState.CONVERGING),
        vocab_size=vocab_size,
        next_update_id=cluster.next_update_id,
    )


def engines_view(engines: Mapping[str, EngineEntry], intended: IntendedState, sessions: Sessions) -> P.EnginesView:
    now = time.monotonic()
    return P.EnginesView(engines=[engine_view(e, now, intended, sessions) for e in engines.values()])


def stats_view(
    counters: Mapping[str, int], in_flight: int, sessions: Sessions, prefix: PrefixPlacement | None
) -> P.StatsView:
    return P.StatsView(
        counters=dict(counters),
        in_flight=in_flight,
        sessions=sessions.count(),
        prefix=None if prefix is None else prefix.view(),
    )
