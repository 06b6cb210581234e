"""The one-trip weight update, engine side: the layout an engine keeps (a
zero-copy cuda_ipc one, or an nccl plan), and the op that receives,
validates, prepares and commits in one go.

nccl: the trainer's plan (metas, sizes) repeats while its parameters keep
their names, shapes and dtypes; the engine keeps the begin that brought it
(its workers keep the staging buffers of those sizes), and a one-trip op
carries only the layout id and its own transport args (a fresh check-in
token, the group). The receive waits for the broadcast, so the commit is
chained behind it in the same op (`_chained`): a receive that fails aborts
the update and nothing is written (old weights, old version).

The trainer's zero-copy cuda_ipc updates (trainer_bridge/transports/cuda_ipc.py)
name its own parameters, so their metas, sizes and handles repeat every
update. An update that carries them with a layout id (`BeginWeightUpdate.layout`)
and commits leaves the engine holding that layout (`KeptLayout`); the next
update may then be `BeginWeightUpdate(commit=True, layout=L, version=V)`
with no handles: the engine rebuilds the full begin from what it keeps and
runs begin + receive + prepare + commit back to back in its one control op.
The head decided V before it published (router_node/one_trip.py says what
that guarantees across engines).

Hazards this module owns:
- a layout is only as good as the workers' kept IPC maps and the trainer's
  storages: it is dropped by a sleep (the gate's sleep count moves), by a
  commit of any update that does not carry it, and by a failed one-trip op;
  the trainer changes the layout id whenever its storages or plan change;
- a layout it does not hold is refused BEFORE anything is opened (field
  "layout"): the trainer then sends the update with its handles;
- cuda_ipc: the receive must finish inside the op (the vLLM backend's cuda_ipc
  begin and receive do: they only keep the handles); a backend whose receive
  runs on is refused, nothing written. nccl: the commit starts only once the
  receive's op completed, on the loop thread (engine_node/control.py runs a
  Pending whose `then` returns the next Pending).

Ownership: the node's loop thread (through engine_node/weight_update.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from bus import protocol as P
from bus.errors import BackendRefused, BadRequest
from bus.transport import CudaIpcArgs, NcclArgs, Transport
from engine_node.actions import OpOutcome, Pending
from engine_node.backend import BackendError


@dataclasses.dataclass(frozen=True)
class Held:
    begin: P.BeginWeightUpdate  # the update that brought the layout (metas, sizes, handles, args)
    sleeps: int  # the gate's sleep count when it was kept


class KeptLayout:
    """The one zero-copy layout this engine holds (a trainer has one)."""

    def __init__(self) -> None:
        self.held: Held | None = None

    @property
    def layout(self) -> str:
        return self.held.begin.layout if self.held is not None else ""

    def committed(self, begin: P.BeginWeightUpdate, sleeps: int) -> str:
        """An update committed: keep its layout if it carries one (a one-sender
        zero-copy cuda_ipc update with its handles), else hold none. Returns
        the layout held now ("" none)."""
        self.held = Held(begin, sleeps) if _keeps(begin) else None
        return self.layout

    def drop(self) -> None:
        self.held = None

    def take(self, op: P.BeginWeightUpdate, sleeps: int, engine_id: str) -> P.BeginWeightUpdate:
        """The full begin of one-trip update `op` (its id, check_finite and
        transport args, e.g. weight_check; the kept metas, sizes and handles), or
        BackendRefused naming "layout" when this engine does not hold it."""
        h = self.held
        why = ""
        if h is None:
            why = "holds no layout"
        elif h.begin.layout != op.layout:
            why = f"holds layout {h.begin.layout!r}"
        elif h.sleeps != sleeps:
            why = "slept since it kept it (its IPC maps are gone)"
        if why:
            self.held = None if h is not None and h.sleeps != sleeps else self.held
            raise BackendRefused(
                f"weight update {op.update_id!r}: {engine_id} {why}, not layout {op.layout!r}; "
                "send the update with its handles",
                field="layout",
            )
        assert h is not None
        if op.transport != h.begin.transport:
            raise BackendRefused(
                f"weight update {op.update_id!r}: {engine_id} holds layout {op.layout!r} over "
                f"{h.begin.transport!s}, not {op.transport!s}; send the update with its plan",
                field="layout",
            )
        same = type(op.transport_args) is type(h.begin.transport_args)
        args = op.transport_args if same else h.begin.transport_args
        return msgspec.structs.replace(
            h.begin,
            update_id=op.update_id,
            check_finite=op.check_finite,
            transport_args=args,
            prepare=True,
            commit=False,
            version=None,
        )


def _keeps(begin: P.BeginWeightUpdate) -> bool:
    """Whether a committed update leaves its layout kept: a one-sender model
    update naming a layout, zero-copy cuda_ipc (handles, kept maps) or nccl
    (the plan; the workers keep their staging)."""
    if not begin.layout or begin.streamed or begin.senders != 1 or begin.target != "model":
        return False
    args = begin.transport_args
    if begin.transport == Transport.CUDA_IPC:
        return bool(begin.handles) and isinstance(args, CudaIpcArgs) and args.keep_maps
    return begin.transport == Transport.NCCL and isinstance(args, NcclArgs) and bool(begin.tensors)


def not_above(version: int | None, current: int) -> bool:
    """A commit's version that does not move the engine up (None: +1, always up)."""
    return version is not None and version <= current


def check_version(update_id: str, version: int | None, engine_id: str, current: int) -> None:
    """Versions only move up, on the engine too (issue 34): a commit (or a
    one-trip op) naming a version not above the one the engine serves is
    refused, whoever sent it (the head refuses one below the cluster's; this
    holds should a replayed or stale commit ever reach the engine)."""
    if not_above(version, current):
        raise BadRequest(
            f"update {update_id} names weight version {version}, not above {engine_id}'s {current}: "
            "versions only move up",
            field="version",
        )


def one_trip(txn: Any, op: P.BeginWeightUpdate, seq: int) -> OpOutcome:
    """begin + receive + prepare + commit of a one-trip update, in one op
    (`txn`: engine_node.weight_update.WeightUpdates). cuda_ipc: the begin's
    receive finishes at once (the handles are only kept). nccl: the receive
    waits for the broadcast; the commit is chained behind it (a Pending whose
    `then` returns the commit's Pending: engine_node/control.py runs it on
    the loop thread), so a receive that fails commits nothing."""
    check_version(op.update_id, op.version, txn.engine_id, txn.core.weight_version)  # before anything is written
    full = txn.layouts.take(op, txn.core.gate.sleeps, txn.engine_id)
    t0 = txn.core.now
    try:
        first = txn.begin(full, seq)
        if op.transport == Transport.NCCL and isinstance(first, Pending):
            return _chained(txn, op, seq, first, t0)
        _run_now(first, op.update_id)  # the vote, taken at once
    except BaseException:
        txn.layouts.drop()  # whatever failed, the next update brings its handles
        raise
    return _commit(txn, op, seq, txn.core.now - t0, {})


def _commit(txn: Any, op: P.BeginWeightUpdate, seq: int, prepare_s: float, received: dict[str, Any]) -> Pending:
    pending = txn.commit(P.FinishWeightUpdate(op.update_id, version=op.version), seq)

    def then(res: dict[str, Any]) -> P.WeightsCommitted:
        out = pending.then(res)
        out.detail = {**out.detail, "path": "one_trip", "prepare_s": round(prepare_s, 6), **received}
        return out

    def failed(e: BaseException) -> None:
        txn.layouts.drop()
        if pending.on_error is not None:
            pending.on_error(e)

    return Pending(pending.op, then, failed)


def _chained(txn: Any, op: P.BeginWeightUpdate, seq: int, first: Pending, t0: float) -> Pending:
    """The receive (begin + receive + prepare), then the commit behind it."""

    def then(res: dict[str, Any]) -> Pending:
        try:
            prepared = first.then(res)  # the vote: PREPARED (validated, every bucket in)
        except BaseException:
            txn.layouts.drop()
            raise
        detail = getattr(prepared, "detail", None) or {}
        receive = (detail.get("receive") or {}) if isinstance(detail, dict) else {}
        txn.timings.receive(op.update_id, op.transport, txn.core.now - t0, receive)
        return _commit(txn, op, seq, txn.core.now - t0, {"receive_s": round(txn.core.now - t0, 6)})

    def failed(e: BaseException) -> None:
        txn.layouts.drop()
        if first.on_error is not None:
            first.on_error(e)  # the update is aborted: old weights, old version

    return Pending(first.op, then, failed)


def _run_now(res: OpOutcome, update_id: str) -> None:
    if not isinstance(res, Pending):
        return
    if not res.op.future.done():
        if res.on_error is not None:
            res.on_error(BackendError("not finished at once"))
        raise BackendError(
            f"weight update {update_id}: the backend's receive did not finish inside the one-trip op; "
            "send the update with its handles",
            field="layout",
        )
    try:
        res.then(res.op.future.result())
    except BaseException as e:
        if res.on_error is not None:
            res.on_error(e)
        raise
