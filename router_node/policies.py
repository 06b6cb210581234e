"""Routing policies. Pure functions of the candidate list: easy to test.

- random: uniform over healthy candidates.
- least_loaded: power of two choices on outstanding sequences (the router's
  own count, fresher than any heartbeat).
- sessions: sticky-least-loaded. A new session is placed by least load (all
  candidates compared, so a burst of new sessions spreads instead of piling
  onto one replica); it stays while that engine is healthy, is re-placed when
  it is not, and is released by end_session or after the TTL.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

from router_node.registry import EngineEntry


def pick_random(cands: Sequence[EngineEntry], rng: random.Random) -> EngineEntry:
    return cands[rng.randrange(len(cands))]


def pick_least_loaded(cands: Sequence[EngineEntry], rng: random.Random) -> EngineEntry:
    if len(cands) == 1:
        return cands[0]
    a, b = rng.sample(range(len(cands)), 2)
    ea, eb = cands[a], cands[b]
    return ea if _load(ea) <= _load(eb) else eb


def pick_least_loaded_exact(cands: Sequence[EngineEntry], rng: random.Random) -> EngineEntry:
    best = min(_load(e) for e in cands)
    ties = [e for e in cands if _load(e) == best]
    return ties[rng.randrange(len(ties))]


def _load(e: EngineEntry) -> float:
    return e.outstanding / max(1, e.reg.capacity)


POLICIES: dict[str, Callable[[Sequence[EngineEntry], random.Random], EngineEntry]] = {
    "random": pick_random,
    "least_loaded": pick_least_loaded,
}


class Sessions:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._map: dict[str, tuple[str, float]] = {}  # session -> (engine id, last used)

    def engine_for(self, session_id: str, now: float) -> str | None:
        hit = self._map.get(session_id)
        if hit is None:
            return None
        if now - hit[1] > self.ttl_s:
            del self._map[session_id]
            return None
        return hit[0]

    def bind(self, session_id: str, engine_id: str, now: float) -> None:
        self._map[session_id] = (engine_id, now)

    def end(self, session_id: str) -> bool:
        return self._map.pop(session_id, None) is not None

    def expire(self, now: float) -> int:
        old = [s for s, (_, t) in self._map.items() if now - t > self.ttl_s]
        for s in old:
            del self._map[s]
        return len(old)

    def count(self, engine_id: str | None = None) -> int:
        if engine_id is None:
            return len(self._map)
        return sum(1 for e, _ in self._map.values() if e == engine_id)
