"""What a client's control op takes or lets go of (router_node/leases.py):
one hook per op type, called by the router after the op was accepted. No I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from bus import protocol as P
from router_node.intended_state import IntendedState
from router_node.leases import SLEEP, Expired, Leases, pause, txn

Hook = Callable[[Leases, IntendedState, bytes, P.Control, float], None]


def _hold_pause(leases: Leases, intended: IntendedState, client: bytes, msg: P.Control, now: float) -> None:
    if msg.targets is None:  # a cluster-wide pause (the intended state's) is held
        assert isinstance(msg.op, P.Pause)
        leases.acquired(client, pause(msg.op.lora), now)


def _drop_pause(leases: Leases, intended: IntendedState, client: bytes, msg: P.Control, now: float) -> None:
    assert isinstance(msg.op, P.Resume)
    if not msg.op.force:  # a holder lets go of its own hold only (issue 34)
        leases.released_by(client, "pause", msg.op.lora)
    elif msg.op.lora is None:
        leases.released_kind("pause")  # a forced resume of every scope: every holder's
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


def lease_release(x: Expired) -> P.Resume | P.WakeUp | None:
    """The op that releases what a vanished client held (None: a weight
    update, which the head aborts instead). A pause: its own scope only —
    Resume(lora="*") lifts "*" and leaves another live client's adapter pause
    alone, where a plain Resume() lifted every scope (issue 34 row 15)."""
    kind, name = x.resource
    if kind == "pause":
        return P.Resume(lora=name)
    if kind == "sleep":
        return P.WakeUp()
    return None


def resume_held(leases: Leases, intended: IntendedState, client: bytes, msg: P.Control) -> list[P.Resume] | None:
    """A cluster-wide resume while another live client holds a scope it would
    lift (issue 34: pauses are held per holder). None: nobody else holds one,
    or it is forced or targeted — publish it as sent. Else `client`'s own hold
    is released here, the kept scopes stay paused, and the returned resumes
    (one per scope the cluster intends paused that nobody holds any more) are
    what to publish instead."""
    op = msg.op
    if not isinstance(op, P.Resume) or op.force or msg.targets is not None:
        return None
    kept = leases.held_by_others(client, "pause", op.lora)
    if not kept:
        return None
    leases.released_by(client, "pause", op.lora)
    scopes = [op.lora] if op.lora is not None else sorted(intended.cluster.paused)
    return [P.Resume(lora=s) for s in scopes if s not in kept and s in intended.cluster.paused]


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
