"""The weight-update transaction of an engine node: ONE record per update,
keyed by the trainer's update id. Phase one of the cluster's two-phase commit
happens here; the decision is the head's (router_node/cluster_state.py).

    BEGUN ──bucket / sender end──► RECEIVING ──PrepareWeights (all in, valid)──► PREPARED
      │                                │                                          │ commit
      └────────────────────────────► ABORTED ◄──────────── COMMITTING ◄───────────┘
                                                               │ op done
                                                               ▼
                                                           COMMITTED

PREPARED is reached only by a prepare (`PrepareWeights`, or `ReceiveWeights` /
`BeginWeightUpdate(prepare=True)` for the GPU transports): every bucket every
sender declared is in and the backend validated it. The ack is the engine's
vote. A commit from any other phase is refused (and aborts the update).

Hazards this module owns:
- A prepared engine may never hear the decision (the head died, the abort was
  lost while this process was frozen). A prepared update left without a commit
  or abort for `prepare_ttl_s` is discarded: the engine keeps its old weights
  and version, and the head sees it stale if the cluster committed without it.
  Updates that stop receiving (BEGUN/RECEIVING) are dropped after the same
  idle time, so a vanished trainer never pins staging memory.
- Streamed updates (`BeginWeightUpdate.streamed`): the tensor list is only
  known once every sender ended, and the Backend protocol takes it at
  begin_weight_update. So the node HOLDS each bucket's zmq frame (zero-copy)
  until the prepare, then begins the backend transaction with the complete
  list and stages the held frames, dropping each one as it is staged: peak
  engine memory stays about one update, as with eager staging.
- Several senders: bucket identity is (sender, index); the global bucket index
  given to the backend is assigned at prepare in (sender, index) order.

Targets: "model" (the backend stages buckets; commit applies them all at once)
or "lora:NAME" (zmq only: the node keeps clones of the adapter's tensors and
the commit loads them as adapter NAME).

Ownership: the node's loop thread; backend control calls return BackendOps
that the shell waits on (this module never blocks). Prepares that wait for
senders are DEFERRED: their acks are SendAck actions (engine_node/actions.py)
the shell takes with `take_actions()`, the same shape as the request core's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from bus import protocol as P
from bus.errors import BackendRefused, BadRequest
from bus.tensors import first_nonfinite, unpack_bucket
from bus.transport import backend_args
from engine_node.actions import DEFERRED, OpOutcome, Pending, SendAck
from engine_node.backend import BackendError, BackendOp
from engine_node.core import RequestCore
from engine_node.one_trip import KeptLayout, check_version, not_above, one_trip
from engine_node.timings import TimingLog
from engine_node.transports.registry import receiver_for


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
_OPEN = (Phase.BEGUN, Phase.RECEIVING)

DEFAULT_PREPARE_TTL_S = 60.0


@dataclasses.dataclass(eq=False)
class WeightUpdate:
    begin: P.BeginWeightUpdate
    phase: Phase = Phase.BEGUN
    received: set[int] = dataclasses.field(default_factory=set)  # planned updates: global bucket indexes
    # streamed updates: (sender, index) -> (its metas, the frame holding its bytes)
    held: dict[tuple[int, int], tuple[list[P.TensorMeta], Any]] = dataclasses.field(default_factory=dict)
    ended: dict[int, int] = dataclasses.field(default_factory=dict)  # sender -> buckets it declared
    bytes: int = 0
    tensors: int = 0
    lora_tensors: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    touched_at: float = 0.0  # last bucket / op (idle TTL of an open update)
    prepared_at: float = 0.0
    waiting: tuple[int, float, float] | None = None  # a deferred prepare: (seq, deadline, wait_s)
    backend_open: bool = True  # the backend holds a transaction for it (streamed: from prepare on)
    nonfinite: str | None = None  # the first tensor seen with a NaN / inf value (refused at prepare)

    @property
    def update_id(self) -> str:
        return self.begin.update_id

    @property
    def is_model(self) -> bool:
        return self.begin.target == "model"

    @property
    def streamed(self) -> bool:
        return self.begin.streamed

    @property
    def gpu_parts(self) -> bool:
        """Streamed over an out-of-band (GPU) transport: each sender's ReceiveWeights is its part."""
        return self.begin.streamed and receiver_for(self.begin.transport).out_of_band

    @property
    def missing(self) -> list[int]:
        return sorted(set(range(len(self.begin.bucket_sizes))) - self.received)

    def incomplete(self) -> str | None:
        """Why a prepare cannot pass yet (None: everything declared is in)."""
        if not self.streamed:
            missing = self.missing
            return f"bucket(s) {missing[:8]} never received" if missing else None
        silent = [s for s in range(self.begin.senders) if self.ended.get(s, -1) < 0]  # -1: a GPU part in flight
        if silent:
            return f"sender(s) {silent} never finished sending"
        if self.gpu_parts:
            return None  # each part was received whole by its ReceiveWeights
        lost = [(s, b) for s, n in sorted(self.ended.items()) for b in range(n) if (s, b) not in self.held]
        if lost:
            return "bucket(s) (sender, index) " + str(lost[:8]) + " never received"
        return None

    def to(self, phase: Phase) -> None:
        if phase not in _NEXT[self.phase]:
            raise BackendError(f"weight update {self.update_id}: {self.phase.value} -> {phase.value} is not allowed")
        self.phase = phase


class WeightUpdates:
    """At most one open update per engine; a new begin supersedes an open one
    (a trainer that died mid-transfer must not block the next update)."""

    def __init__(
        self,
        backend: Any,
        core: RequestCore,
        engine_id: str,
        weight_address: str,
        *,
        prepare_ttl_s: float = DEFAULT_PREPARE_TTL_S,
        timings: TimingLog | None = None,
    ) -> None:
        self.backend = backend
        self.core = core
        self.engine_id = engine_id
        self.weight_address = weight_address
        self.prepare_ttl_s = prepare_ttl_s
        self.timings = timings if timings is not None else TimingLog()  # receive / commit records (Stats)
        self.current: WeightUpdate | None = None
        self.layouts = KeptLayout()  # the zero-copy layout a one-trip update may name (one_trip.py)
        # Deferred prepare acks, for the shell (take_actions).
        self.actions: list[SendAck] = []
        self.log_aborted: Callable[[str, str], object] = lambda update_id, why: None  # shell hook

    def take_actions(self) -> list[SendAck]:
        out, self.actions = self.actions, []
        return out

    # ------------------------------------------------------------ ops

    def begin(self, op: P.BeginWeightUpdate, seq: int = 0) -> OpOutcome:
        if op.target == "model" and self.core.weights_asleep():
            # Offloaded or discarded weights (vLLM has unmapped that memory);
            # refused before anything changes, an open update included.
            raise BackendRefused(
                f"the weights of {self.engine_id} are asleep (sleep level {self.core.gate.sleep_level}): "
                "wake_up(tags=['weights']) before a weight update",
                field="target",
            )
        if op.commit:
            return one_trip(self, op, seq)  # begin + receive + prepare + commit, one op
        if self.current is not None:
            self._abort("superseded by update " + op.update_id)
        if op.senders < 1:
            raise BadRequest(f"senders must be >= 1, got {op.senders}", field="senders")
        # The transport's receiver decides how the backend's transaction opens.
        recv = receiver_for(op.transport, op.transport_args)
        result = P.BeginWeightsResult(buckets=len(op.bucket_sizes), weight_address=self.weight_address)
        if op.target == "model":
            up = self.current = WeightUpdate(op, touched_at=self.core.now)
            return recv.begin_model(self, up, result)
        if not op.target.startswith("lora:"):
            raise BadRequest(f"unknown weight target {op.target!r} (model, lora:NAME)", field="target")
        if not recv.takes_lora:
            raise BadRequest("LoRA tensors travel over the zmq transport", field="transport")
        self.current = WeightUpdate(op, touched_at=self.core.now)
        return result

    # ------------------------------------------------------------ what receivers call
    # (engine_node/transports/base.py Txn)

    def begun(self, up: WeightUpdate, bop: BackendOp, result: P.BeginWeightsResult) -> Pending:
        def then(res: dict[str, Any]) -> P.BeginWeightsResult:
            result.detail = dict(res)
            return result

        return Pending(bop, then, lambda e: self._drop(up, f"begin failed: {e}"))

    def drop(self, up: WeightUpdate, why: str) -> None:
        self._drop(up, why)

    def begin_receive_prepare(self, up: WeightUpdate, begin: BackendOp, handles: list[Any]) -> Pending:
        """GPU transports in one op: the receive is issued right behind the
        begin (backends run their control calls in order), the ack is the vote."""
        if begin.future.done() and begin.future.exception() is not None:
            self._drop(up, f"begin failed: {begin.future.exception()}")
            return Pending(begin, lambda r: r)
        recv = self.backend.receive_weights(handles)
        both: concurrent.futures.Future = concurrent.futures.Future()
        parts: dict[str, dict[str, Any]] = {}

        def one(name: str, f: concurrent.futures.Future) -> None:
            if both.done():
                return
            e = f.exception()
            if e is not None:
                both.set_exception(e)
                return
            parts[name] = f.result()
            if len(parts) == 2:
                both.set_result({"begin": parts["begin"], "receive": parts["receive"]})

        begin.future.add_done_callback(lambda f: one("begin", f))
        recv.future.add_done_callback(lambda f: one("receive", f))
        op = BackendOp("begin+receive_weights", both, max(begin.deadline, recv.deadline), recv.knob or begin.knob)
        t0 = self.core.now

        def then(res: dict[str, Any]) -> P.WeightsPrepared:
            up.received.update(range(len(up.begin.bucket_sizes)))
            self._prepared(up)
            return P.WeightsPrepared(
                buckets=len(up.begin.bucket_sizes),
                tensors=len(up.begin.tensors),
                bytes=int(sum(up.begin.bucket_sizes)),
                seconds=round(self.core.now - t0, 4),
                detail=res,
            )

        return Pending(op, then, lambda e: self._abort(f"begin/receive failed: {e}", up))

    def on_bucket(
        self, update_id: str, bucket: int, buf: memoryview, *, sender: int = 0, metas: Any = (), frame: Any = None
    ) -> None:
        """One zmq bucket (a view of the frame, valid during the call unless
        `frame`, the zmq.Frame owning it, is kept). Raises BackendError/
        ValueError; the caller aborts the update then."""
        up = self._require(update_id)
        if up.phase not in _OPEN:
            raise BackendError(f"bucket {bucket} of update {update_id} arrived in phase {up.phase.value}")
        up.touched_at = self.core.now
        if up.streamed:
            self._hold(up, bucket, buf, sender, list(metas), frame)
        else:
            self._stage(up, bucket, buf)
        up.bytes += len(buf)
        up.to(Phase.RECEIVING)
        self._maybe_prepare(up)

    def _stage(self, up: WeightUpdate, bucket: int, buf: memoryview) -> None:
        sizes = up.begin.bucket_sizes
        if not 0 <= bucket < len(sizes):
            raise BackendError(f"bucket {bucket} is not part of update {up.update_id}")
        if bucket in up.received:
            raise BackendError(f"bucket {bucket} of update {up.update_id} arrived twice")
        if len(buf) != sizes[bucket]:
            raise BackendError(f"bucket {bucket} has {len(buf)} bytes, expected {sizes[bucket]}")
        if up.is_model:
            self.backend.stage_bucket(bucket, buf)
            if up.begin.check_finite and up.nonfinite is None:
                up.nonfinite = first_nonfinite(unpack_bucket(bucket, list(up.begin.tensors), buf))
        else:
            named = unpack_bucket(bucket, list(up.begin.tensors), buf)
            if up.begin.check_finite and up.nonfinite is None:
                up.nonfinite = first_nonfinite(named)
            up.lora_tensors.extend((n, t.clone()) for n, t in named)  # the frame dies after this call
        up.received.add(bucket)

    def _hold(
        self, up: WeightUpdate, bucket: int, buf: memoryview, sender: int, metas: list[P.TensorMeta], frame: Any
    ) -> None:
        if not 0 <= sender < up.begin.senders:
            raise BackendError(
                f"sender {sender} is not one of the {up.begin.senders} sender(s) of update {up.update_id}",
                field="sender",
            )
        if sender in up.ended and bucket >= up.ended[sender]:
            raise BackendError(f"sender {sender} declared {up.ended[sender]} bucket(s), then sent bucket {bucket}")
        if bucket < 0 or (sender, bucket) in up.held:
            raise BackendError(f"bucket {bucket} of sender {sender} is a duplicate or negative", field="bucket")
        for m in metas:
            if m.bucket != bucket or m.offset < 0 or m.nbytes < 0 or m.offset + m.nbytes > len(buf):
                raise BackendError(
                    f"tensor {m.name!r} claims bytes [{m.offset}, {m.offset + m.nbytes}) of bucket {bucket} "
                    f"(sender {sender}), which has {len(buf)} bytes",
                    field="metas",
                )
        # Keep the frame (zero-copy); without one, copy: `buf` dies with this call.
        up.held[(sender, bucket)] = (metas, frame if frame is not None else bytes(buf))
        up.tensors += len(metas)

    def on_sender_end(self, update_id: str, sender: int, buckets: int) -> None:
        """A sender declared its part complete (`buckets` buckets)."""
        up = self._require(update_id)
        if up.phase not in _OPEN:
            raise BackendError(f"sender {sender} ended update {update_id} in phase {up.phase.value}")
        if not 0 <= sender < up.begin.senders:
            raise BackendError(
                f"sender {sender} is not one of the {up.begin.senders} sender(s) of update {update_id}", field="sender"
            )
        if sender in up.ended and up.ended[sender] != buckets:
            raise BackendError(f"sender {sender} ended twice ({up.ended[sender]}, then {buckets} buckets)")
        extra = [b for (s, b) in up.held if s == sender and b >= buckets]
        if buckets < 0 or extra:
            raise BackendError(f"sender {sender} declared {buckets} bucket(s) but sent {sorted(extra)}")
        up.ended[sender] = buckets
        up.touched_at = self.core.now
        up.to(Phase.RECEIVING)
        self._maybe_prepare(up)

    def prepare(self, op: P.PrepareWeights, seq: int = 0) -> OpOutcome:
        up = self._require(op.update_id)
        if up.phase is Phase.PREPARED:
            return self._vote(up)  # a second prepare of the same update: same vote
        if up.phase not in _OPEN:
            raise BackendError(f"update {op.update_id} cannot prepare in phase {up.phase.value}", field="update_id")
        if up.incomplete() is None:
            return self._complete_prepare(up)
        up.waiting = (seq, self.core.now + max(0.0, op.wait_s), op.wait_s)
        return DEFERRED

    def receive(self, op: P.ReceiveWeights, seq: int = 0) -> OpOutcome:
        up = self._require(op.update_id)
        t0 = self.core.now
        if up.begin.streamed and up.begin.senders > 1 and not (op.tensors or op.bucket_sizes or op.handles):
            self.on_sender_end(up.update_id, op.sender, 0)  # a rank feeding other engines only (colocated)
            return P.ReceiveWeightsResult(seconds=0.0, detail={"empty_part": True})
        if up.gpu_parts:
            return self._receive_part(up, op)

        def then(res: dict[str, Any]) -> P.ReceiveWeightsResult:
            up.received.update(range(len(up.begin.bucket_sizes)))
            self._prepared(up)
            self.timings.receive(up.update_id, up.begin.transport, self.core.now - t0, res)
            return P.ReceiveWeightsResult(seconds=round(self.core.now - t0, 4), detail=dict(res))

        return Pending(self.backend.receive_weights(list(op.handles)), then, lambda e: self._abort("receive failed"))

    def _receive_part(self, up: WeightUpdate, op: P.ReceiveWeights) -> OpOutcome:
        """One sender's part of a multi-sender GPU update. The ack says the part
        is in (not a vote: the head's PrepareWeights collects the votes)."""
        r = op.sender
        if up.phase not in _OPEN:
            raise BackendError(f"update {up.update_id} takes no part in phase {up.phase.value}", field="update_id")
        if not 0 <= r < up.begin.senders:
            raise BadRequest(
                f"sender {r} is not one of the {up.begin.senders} sender(s) of update {up.update_id}", field="sender"
            )
        if r in up.ended:
            raise BadRequest(f"sender {r} already sent its part of update {up.update_id}", field="sender")
        if len(op.bucket_sizes) != len({m.bucket for m in op.tensors}) and op.tensors:
            raise BadRequest(
                f"sender {r}: {len(op.bucket_sizes)} bucket size(s) for buckets {sorted({m.bucket for m in op.tensors})}",
                field="bucket_sizes",
            )
        up.ended[r] = -1  # taken: a second part from r is refused while this one is in flight
        up.touched_at = self.core.now
        t0 = self.core.now
        receiver_for(up.begin.transport, op.transport_args)  # a part's args are its update's transport's
        args = backend_args(op.transport_args, list(op.bucket_sizes))
        bop = self.backend.receive_part(r, list(op.tensors), list(op.bucket_sizes), list(op.handles), args)

        def then(res: dict[str, Any]) -> P.ReceiveWeightsResult:
            up.ended[r] = len(op.bucket_sizes)
            up.tensors += len(op.tensors)
            up.bytes += int(sum(op.bucket_sizes))
            up.received.update(range(len(up.received), len(up.received) + len(op.bucket_sizes)))
            if up.phase is Phase.BEGUN:
                up.to(Phase.RECEIVING)
            self._maybe_prepare(up)
            self.timings.receive(up.update_id, up.begin.transport, self.core.now - t0, res)
            return P.ReceiveWeightsResult(seconds=round(self.core.now - t0, 4), detail=dict(res))

        return Pending(bop, then, lambda e: self._abort(f"sender {r}'s part failed: {e}", up))

    def commit(self, op: P.FinishWeightUpdate, seq: int = 0) -> OpOutcome:
        up = self._require(op.update_id)
        if up.is_model and not_above(op.version, self.core.weight_version):
            self._abort("its commit named a version not above the engine's")
            check_version(op.update_id, op.version, self.engine_id, self.core.weight_version)  # raises
        if up.phase is not Phase.PREPARED:
            why = up.incomplete() or f"it is {up.phase.value}, not prepared"
            self._abort("commit before prepare")
            raise BackendError(f"update {op.update_id} cannot commit: {why}", field="update_id")
        if up.is_model and self.core.weights_asleep():
            # A sleep came between begin and commit: nothing written, update over.
            self._abort("weights went to sleep before the commit")
            raise BackendRefused(
                f"update {op.update_id} cannot commit: the weights of {self.engine_id} went to sleep "
                "after its begin; wake_up(tags=['weights']) and send it again",
                field="target",
            )
        up.to(Phase.COMMITTING)
        t0 = self.core.now
        if up.is_model:
            bop = self.backend.commit_weight_update()
        else:
            name = up.begin.target.split(":", 1)[1]
            cfg = dict(up.begin.lora_config)
            bop = self.backend.load_lora(name, tensors=up.lora_tensors, config=cfg)

        def then(res: dict[str, Any]) -> P.WeightsCommitted:
            up.to(Phase.COMMITTED)
            self.timings.commit(up.update_id, up.begin.transport, self.core.now - t0, res)
            if self.current is up:
                self.current = None
            restarted, layout = 0, self.layouts.layout
            if up.is_model:
                restarted = self.core.weights_changed(op.version)
                layout = self.layouts.committed(up.begin, self.core.gate.sleeps)
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
                layout=layout,
                detail={"path": "two_trip", "commit_s": round(self.core.now - t0, 6), "worker": res.get("worker", {})},
            )

        return Pending(bop, then, lambda e: self._abort("finish failed", up))

    def abort(self, op: P.AbortWeightUpdate, seq: int = 0) -> OpOutcome:
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

    def tick(self, now: float) -> None:
        """Deadlines: a prepare waiting for senders; the decision TTL."""
        up = self.current
        if up is None:
            return
        if up.waiting is not None and now > up.waiting[1]:
            seq, _, wait_s = up.waiting
            up.waiting = None
            why = up.incomplete() or "incomplete"
            err = BackendError(
                f"update {up.update_id} on {self.engine_id} could not prepare: {why} within wait_s={wait_s}",
                field="senders" if "sender(s)" in why else "update_id",
            )
            self._abort(str(err))
            self.actions.append(SendAck.failed(seq, err))
            return
        if up.phase is Phase.PREPARED and now - up.prepared_at > self.prepare_ttl_s:
            self._abort(f"prepared, but no commit or abort came within prepare_ttl_s={self.prepare_ttl_s}")
        elif up.phase in _OPEN and up.waiting is None and now - up.touched_at > self.prepare_ttl_s:
            self._abort(f"nothing arrived for prepare_ttl_s={self.prepare_ttl_s}")

    # ------------------------------------------------------------ internals

    def _maybe_prepare(self, up: WeightUpdate) -> None:
        """A deferred prepare completes as soon as its last piece arrives."""
        if up.waiting is None or up.incomplete() is not None:
            return
        seq = up.waiting[0]
        up.waiting = None
        try:
            res = self._complete_prepare(up)
        except Exception as e:
            self.actions.append(SendAck.failed(seq, e))
            return
        self.actions.append(SendAck.done(seq, res))

    def _complete_prepare(self, up: WeightUpdate) -> P.WeightsPrepared:
        """Everything is in: streamed buckets go to the backend now (it learns
        the full tensor list first), then the vote. Any refusal aborts."""
        t0 = self.core.now
        try:
            if up.streamed and not up.gpu_parts:
                self._stage_held(up)
            if up.nonfinite is not None:
                raise BackendError(
                    f"update {up.update_id} on {self.engine_id}: tensor {up.nonfinite!r} has NaN or inf values; "
                    "refused before the vote (update_weights(check_finite=False) skips this check)",
                    field="tensors",
                )
        except Exception as e:
            self._abort(f"prepare failed: {e}", up)
            if isinstance(e, ValueError) and not isinstance(e, BackendError):
                raise BackendError(str(e), field="tensors") from None
            raise
        self._prepared(up)
        return self._vote(up, round(self.core.now - t0, 4))

    def _stage_held(self, up: WeightUpdate) -> None:
        order = sorted(up.held)
        index = {key: g for g, key in enumerate(order)}
        metas = [
            P.TensorMeta(m.name, m.dtype, list(m.shape), index[key], m.offset, m.nbytes)
            for key in order
            for m in up.held[key][0]
        ]
        sizes = [len(_view(up.held[key][1])) for key in order]
        if up.is_model:
            args = backend_args(up.begin.transport_args, sizes)
            bop = self.backend.begin_weight_update(up.update_id, up.begin.transport, metas, args)
            if not bop.future.done():  # both backends begin zmq updates synchronously
                raise BackendError("the backend's begin_weight_update must finish at once for streamed updates")
            bop.future.result()  # raises the backend's refusal (names the tensor)
            up.backend_open = True
        for key in order:
            g = index[key]
            _m, frame = up.held.pop(key)  # drop each frame as soon as it is staged
            buf = _view(frame)
            if up.is_model:
                self.backend.stage_bucket(g, buf)
                if up.begin.check_finite and up.nonfinite is None:
                    up.nonfinite = first_nonfinite(unpack_bucket(g, metas, buf))
            else:
                named = unpack_bucket(g, metas, buf)
                if up.begin.check_finite and up.nonfinite is None:
                    up.nonfinite = first_nonfinite(named)
                up.lora_tensors.extend((n, t.clone()) for n, t in named)
            up.received.add(g)

    def _prepared(self, up: WeightUpdate) -> None:
        up.to(Phase.PREPARED)
        up.prepared_at = self.core.now

    def _vote(self, up: WeightUpdate, seconds: float = 0.0) -> P.WeightsPrepared:
        return P.WeightsPrepared(
            buckets=len(up.received),
            tensors=up.tensors or len(up.begin.tensors),
            bytes=up.bytes,
            seconds=seconds,
        )

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
        cur.held.clear()
        if cur.waiting is not None:  # a deferred prepare learns it failed
            err = BackendError(f"update {cur.update_id} aborted: {why}")
            self.actions.append(SendAck.failed(cur.waiting[0], err))
            cur.waiting = None
        self.log_aborted(cur.update_id, why)
        if cur.is_model and cur.backend_open:
            return self.backend.abort_weight_update()
        return None


def _view(frame: Any) -> memoryview:
    """A held bucket: a zmq.Frame (its .buffer) or bytes."""
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf).cast("B")
