"""The head's side of the one-trip weight update: which engines hold which
zero-copy layout, and whether a one-op update may go out. I/O-free (acks and
fan-outs in, a target list or a typed refusal out); router_node/control.py
publishes.

The one-trip update (`BeginWeightUpdate(commit=True, layout=L)`, no handles)
is the steady state of the trainer's zero-copy cuda_ipc updates and of its
nccl updates (the engines receive the broadcast inside the op): every target
engine committed an earlier update that carried layout L with its handles
and keeps it (engine_node/one_trip.py `KeptLayout`). The head lets one out only
when its own record says every target holds L; then it decides the version
BEFORE it publishes (as for a two-phase commit) and the engines receive,
validate, prepare and commit in that one op.

What a one-op commit guarantees, and what it does not:
- the version is the head's, decided once, monotonic (cluster_state.py);
- an update the head refuses here (a target lacks the layout: never had it,
  slept since, re-joined, committed another layout) changes nothing anywhere,
  and the trainer falls back to the two-round-trip path by itself;
- every engine validates before it writes (a layout it no longer holds, a
  bad handle, asleep weights): one that refuses keeps its old weights and
  version. If EVERY target refuses, nothing committed: it ends as an abort.
- NOT all-or-nothing across engines once one committed: there is no vote
  round, so an engine that refuses or fails mid-write while another
  committed is left below the cluster version, STALE (no traffic), exactly
  as an engine that misses the commit of a two-phase update; the next
  update (or sync_stale) brings it back. With one engine (the colocated
  case this path is for) the update is all-or-nothing.

Layouts are forgotten when an engine is put to sleep (sleep drops the
workers' kept IPC maps), when it (re)joins, and when it commits an update
without a layout. Ownership: the router loop thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from bus import protocol as P
from bus.errors import BackendRefused, BadRequest
from bus.transport import Transport
from router_node.registry import EngineState

# Engines a one-trip update with no explicit targets goes to (the two-phase
# path's trainer picks healthy and stale ones after a health read; CONVERGING
# is what a pause sent just before the update leaves them in).
_TAKES_PART = frozenset({EngineState.HEALTHY, EngineState.STALE, EngineState.CONVERGING})

# The transports whose engines keep a layout (cuda_ipc: the trainer's zero-copy
# handles; nccl: the plan's metas and the workers' staging).
ONE_TRIP_TRANSPORTS = frozenset({Transport.CUDA_IPC, Transport.NCCL})

# Ops after whose fan-out a target's kept layout is gone.
_FORGETS: tuple[type, ...] = (P.Sleep,)


class Layouts:
    """engine id -> the zero-copy layout it holds (from its WeightsCommitted)."""

    def __init__(self) -> None:
        self.held: dict[str, str] = {}

    def committed(self, engine_id: str, layout: str) -> None:
        if layout:
            self.held[engine_id] = layout
        else:
            self.held.pop(engine_id, None)

    def forget(self, engine_ids: Iterable[str]) -> None:
        for eid in engine_ids:
            self.held.pop(eid, None)

    def on_fan_out(self, op: P.Op, targets: Iterable[str]) -> None:
        if isinstance(op, _FORGETS):
            self.forget(targets)


def is_one_trip(op: P.Op) -> bool:
    return isinstance(op, P.BeginWeightUpdate) and op.commit


def check_shape(op: P.BeginWeightUpdate) -> None:
    """A one-trip begin names a layout and carries nothing else of a part."""
    why = ""
    if not op.layout:
        why = "names no layout"
    elif op.transport not in ONE_TRIP_TRANSPORTS:
        why = f"is over {op.transport!s}, not cuda_ipc or nccl"
    elif op.handles or op.tensors or op.bucket_sizes:
        why = "carries handles or tensors (the layout brings them)"
    elif op.senders != 1 or op.streamed or op.target != "model":
        why = "is not a one-sender model update"
    if why:
        raise BadRequest(f"weight update {op.update_id!r}: a one-trip begin (commit=True) {why}", field="commit")


def one_trip_targets(
    op: P.BeginWeightUpdate,
    requested: list[str] | None,
    states: Mapping[str, EngineState],
    held: Mapping[str, str],
) -> list[str]:
    """The engines a one-trip update goes to, or BackendRefused (field
    "layout") when one of them does not hold its layout: nothing is changed
    anywhere, and the trainer sends the update with its handles instead."""
    check_shape(op)
    if requested is None:
        targets = [eid for eid, st in states.items() if st in _TAKES_PART]
    else:
        targets = list(requested)
    lacking = sorted(t for t in targets if held.get(t) != op.layout or states.get(t) not in _TAKES_PART)
    if not targets or lacking:
        who = f"engine(s) {lacking} do not hold" if lacking else "no engine holds"
        raise BackendRefused(
            f"weight update {op.update_id!r}: {who} layout {op.layout!r} (never sent with its handles, "
            "slept, re-joined or replaced since); send the update with its handles",
            field="layout",
        )
    return targets
