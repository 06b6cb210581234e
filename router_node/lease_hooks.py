"""What a client's control op takes or lets go of (router_node/leases.py):
one hook per op type, called by the router after the op was accepted. No I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from bus import protocol as P
from router_node.intended_state import IntendedState
from router_node.leases import SLEEP, Leases, pause, txn

Hook = Callable[[Leases, IntendedState, bytes, P.Control, float], None]


def _hold_pause(leases: Leases, intended: IntendedState, client: bytes, msg: P.Control, now: float) -> None:
    if msg.targets is None:  # a cluster-wide pause (the intended state's) is held
        assert isinstance(msg.op, P.Pause)
        leases.acquired(client, pause(msg.op.lora), now)


def _drop_pause(leases: Leases, intended: IntendedState, client: bytes, msg: P.Control, now: float) -> None:
    assert isinstance(msg.op, P.Resume)
    if msg.op.lora is None:
        leases.released_kind("pause")  # a resume of every scope, by anyone
    else:
        leases.released(pause(msg.op.lora))


def _hold_sleep(leases: Leases, intended: IntendedState, client: bytes, msg: P.Control, now: float) -> None:
    if msg.targets is None:
        leases.acquired(client, SLEEP, now)


def _drop_sleep(leases: Leases, intended: IntendedState, client: bytes, msg: P.Control, now: float) -> None:
    # Tags wake one by one (SkyRL: weights, then kv_cache): the sleep is let go
    # of once the cluster intends nothing asleep, whatever the split.
    if not intended.cluster.asleep:
        leases.released(SLEEP)


def _hold_txn(leases: Leases, intended: IntendedState, client: bytes, msg: P.Control, now: float) -> None:
    assert isinstance(msg.op, P.BeginWeightUpdate)
    if msg.op.commit:  # one-trip: decided and committed in its one op, nothing left to hold
        return
    leases.acquired(client, txn(msg.op.update_id), now)


def _drop_txn(leases: Leases, intended: IntendedState, client: bytes, msg: P.Control, now: float) -> None:
    assert isinstance(msg.op, (P.FinishWeightUpdate, P.AbortWeightUpdate))
    leases.released(txn(msg.op.update_id))


# What a client's control op takes or lets go of (router_node/leases.py).
LEASE_HOOKS: dict[type, Hook] = {
    P.Pause: _hold_pause,
    P.Resume: _drop_pause,
    P.Sleep: _hold_sleep,
    P.WakeUp: _drop_sleep,
    P.BeginWeightUpdate: _hold_txn,
    P.FinishWeightUpdate: _drop_txn,
    P.AbortWeightUpdate: _drop_txn,
}
