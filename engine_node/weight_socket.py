"""An engine node's weight data socket: the ROUTER that zmq-transport weight
buckets arrive on (`WeightBucket`, `WeightSenderEnd`), each answered with a
`WeightBucketAck`. The transaction they feed is engine_node/weight_update.py.

Ownership: the node's loop thread (the socket and every method here).

Hazards:
- a bucket or sender end for the open update without its sender secret
  (engine_node/sender_check.py: another token holder, not a sender of it) is
  refused naming `sender_secret`, counted (the engine's Stats:
  `detail["timings"]["weight_refusals"]`) and logged at a bounded rate, and the update goes on untouched;
- a refused bucket or sender end (BackendError / ValueError: bad size, unknown
  update, duplicate) aborts the update it belongs to and is answered with
  ok=False naming why; any other exception is a bug of ours: logged with its
  traceback, answered the same way, and the node keeps serving;
- a bucket's zmq frame is passed on with its view: a streamed update keeps it
  (zero-copy) until the prepare stages it;
- a bucket may complete a prepare that waited for it: `after` (the node's
  flush) runs after every bucket so its deferred ack goes out at once;
- a sender that left loses only its bucket acks: nothing to undo here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

from bus import auth, roles
from bus import protocol as P
from bus.codec import Codec
from bus.endpoint import Endpoint
from bus.errors import Unauthorized
from bus.ratelog import RateLimitedLog
from engine_node.backend import BackendError
from engine_node.peer_keys import Handler, keyed
from engine_node.sender_check import check_sender
from engine_node.weight_update import WeightUpdates


class WeightSocket:
    def __init__(
        self,
        sock: zmq.Socket,
        codec: Codec,
        updates: WeightUpdates,
        *,
        engine_id: str,
        gate: auth.Gatekeeper | None,
        after: Callable[[], None],
        max_batch: int,
        log: Any,
    ) -> None:
        self.updates = updates
        self.engine_id = engine_id
        self.after = after
        self.log = log
        self.sock = sock  # bound by the node (its address goes into the Register)
        # Senders refused for their credential: counted per kind, one log line per interval.
        self.refusals = RateLimitedLog(log)
        self.refusals.counts = updates.timings.weight_refusals  # shown in Stats: detail["timings"]
        handlers: dict[type, Handler] = {
            P.WeightBucket: self._on_bucket,
            P.WeightSenderEnd: self._on_sender_end,
        }
        self.ep = Endpoint(
            self.sock,
            codec,
            {t: keyed(gate, roles.WEIGHTS, lambda: self.ep.frames, h) for t, h in handlers.items()},
            name="weights",
            routed=True,
            error_reply=lambda rid, code, message, field: P.WeightBucketAck(
                update_id="", bucket=-1, ok=False, error=message, field=field
            ),
            max_batch=max_batch,
        )

    def _on_bucket(self, peer: bytes, msg: P.WeightBucket, buffers: list[Any]) -> None:
        if not self._admitted(peer, msg.update_id, msg.bucket, msg.sender, msg.sender_secret):
            return
        ack = P.WeightBucketAck(update_id=msg.update_id, bucket=msg.bucket)
        try:
            if not buffers:
                raise BackendError(f"bucket {msg.bucket} of update {msg.update_id} has no data frame")
            self.updates.on_bucket(
                msg.update_id, msg.bucket, buffers[0].buffer, sender=msg.sender, metas=msg.metas, frame=buffers[0]
            )
        except Exception as e:  # refused, or a bug (logged in _refused): answer it, keep serving
            ack = self._refused(msg.update_id, msg.bucket, e)
        self.ep.send(peer, ack)
        self.after()

    def _on_sender_end(self, peer: bytes, msg: P.WeightSenderEnd, _b: list[Any]) -> None:
        if not self._admitted(peer, msg.update_id, -1, msg.sender, msg.sender_secret):
            return
        ack = P.WeightBucketAck(update_id=msg.update_id, bucket=-1)
        try:
            self.updates.on_sender_end(msg.update_id, msg.sender, msg.buckets)
        except Exception as e:  # as in _on_bucket
            ack = self._refused(msg.update_id, -1, e)
        self.ep.send(peer, ack)
        self.after()

    def _admitted(self, peer: bytes, update_id: str, bucket: int, sender: int, secret: str) -> bool:
        """The sender credential; a peer that fails it gets a refusal and
        changes nothing (no abort: it is not the update's sender)."""
        what = f"the end of sender {sender}" if bucket < 0 else f"bucket {bucket} of sender {sender}"
        try:
            check_sender(self.updates.current, update_id, secret, self.engine_id, what)
        except Unauthorized as e:
            kind = "weight_sender_end_refused" if bucket < 0 else "weight_bucket_refused"
            self.refusals.refused(
                "weight_sender_refused", kind=kind, update_id=update_id, sender=sender, field=e.field, code=e.code.value
            )
            self.ep.send(
                peer, P.WeightBucketAck(update_id=update_id, bucket=bucket, ok=False, error=e.message, field=e.field)
            )
            return False
        return True

    def _refused(self, update_id: str, bucket: int, e: Exception) -> P.WeightBucketAck:
        if not isinstance(e, (BackendError, ValueError)):
            self.log.exception("weight_bucket_crashed", update_id=update_id, bucket=bucket)
        self.updates.abort_current(update_id, str(e))
        field = getattr(e, "field", None)
        return P.WeightBucketAck(
            update_id=update_id, bucket=bucket, ok=False, error=f"{self.engine_id}: {e}", field=field
        )

    def close(self) -> None:
        self.ep.close()
