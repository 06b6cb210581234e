"""Weight update ids, client side. The head binds them (router_node/
cluster_state.py, issue 34: nothing can be replayed): a begin takes the id
health() names (`next_update_id`, "<head incarnation>.<n>") or any later n of
the same head; an older or foreign one is refused (StaleUpdate, field
update_id) and nothing begins.

One per client (head connection): the id it last learned, advanced by each id
it takes, so a steady-state update that reads no health
(trainer_bridge/transports/gpu.py) still begins under a fresh id.
"""

from __future__ import annotations

import uuid
import weakref
from typing import Any

from bus import protocol as P

_NEXT_IDS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def learn_update_id(client: Any, h: P.HealthView) -> None:
    """Keep the head's next update id from a health read."""
    if h.next_update_id:
        _NEXT_IDS[client] = h.next_update_id


def take_update_id(client: Any) -> str:
    """A fresh id for the next begin: the head's next one as last learned
    (then the one after it), or a random one for a head that binds none (a
    head that does refuses it naming its own; trainer_bridge/weights.py's
    `WeightUpdate.open` reads health and retries once)."""
    nxt = _NEXT_IDS.get(client)
    inc, _, n = (nxt or "").rpartition(".")
    if not inc or not n.isdigit():
        return uuid.uuid4().hex[:16]
    _NEXT_IDS[client] = f"{inc}.{int(n) + 1}"
    return str(nxt)
