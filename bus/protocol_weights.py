"""Wire types of weight bytes (re-exported by bus/protocol.py: `P.WeightBucket`
and the rest are named from there): the tensor metas, and what zmq senders
send to an engine's weight socket.

The sender credential (issue 34, row 3): the head mints a random secret per
weight update at its begin (router_node/cluster_state.py), returns it to the
client that opened the update only (`ControlReply.sender_secret`) and hands it
to the engines in the begin it publishes (`BeginWeightUpdate.sender_secret`:
the control PUB reaches engines only). Every bucket and sender end carries it;
an engine takes bytes for its open update only with that update's secret
(engine_node/sender_check.py). The join token says "a member of this cluster";
the secret says "a sender of THIS update": another token holder (a second
script, an evaluation job) can neither inject bytes nor, by a forged
duplicate, abort the real update.

It travels as a bearer secret, not as an HMAC over the bucket: without
--curve the weight socket is plaintext, so an eavesdropper sees the join token
too, and an HMAC over the header alone would not bind the bytes; one over the
bytes would cost a pass over every weight (GBs per update) on both sides. With
--curve the channel is encrypted and the secret stays between the two ends.
Hazard: a Struct's repr shows every field: never log these messages whole.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from bus.wire import MAX_LIST, U32, U63, Id, Message, Name, Sender, Short
from bus.wire import Msg as _Msg
from bus.wire import Part as _Part

# secrets.token_hex(16): 128 bits, 32 characters (a Short holds up to 256).
SENDER_SECRET_BYTES = 16


class TensorMeta(_Part):
    name: Name
    dtype: Short  # torch dtype name without the "torch." prefix
    shape: Annotated[list[U63], Meta(max_length=64)]
    bucket: U32  # index of the bucket holding it
    offset: U63  # byte offset inside the bucket
    nbytes: U63


class WeightBucket(_Msg, tag="wbucket"):
    """Frames: [bucket bytes]."""

    update_id: Id
    bucket: U32  # the sender's own bucket index (0, 1, … per sender)
    # -- protocol 3
    sender: Sender = 0
    # streamed updates: this bucket's tensors (bucket = this index)
    metas: Annotated[list[TensorMeta], Meta(max_length=MAX_LIST)] = []
    # -- protocol 12: the update's sender secret (its opener's Begin reply)
    sender_secret: Short = ""


class WeightSenderEnd(_Msg, tag="wsender_end"):
    """A sender rank is done: it sent `buckets` buckets (0..buckets-1).
    Acked with a WeightBucketAck whose bucket is -1."""

    update_id: Id
    sender: Sender
    buckets: U32
    # -- protocol 12: as WeightBucket.sender_secret
    sender_secret: Short = ""


class WeightBucketAck(_Msg, tag="wbucket_ack"):
    update_id: Id
    bucket: Annotated[int, Meta(ge=-1, le=(1 << 32) - 1)]  # -1: a WeightSenderEnd's ack
    ok: bool = True
    error: Message | None = None
    # -- protocol 12: the refused field ("sender_secret", "tensors", ...)
    field: Short | None = None
