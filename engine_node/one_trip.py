"""The one-trip weight update, engine side: the zero-copy layout an engine
keeps, and the op that receives, validates, prepares and commits in one go.

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
- the receive must finish inside the op (the vLLM backend's cuda_ipc begin and
  receive do: they only keep the handles); a backend whose receive runs on
  is refused, nothing written.

Ownership: the node's loop thread (through engine_node/weight_update.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from bus import protocol as P
from bus.errors import BackendRefused
from bus.transport import CudaIpcArgs, Transport
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
        args = begin.transport_args
        keeps = (
            bool(begin.layout)
            and begin.transport == Transport.CUDA_IPC
            and bool(begin.handles)
            and isinstance(args, CudaIpcArgs)
            and args.keep_maps
        )
        self.held = Held(begin, sleeps) if keeps else None
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
        args = op.transport_args if isinstance(op.transport_args, CudaIpcArgs) else h.begin.transport_args
        return msgspec.structs.replace(
            h.begin,
            update_id=op.update_id,
            check_finite=op.check_finite,
            transport_args=args,
            prepare=True,
            commit=False,
            version=None,
        )


def one_trip(txn: Any, op: P.BeginWeightUpdate, seq: int) -> OpOutcome:
    """begin + receive + prepare + commit of a one-trip update, in one op
    (`txn`: engine_node.weight_update.WeightUpdates)."""
    full = txn.layouts.take(op, txn.core.gate.sleeps, txn.engine_id)
    t0 = txn.core.now
    try:
        _run_now(txn.begin(full, seq), op.update_id)  # the vote, taken at once
    except BaseException:
        txn.layouts.drop()  # whatever failed, the next update brings its handles
        raise
    prepare_s = txn.core.now - t0
    pending = txn.commit(P.FinishWeightUpdate(op.update_id, version=op.version), seq)

    def then(res: dict[str, Any]) -> P.WeightsCommitted:
        out = pending.then(res)
        out.detail = {**out.detail, "path": "one_trip", "prepare_s": round(prepare_s, 6)}
        return out

    def failed(e: BaseException) -> None:
        txn.layouts.drop()
        if pending.on_error is not None:
            pending.on_error(e)

    return Pending(pending.op, then, failed)


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
