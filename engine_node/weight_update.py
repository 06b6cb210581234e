"""The weight-update transaction of an engine node: ONE record per update,
keyed by the trainer's update id.

    BEGUN ──bucket──► RECEIVING ──last bucket / receive done──► PREPARED
      │                   │                                       │ commit
      └──────────────► ABORTED ◄──────────── COMMITTING ◄──────────┘
                                                 │ op done
                                                 ▼
                                             COMMITTED

PREPARED means every bucket is in and was validated by the backend; a commit
from any other phase is refused (and aborts the update). This is the shape a
cluster-wide two-phase commit plugs into: the head can ask every engine to
reach PREPARED (ack), then publish the commit.

Targets: "model" (the backend stages buckets; commit applies them all at once)
or "lora:NAME" (zmq only: the node keeps clones of the adapter's tensors and
the commit loads them as adapter NAME).

Ownership: the node's loop thread; backend control calls return BackendOps
that the shell waits on (this module never blocks).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from bus import protocol as P
from bus.errors import BadRequest
from bus.tensors import unpack_bucket
from engine_node.backend import BackendError, BackendOp
from engine_node.core import Pending, RequestCore


class Phase(enum.Enum):
    BEGUN = "begun"
    RECEIVING = "receiving"
    PREPARED = "prepared"
    COMMITTING = "committing"
    COMMITTED = "committed"
    ABORTED = "aborted"


_P = Phase
_NEXT: dict[Phase, frozenset[Phase]] = {
    _P.BEGUN: frozenset({_P.RECEIVING, _P.PREPARED, _P.ABORTED}),
    _P.RECEIVING: frozenset({_P.RECEIVING, _P.PREPARED, _P.ABORTED}),
    _P.PREPARED: frozenset({_P.COMMITTING, _P.ABORTED}),
    _P.COMMITTING: frozenset({_P.COMMITTED, _P.ABORTED}),
    _P.COMMITTED: frozenset(),
    _P.ABORTED: frozenset(),
}


@dataclasses.dataclass(eq=False)
class WeightUpdate:
    begin: P.BeginWeightUpdate
    phase: Phase = Phase.BEGUN
    received: set[int] = dataclasses.field(default_factory=set)
    bytes: int = 0
    lora_tensors: list[tuple[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def update_id(self) -> str:
        return self.begin.update_id

    @property
    def is_model(self) -> bool:
        return self.begin.target == "model"

    @property
    def missing(self) -> list[int]:
        return sorted(set(range(len(self.begin.bucket_sizes))) - self.received)

    def to(self, phase: Phase) -> None:
        if phase not in _NEXT[self.phase]:
            raise BackendError(f"weight update {self.update_id}: {self.phase.value} -> {phase.value} is not allowed")
        self.phase = phase


class WeightUpdates:
    """At most one open update per engine; a new begin supersedes an open one
    (a trainer that died mid-transfer must not block the next update)."""

    def __init__(self, backend: Any, core: RequestCore, engine_id: str, weight_address: str) -> None:
        self.backend = backend
        self.core = core
        self.engine_id = engine_id
        self.weight_address = weight_address
        self.current: WeightUpdate | None = None
        self.log_aborted: Any = lambda update_id, why: None  # shell hook

    # ------------------------------------------------------------ ops

    def begin(self, op: P.BeginWeightUpdate, seq: int = 0) -> Any:
        if self.current is not None:
            self._abort("superseded by update " + op.update_id)
        result = P.BeginWeightsResult(buckets=len(op.bucket_sizes), weight_address=self.weight_address)
        if op.target == "model":
            args = dict(op.transport_args)
            args.setdefault("bucket_sizes", list(op.bucket_sizes))
            up = self.current = WeightUpdate(op)
            bop = self.backend.begin_weight_update(op.update_id, op.transport, list(op.tensors), args)

            def begun(res: dict[str, Any]) -> P.BeginWeightsResult:
                result.detail = dict(res)
                return result

            return Pending(bop, begun, lambda e: self._drop(up, f"begin failed: {e}"))
        if not op.target.startswith("lora:"):
            raise BadRequest(f"unknown weight target {op.target!r} (model, lora:NAME)", field="target")
        if op.transport != "zmq":
            raise BadRequest("LoRA tensors travel over the zmq transport", field="transport")
        self.current = WeightUpdate(op)
        if not op.bucket_sizes:
            self.current.to(Phase.PREPARED)
        return result

    def on_bucket(self, update_id: str, bucket: int, buf: memoryview) -> None:
        """One zmq bucket (a view of the frame, valid during the call). Raises
        BackendError/ValueError; the caller aborts the update then."""
        up = self._require(update_id)
        sizes = up.begin.bucket_sizes
        if up.phase not in (Phase.BEGUN, Phase.RECEIVING):
            raise BackendError(f"bucket {bucket} of update {update_id} arrived in phase {up.phase.value}")
        if not 0 <= bucket < len(sizes):
            raise BackendError(f"bucket {bucket} is not part of update {update_id}")
        if len(buf) != sizes[bucket]:
            raise BackendError(f"bucket {bucket} has {len(buf)} bytes, expected {sizes[bucket]}")
        if up.is_model:
            self.backend.stage_bucket(bucket, buf)
        else:
            named = unpack_bucket(bucket, list(up.begin.tensors), buf)
            up.lora_tensors.extend((n, t.clone()) for n, t in named)  # the frame dies after this call
        up.received.add(bucket)
        up.bytes += len(buf)
        up.to(Phase.RECEIVING if up.missing else Phase.PREPARED)

    def receive(self, op: P.ReceiveWeights, seq: int = 0) -> Any:
        up = self._require(op.update_id)
        t0 = self.core.now

        def then(res: dict[str, Any]) -> P.ReceiveWeightsResult:
            up.received.update(range(len(up.begin.bucket_sizes)))
            up.to(Phase.PREPARED)
            return P.ReceiveWeightsResult(seconds=round(self.core.now - t0, 4), detail=dict(res))

        return Pending(self.backend.receive_weights(list(op.handles)), then, lambda e: self._abort("receive failed"))

    def commit(self, op: P.FinishWeightUpdate, seq: int = 0) -> Any:
        up = self._require(op.update_id)
        if up.phase is not Phase.PREPARED:
            missing = up.missing
            self._abort("incomplete")
            raise BackendError(
                f"update {op.update_id} finished with bucket(s) {missing} never received", field="update_id"
            )
        up.to(Phase.COMMITTING)
        t0 = self.core.now
        if up.is_model:
            bop = self.backend.commit_weight_update()
        else:
            name = up.begin.target.split(":", 1)[1]
            cfg = dict(up.begin.transport_args.get("lora_config", {}))
            bop = self.backend.load_lora(name, tensors=up.lora_tensors, config=cfg)

        def then(_res: dict[str, Any]) -> P.WeightsCommitted:
            up.to(Phase.COMMITTED)
            if self.current is up:
                self.current = None
            restarted = 0
            if up.is_model:
                restarted = self.core.weights_changed(op.version)
            else:
                self.core.config_changed()
            config = self.core.config_result()
            return P.WeightsCommitted(
                weight_version=config.weight_version,
                loras=config.loras,
                epoch=config.epoch,
                bytes=up.bytes,
                seconds=round(self.core.now - t0, 4),
                restarted=restarted,
            )

        return Pending(bop, then, lambda e: self._abort("finish failed", up))

    def abort(self, op: P.AbortWeightUpdate, seq: int = 0) -> Any:
        bop = None
        if self.current is not None and self.current.update_id == op.update_id:
            bop = self._abort("aborted by the trainer")
        if bop is None:
            return P.WeightsAborted(weight_version=self.core.weight_version)
        return Pending(bop, lambda _r: P.WeightsAborted(weight_version=self.core.weight_version))

    def abort_current(self, update_id: str, why: str) -> None:
        """A bucket was refused: the update it belongs to is over."""
        if self.current is not None and self.current.update_id == update_id:
            self._abort(why)

    # ------------------------------------------------------------ internals

    def _require(self, update_id: str) -> WeightUpdate:
        up = self.current
        if up is None or up.update_id != update_id:
            raise BackendError(f"no weight update {update_id!r} in progress on {self.engine_id}", field="update_id")
        return up

    def _drop(self, up: WeightUpdate, why: str) -> None:
        """The backend refused the begin: nothing is staged there."""
        if self.current is up:
            self.current = None
            up.phase = Phase.ABORTED
            self.log_aborted(up.update_id, why)

    def _abort(self, why: str, up: WeightUpdate | None = None) -> BackendOp | None:
        """Abort the open update (or `up`, if it is still the open one)."""
        cur = self.current
        if cur is None or (up is not None and cur is not up):
            return None
        self.current = None
        if cur.phase not in (Phase.COMMITTED, Phase.ABORTED):
            cur.phase = Phase.ABORTED
        self.log_aborted(cur.update_id, why)
        if cur.is_model:
            return self.backend.abort_weight_update()
        return None
