"""Who may feed an engine's open weight update (issue 34, row 3): the senders
of THAT update, proven by its sender secret (bus/protocol_weights.py), which
the head minted at the begin and handed to the engines in it. The weight
socket admits every token holder at the handshake (the CLIENT role); this
check is what tells the update's own senders from any other token holder.

I/O-free: engine_node/weight_socket.py asks before a bucket or a sender end
reaches the transaction (engine_node/weight_update.py).

Hazards:
- a refusal here must NOT abort the update: a peer that failed the
  credential is not the update's sender, and aborting for it is exactly the
  attack (one forged bucket used to end the real update); faults of a peer
  that passed it (a duplicate, a bad size) still abort, as before;
- fail closed, constant time, never echoed: bus/sender_secret.py (one
  primitive for the head and the engines).
"""

from __future__ import annotations

from typing import Any

from bus.errors import Unauthorized
from bus.sender_secret import proves_sender_secret, what_was_wrong


def check_sender(current: Any, update_id: str, secret: str, engine_id: str, what: str) -> None:
    """Raises Unauthorized (field sender_secret) when `update_id` names the
    open update `current` (engine_node.weight_update.WeightUpdate, or None)
    and `secret` is not its sender secret. Another id is not decided here: the
    transaction refuses it (it is not open), which touches no open update."""
    if current is None or current.update_id != update_id:
        return
    if proves_sender_secret(secret, current.begin.sender_secret):
        return
    raise Unauthorized(
        f"{engine_id}: {what} for weight update {update_id!r} carries {what_was_wrong(secret)} sender secret: only the senders of the open update "
        "feed it (the opener's WeightUpdate.sender_secret; another process: weight_sender(..., sender_secret=)); "
        "refused, the update goes on",
        field="sender_secret",
    )
