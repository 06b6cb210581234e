"""Routing policies. Pure functions of the candidate list: easy to test.

- random: uniform over healthy candidates.
- least_loaded: power of two choices on outstanding sequences (the router's
  own count, fresher than any heartbeat).
- sessions: sticky-least-loaded. A new session is placed by least load, where
  load counts the engine's OPEN sessions as well as its outstanding requests
  (all candidates compared). An open multi-turn session between turns has no
  request in flight but will come back with a growing prefix to keep in KV:
  counting only outstanding requests piles idle sessions onto one replica.
  A session stays while its engine is healthy, is re-placed when it is not,
  and is released by end_session or after the TTL.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

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


def pick_for_new_session(cands: Sequence[EngineEntry], sessions: Sessions, rng: random.Random) -> EngineEntry:
    """Fewest (open sessions + outstanding requests) per unit of capacity; ties at random."""

    def load(e: EngineEntry) -> float:
        return (sessions.count(e.engine_id) + e.outstanding) / max(1, e.reg.capacity)

    best = min(load(e) for e in cands)
    ties = [e for e in cands if load(e) == best]
    return ties[rng.randrange(len(ties))]


def pick_by_outstanding(cands: Sequence[EngineEntry], sessions: Sessions, rng: random.Random) -> EngineEntry:
    """Outstanding requests only: idle open sessions weigh nothing (pre-0.2)."""
    return pick_least_loaded_exact(cands, rng)


SESSION_PLACEMENTS: dict[str, Callable[[Sequence[EngineEntry], Sessions, random.Random], EngineEntry]] = {
    "open_sessions": pick_for_new_session,
    "outstanding": pick_by_outstanding,
}


class Sessions:
    """session id -> (engine id, last used), with per-engine counts kept in
    step so placement reads them in O(1)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._map: dict[str, tuple[str, float]] = {}
        self._per_engine: dict[str, int] = {}
        # Who opened each session (issue 22: a cap per client): a session
        # belongs to the client whose request created it.
        self._owner: dict[str, bytes] = {}
        self._per_owner: dict[bytes, int] = {}

    def engine_for(self, session_id: str, now: float) -> str | None:
        hit = self._map.get(session_id)
        if hit is None:
            return None
        if now - hit[1] > self.ttl_s:
            self._drop(session_id)
            return None
        return hit[0]

    def bind(self, session_id: str, engine_id: str, now: float, owner: bytes = b"") -> None:
        old = self._map.get(session_id)
        if old is not None:
            self._dec(old[0])
        elif session_id not in self._owner:
            self._owner[session_id] = owner
            self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
        self._map[session_id] = (engine_id, now)
        self._per_engine[engine_id] = self._per_engine.get(engine_id, 0) + 1

    def end(self, session_id: str) -> bool:
        return self._drop(session_id)

    def expire(self, now: float) -> int:
        old = [s for s, (_, t) in self._map.items() if now - t > self.ttl_s]
        for s in old:
            self._drop(s)
        return len(old)

    def count(self, engine_id: str | None = None) -> int:
        if engine_id is None:
            return len(self._map)
        return self._per_engine.get(engine_id, 0)

    def owned(self, owner: bytes) -> int:
        """Open sessions the client `owner` created."""
        return self._per_owner.get(owner, 0)

    def knows(self, session_id: str) -> bool:
        return session_id in self._map

    def per_engine(self) -> dict[str, int]:
        return dict(self._per_engine)

    def _drop(self, session_id: str) -> bool:
        hit = self._map.pop(session_id, None)
        if hit is None:
            return False
        self._dec(hit[0])
        owner = self._owner.pop(session_id, None)
        if owner is not None:
            n = self._per_owner.get(owner, 0) - 1
            if n > 0:
                self._per_owner[owner] = n
            else:
                self._per_owner.pop(owner, None)
        return True

    def _dec(self, engine_id: str) -> None:
        n = self._per_engine.get(engine_id, 0) - 1
        if n > 0:
            self._per_engine[engine_id] = n
        else:
            self._per_engine.pop(engine_id, None)


def check_policies(policy: str, session_placement: str) -> None:
    """The head's --policy and --session-placement name known ones (ValueError naming the flag)."""
    if session_placement not in SESSION_PLACEMENTS:
        raise ValueError(f"--session-placement must be one of {sorted(SESSION_PLACEMENTS)}, got {session_placement!r}")
    if policy not in POLICIES and policy != "prefix":
        raise ValueError(f"--policy must be one of {sorted([*POLICIES, 'prefix'])}, got {policy!r}")
