"""Weight update ids, client side. The head binds them (router_node/
cluster_state.py, issue 34: nothing can be replayed): a begin takes the id
health() names (`next_update_id`, "<head incarnation>.<n>") or any later n of
the same head; an older or foreign one is refused (StaleUpdate, field
update_id) and nothing begins.

One per client (head connection): the id it last learned, advanced by each id
it takes, so a steady-state update that reads no health
(trainer_bridge/transports/gpu.py) still begins under a fresh id.

Sender secrets (issue 34, row 3; bus/protocol_weights.py): the head returns
an update's secret to the client that opened it, in the begin's reply; the
client keeps it here by update id (the last few), and every sender path of
that client (zmq buckets, GPU parts' ReceiveWeights) takes it from here. A
sender in another process is given it with the update id
(`weight_sender(update_id, rank, sender_secret=...)`), which keeps it here too.
"""

from __future__ import annotations

import uuid
import weakref
from typing import Any

from bus import protocol as P

_NEXT_IDS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_SECRETS: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()
_KEEP_SECRETS = 8  # updates are one at a time: a few ids back is plenty


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


def keep_sender_secret(client: Any, update_id: str, secret: str) -> None:
    """Remember `update_id`'s sender secret for this client's senders."""
    if not secret:
        return
    kept = _SECRETS.setdefault(client, {})
    kept.pop(update_id, None)
    kept[update_id] = secret
    while len(kept) > _KEEP_SECRETS:
        kept.pop(next(iter(kept)))


def sender_secret(client: Any, update_id: str) -> str:
    """`update_id`'s sender secret as this client learned it ("" if it did not)."""
    return _SECRETS.get(client, {}).get(update_id, "")
