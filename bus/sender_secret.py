"""The weight-update sender secret (issue 34, row 3), minted and checked in
one place: the head mints one per update (router_node/cluster_state.py) and
checks it on GPU parts and on prepare / finish / abort from a client other
than the opener; the engine checks it on every bucket and sender end
(engine_node/sender_check.py). The wire fields are in bus/protocol_weights.py.

Hazards:
- fail closed: an expected secret of "" (none was minted) admits nobody, so a
  missing secret can never match a missing one;
- constant time, and neither value ever goes into a message: refusals go back
  to the peer and into logs.
"""

from __future__ import annotations

import hmac
import secrets

from bus.protocol_weights import SENDER_SECRET_BYTES


def new_sender_secret() -> str:
    """128 random bits, hex (fits a Short)."""
    return secrets.token_hex(SENDER_SECRET_BYTES)


def proves_sender_secret(given: str, expected: str) -> bool:
    """True only when a secret was minted and `given` is it."""
    return bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


def what_was_wrong(given: str) -> str:
    """The refusal's words, never the value: "no" or "a wrong" sender secret."""
    return "no" if not given else "a wrong"
