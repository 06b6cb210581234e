"""Pure units: framing, field paths, weight buckets, policies, sessions, control bus."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bus import protocol as P
from bus.codec import Codec
from bus.errors import BadRequest, ProtocolError
from bus.frames import pack_logprobs, pack_tokens
from bus.tensors import pack_bucket, plan_buckets, unpack_bucket
from router_node.policies import Sessions, pick_least_loaded, pick_least_loaded_exact


def test_every_message_round_trips():
    c = Codec()
    msgs = [
        P.Generate("r", P.SamplingParams(max_tokens=3, stop_token_ids=[1, 2]), num_samples=2, session_id="s", lora="l"),
        P.Cancel("r"),
        P.Chunk("r", 1, 3, "stop", [[2, 4]], 1.5, 7, "e0"),
        P.ChunkBatch([P.Chunk("a"), P.Chunk("b", finish_reason="length")], [1, 2]),
        P.Error("r", "bad_request", "m", "f"),
        P.Command(1, P.Pause(mode="keep", lora="x"), ["e0"]),
        P.Ack(1, "e0", P.WeightsCommitted(weight_version=2, loras=["x"], epoch=3, bytes=8)),
        P.Ack(2, "e0", None, P.EngineFailure("backend_timeout", "took too long", "op_timeout_s")),
        P.Control("r", P.BeginWeightUpdate("u", "zmq", [P.TensorMeta("w", "float32", [2], 0, 0, 8)], [256])),
        P.ControlReply(
            "r", {"e0": P.PauseResult(mode="abort", parked=2)}, {"e1": P.EngineFailure("timeout", "x")}, ["e2"]
        ),
        P.Query("r", "health"),
        P.QueryReply("r", P.SessionEnded(ended=True)),
        P.QueryReply("r", P.HealthView(True, {"e0": P.EngineView("e0", True, intended=P.IntentView(["*"]))})),
        P.QueryReply("r", P.EnginesView([P.EngineView("e0", curve_key="k", heartbeat_age_s=0.5)])),
        P.QueryReply("r", P.StatsView({"errors": 1}, 2, 3, P.PrefixView(placed=1, blocks={"e0": 4}))),
        P.QueryReply("r", P.WeightUpdatesView({"u": P.WeightTxnView("u", targets=["e0"], decision=None)})),
        P.QueryReply("r", P.DecisionsView({"u": None, "v": "commit"})),
        P.EndSession("r", "s"),
        P.Register("e0", "ipc://d", "ipc://w", "torch", "m", 1, "inc"),
        P.RegisterReply(True),
        P.RegisterReply(True, data_peer="head/abc"),
        P.Rejoin("the head restarted"),
        P.ClientPing(),
        P.HeadPong(lease_s=10.0),
        P.Heartbeat("e0", "inc", running=3, paused=["*"]),
        P.WeightBucket("u", 0),
        P.WeightBucketAck("u", 0, False, "e"),
        P.WeightBucket("u", 1, sender=2, metas=[P.TensorMeta("w", "float32", [2], 1, 0, 8)]),
        P.WeightSenderEnd("u", 2, 3),
        P.Command(3, P.PrepareWeights("u", wait_s=2.0)),
        P.Ack(3, "e0", P.WeightsPrepared(buckets=2, tensors=3, bytes=16)),
        P.Ack(4, "e0", P.StatsResult(P.Heartbeat("e0", "inc", running=1), {"loop": {"turns": 3}})),
        P.Control(
            "r", P.BeginWeightUpdate("u", "cuda_ipc", [], [], senders=2, streamed=True, prepare=True, handles=[b"h"])
        ),
    ]
    assert {type(m) for m in msgs} == set(P.KIND_OF)
    for m in msgs:
        frames = c.encode(m, [b"raw"])
        back, bufs = c.decode(frames)
        assert back == m and bufs == [b"raw"]


@pytest.mark.parametrize(
    "body,field",
    [
        (["gen", "r", [1, "hot"]], "params.temperature"),
        (["gen", "r", [1, 1.0, 1.0, 0, "seed"]], "params.seed"),
        (["gen", "r", [1], "two"], "num_samples"),
    ],
)
def test_validation_errors_name_the_field(body, field):
    with pytest.raises(BadRequest) as e:
        Codec().decode([msgspec.msgpack.encode(body)])
    assert e.value.field == field


@pytest.mark.parametrize(
    "frames,field",
    [
        ([msgspec.msgpack.encode(["nope", "r"])], "kind"),  # a tag no message has
        ([msgspec.msgpack.encode(["ping"])], "kind"),  # a control op's tag is no message's
        ([msgspec.msgpack.encode([None, "r"])], "kind"),
        ([b"\xc1"], "body"),
        ([b"\x90"], "body"),  # an empty array
        ([b"G", msgspec.msgpack.encode(["gen", "r"])], "body"),  # protocol 10's kind frame first
        ([], "frames"),
    ],
)
def test_unknown_kind_and_garbage_are_protocol_errors(frames, field):
    with pytest.raises(ProtocolError) as e:
        Codec().decode(frames)
    assert e.value.field == field


def test_one_frame_less_than_protocol_9():
    """The kind is the body's tag: a chunk is [body, token frame], no kind frame."""
    frames = Codec().encode(P.Chunk("r", 1), [b"\x01\x00\x00\x00"])
    assert len(frames) == 2 and msgspec.msgpack.decode(frames[0])[0] == P.KIND_OF[P.Chunk] == "chunk"


_dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8])
_shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_dtypes, _shapes), min_size=1, max_size=8), st.integers(1, 600))
def test_buckets_round_trip_any_tensors(specs, bucket_bytes):
    g = torch.Generator().manual_seed(0)
    named = [(f"t{i}", (torch.randn(shape, generator=g) * 50).to(dt)) for i, (dt, shape) in enumerate(specs)]
    metas, sizes, tensors = plan_buckets(named, bucket_bytes)
    assert len(metas) == len(named)
    got = {}
    for b in range(len(sizes)):
        buf = pack_bucket(b, metas, sizes, tensors)
        assert buf.numel() == sizes[b]
        assert sizes[b] <= max(bucket_bytes, max(m.nbytes for m in metas if m.bucket == b)) + 256 * len(metas)
        got.update(unpack_bucket(b, metas, bytes(buf.numpy())))
    for name, t in named:
        assert torch.equal(got[name], t) and got[name].dtype == t.dtype


def test_unpack_refuses_a_short_bucket():
    metas, sizes, tensors = plan_buckets([("w", torch.zeros(10))], 1 << 20)
    with pytest.raises(ValueError, match="w needs"):
        unpack_bucket(0, metas, b"\x00" * 8)


class _E:
    def __init__(self, eid: str, outstanding: int, capacity: int = 64) -> None:
        self.engine_id = eid
        self.outstanding = outstanding
        self.reg = P.Register(eid, "", "", "t", "m", 1, "i", capacity=capacity)


def test_power_of_two_choices_never_picks_the_most_loaded_of_its_pair():
    rng = random.Random(0)
    es = [_E("a", 0), _E("b", 50), _E("c", 10)]
    picks = [pick_least_loaded(es, rng).engine_id for _ in range(300)]
    assert "b" not in picks and {"a", "c"} == set(picks)
    assert pick_least_loaded_exact(es, rng).engine_id == "a"


def test_sessions_ttl_and_end():
    s = Sessions(ttl_s=10)
    s.bind("x", "e0", now=0)
    assert s.engine_for("x", now=5) == "e0"
    s.bind("x", "e0", now=5)  # use refreshes the TTL
    assert s.engine_for("x", now=14) == "e0"
    assert s.engine_for("x", now=30) is None  # expired: re-placed by least load
    s.bind("y", "e1", now=0)
    assert s.expire(now=100) == 1 and s.count() == 0
    s.bind("z", "e1", now=0)
    assert s.end("z") and not s.end("z")


def test_control_bus_republishes_until_acked_and_reports_missing():
    from bus.control_bus import ControlBus

    sent = []

    class Pub:
        def send_multipart(self, frames):
            sent.append(frames)

    done = []
    bus = ControlBus(Pub(), Codec(), republish_s=0.0)
    pc = bus.publish(P.Ping(), ["e0", "e1"], 5.0, done.append)
    bus.tick(now=pc.published_at + 0.01)  # no acks yet: published again
    assert len(sent) == 2
    bus.on_ack(P.Ack(pc.seq, "e0"))
    bus.on_ack(P.Ack(pc.seq, "e0"))  # duplicate ack ignored
    bus.tick(now=pc.published_at + 0.02)
    assert Codec().decode(sent[-1][1:])[0].targets == ["e1"]  # only the laggard
    bus.tick(now=pc.deadline + 1)
    assert done == [pc] and pc.missing == ["e1"] and set(pc.acks) == {"e0"}


def test_np_prompt_frames_are_little_endian_int32():
    from bus.validate import prompt_from_frames

    arr = prompt_from_frames(P.Generate("r"), [np.asarray([1, 2, 3], dtype="<i4").tobytes()], max_prompt_tokens=8)
    assert arr.tolist() == [1, 2, 3]


def test_control_bus_reports_dead_targets_at_once():
    from bus.control_bus import ControlBus

    class Pub:
        def send_multipart(self, frames):
            raise AssertionError("nothing to publish to dead engines only")

    done = []
    pc = ControlBus(Pub(), Codec()).publish(P.Ping(), ["e0", "e1"], 30.0, done.append, gone=["e0", "e1"])
    assert done == [pc] and pc.missing == ["e0", "e1"]


def test_outbox_batches_per_peer_and_split_chunks_restores_buffers():
    from bus.codec import Outbox, split_chunks, split_packed

    ta, tb, tx = pack_tokens([1, 2]), pack_tokens([3]), pack_tokens([9])
    lb = pack_logprobs([-0.5])
    box = Outbox()
    box.add(b"p1", P.Chunk("a"), [ta])
    box.add(b"p2", P.Chunk("x"), [tx, b"lx00"])
    box.add(b"p1", P.Chunk("b", finish_reason="stop"), [tb, lb])
    sent = list(box.messages())
    assert not box.by_peer
    by_peer = {peer: (msg, bufs) for peer, msg, bufs in sent}
    assert isinstance(by_peer[b"p2"][0], P.Chunk)  # a lone chunk stays a Chunk
    batch, bufs = by_peer[b"p1"]
    assert isinstance(batch, P.ChunkBatch)
    # Packed: one token frame for both chunks, then chunk b's logprob frame.
    assert batch.ntoks == [2, 1] and batch.nbufs == [0, 1] and len(bufs) == 2
    c = Codec()
    msg, back = c.decode(c.encode(batch, bufs))
    parts = split_chunks(msg, back)
    assert [(ch.request_id, [bytes(b) for b in bs]) for ch, bs in parts] == [("a", [ta]), ("b", [tb, lb])]
    assert [(ch.request_id, t, [bytes(b) for b in r]) for ch, t, r in split_packed(msg, back)] == [
        ("a", [1, 2], []),
        ("b", [3], [lb]),
    ]
    assert split_chunks(P.Chunk("z"), [b"t"]) == [(P.Chunk("z"), [b"t"])]
    assert split_packed(P.Chunk("z"), [tx]) == [(P.Chunk("z"), [9], [])]
    # A chunk without a token frame: the unpacked layout, still split right.
    box.add(b"p3", P.Chunk("e"), [])
    box.add(b"p3", P.Chunk("f"), [tb])
    [(_, batch, bufs)] = list(box.messages())
    assert batch.ntoks == [] and batch.nbufs == [0, 1]
    assert [(ch.request_id, t) for ch, t, _ in split_packed(batch, bufs)] == [("e", []), ("f", [3])]


def test_outbox_flush_sends_what_messages_returns():
    """flush (the engine's per-chunk path) sends exactly messages()'s list, in order."""
    from bus.codec import Outbox

    def fill(box: Outbox) -> None:
        box.add(b"p1", P.Chunk("a"), [pack_tokens([1, 2])])
        box.add(b"p2", P.Chunk("x"), [pack_tokens([9]), pack_logprobs([-0.5])])
        box.add(b"p1", P.Chunk("b", finish_reason="stop"), [pack_tokens([3])])
        box.add(b"p3", P.Chunk("e"), [])
        box.add(b"p3", P.Chunk("f"), [pack_tokens([4])])

    a, b = Outbox(), Outbox()
    fill(a)
    fill(b)
    sent: list[tuple[bytes, object, list[bytes]]] = []
    a.flush(lambda peer, msg, bufs: sent.append((peer, msg, bufs)))
    assert not a.by_peer and sent == b.messages()
    a.flush(lambda *m: pytest.fail("an empty box sends nothing"))


@pytest.mark.parametrize(
    ("batch", "nframes", "field"),
    [
        (P.ChunkBatch([P.Chunk("a"), P.Chunk("b")], [1]), 1, "nbufs"),  # a count missing
        (P.ChunkBatch([P.Chunk("a")], [-1]), 0, "nbufs"),
        (P.ChunkBatch([P.Chunk("a"), P.Chunk("b")], [1, 1]), 3, "nbufs"),  # more frames than counted
        (P.ChunkBatch([P.Chunk("a")], [0], [2]), 0, "ntoks"),  # packed, no token frame
        (P.ChunkBatch([P.Chunk("a")], [0], [3]), 1, "ntoks"),  # the frame holds 2 ids, not 3
        (P.ChunkBatch([P.Chunk("a")], [0], [-1]), 1, "ntoks"),
        (P.ChunkBatch([P.Chunk("a"), P.Chunk("b")], [0, 0], [2]), 1, "ntoks"),
        (P.ChunkBatch([P.Chunk("a")], [1], [2]), 1, "nbufs"),  # counts a logprob frame that is not there
    ],
)
def test_malformed_chunk_batches_are_typed_errors_naming_the_field(batch, nframes, field):
    from bus.codec import split_chunks, split_packed

    frames = [pack_tokens([7, 8])] * nframes
    for split in (split_chunks, split_packed):
        with pytest.raises(ProtocolError) as e:
            split(batch, frames)
        assert e.value.field == field


def test_split_packed_refuses_frames_that_are_not_4_byte_values():
    from bus.codec import split_packed

    with pytest.raises(ProtocolError) as e:
        split_packed(P.Chunk("a"), [b"\x01\x02\x03"])
    assert e.value.field == "frames"
    with pytest.raises(ProtocolError):
        split_packed(P.ChunkBatch([P.Chunk("a")], [1], [1]), [pack_tokens([1]), b"\x00"])


def test_an_engine_error_text_reaches_the_client_cut_to_1kb():
    from bus import protocol as P
    from bus.errors import MAX_ECHO
    from router_node.acks import failure_of

    f = failure_of(P.Ack(seq=1, engine_id="e0", failure=P.EngineFailure("backend_refused", "x" * 50_000, "w")))
    assert len(f.message) <= MAX_ECHO and f.message.endswith("more chars]") and f.field == "w"
