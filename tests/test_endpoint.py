"""bus.endpoint and bus.frames without processes: dispatch through the handler
table, typed error replies after a flush, gone peers per socket, CURVE decided
in one place, frame layouts and version marks."""

from __future__ import annotations

import msgspec
import zmq

from bus import protocol as P
from bus.auth import KeyDir
from bus.codec import Codec
from bus.endpoint import Endpoint, open_socket
from bus.errors import BadRequest, ControlError
from bus.frames import (
    chunk_versions,
    note_version,
    pack_logprobs,
    pack_tokens,
    shift_marks,
    token_count,
    token_versions,
    unpack_logprobs,
    unpack_tokens,
)


def _pair(ctx: zmq.Context, handlers, **kw):
    server = open_socket(ctx, zmq.ROUTER, bind="inproc://ep")
    client = open_socket(ctx, zmq.DEALER, connect="inproc://ep")
    return Endpoint(server, Codec(), handlers, name="test", routed=True, **kw), client


def _recv(sock: zmq.Socket, codec: Codec):
    assert sock.poll(2000)
    return codec.decode(sock.recv_multipart())


def test_handler_table_typed_errors_and_flush_before_error() -> None:
    ctx = zmq.Context()
    codec = Codec()
    order: list[str] = []

    def on_cancel(peer: bytes, msg: P.Cancel, _b) -> None:
        order.append("handled")
        raise BadRequest("no such request", request_id=msg.request_id, field="request_id")

    ep, client = _pair(ctx, {P.Cancel: on_cancel}, before_error=lambda: order.append("flushed"))
    try:
        client.send_multipart(codec.encode(P.Cancel("r1")))
        client.send_multipart([msgspec.msgpack.encode(["junk"])])  # unknown kind
        client.send_multipart(codec.encode(P.Query("r2", "health")))  # not served here
        assert ep.sock.poll(2000)
        ep.drain()
        errs = [_recv(client, codec)[0] for _ in range(3)]
        assert [(e.request_id, e.code, e.field) for e in errs] == [
            ("r1", "bad_request", "request_id"),
            ("", "protocol", "kind"),
            ("r2", "protocol", "kind"),
        ]
        assert order[:2] == ["handled", "flushed"]
    finally:
        ep.close()
        client.close(linger=0)
        ctx.term()


def test_gone_peer_is_reported_to_its_own_socket_only() -> None:
    ctx = zmq.Context()
    gone_a: list[bytes] = []
    gone_b: list[bytes] = []
    a = Endpoint(open_socket(ctx, zmq.ROUTER, bind="inproc://a"), Codec(), {}, name="a", routed=True)
    b = Endpoint(open_socket(ctx, zmq.ROUTER, bind="inproc://b"), Codec(), {}, name="b", routed=True)
    a.on_peer_gone, b.on_peer_gone = gone_a.append, gone_b.append
    try:
        assert a.send(b"nobody", P.Error("r", "internal", "x")) is False
        assert gone_a == [b"nobody"] and gone_b == []
    finally:
        a.close()
        b.close()
        ctx.term()


def test_curve_is_applied_to_tcp_only(tmp_path) -> None:
    keys = KeyDir(str(tmp_path / "k")).init()
    ctx = zmq.Context()
    tcp = open_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", curve=keys.head(), zap_domain="clients")
    ipc = open_socket(ctx, zmq.ROUTER, bind=f"ipc://{tmp_path}/s", curve=keys.head(), zap_domain="clients")
    out = open_socket(ctx, zmq.DEALER, connect="tcp://127.0.0.1:1", curve=keys.client())
    try:
        assert tcp.getsockopt(zmq.MECHANISM) == zmq.CURVE and tcp.getsockopt(zmq.CURVE_SERVER)
        assert tcp.getsockopt(zmq.ZAP_DOMAIN) == b"clients"
        assert ipc.getsockopt(zmq.MECHANISM) == zmq.NULL
        assert out.getsockopt(zmq.MECHANISM) == zmq.CURVE and not out.getsockopt(zmq.CURVE_SERVER)
    finally:
        for s in (tcp, ipc, out):
            s.close(linger=0)
        ctx.term()


def test_frame_layouts_and_version_marks() -> None:
    frame = pack_tokens([1, 2, 70000])
    assert token_count(frame) == 3 and unpack_tokens(frame) == [1, 2, 70000]
    assert pack_tokens((1, 2, 70000)) == frame
    assert unpack_logprobs(pack_logprobs([-0.5, -1.0])) == [-0.5, -1.0]
    marks: list[list[int]] = []
    for offset, version in [(0, 3), (2, 3), (4, 4), (5, 5)]:
        note_version(marks, offset, version)
    assert marks == [[0, 3], [4, 4], [5, 5]]
    first, changes = chunk_versions(shift_marks(marks, 4), default=9)
    assert (first, changes) == (3, [[0, 4], [1, 5]])
    assert token_versions(first, changes, 3) == [4, 5, 5]
    assert chunk_versions([], default=9) == (9, [])


def test_typed_results_read_as_dicts_and_control_error_names_codes() -> None:
    r = P.SleepResult(level=1, parked=2, detail={"weights": "kept"})
    assert r["level"] == 1 and r["weights"] == "kept" and dict(r)["parked"] == 2 and "weights" in r
    failure = P.EngineFailure("backend_timeout", "commit did not finish", "op_timeout_s")
    err = ControlError("failed", errors={"e0": failure}, request_id="c1")
    typed = err.exception("e0")
    assert type(typed).__name__ == "BackendTimeout" and typed.field == "op_timeout_s"


def test_client_reads_packed_batches_and_outlives_a_garbled_one(tmp_path) -> None:
    """A fake head on a real socket answers an AsyncClient stream with a
    garbled packed ChunkBatch (dropped), then packed batches holding both
    samples' chunks: one with logprobs, one the final with top-k."""
    import asyncio

    from bus.codec import Outbox
    from trainer_bridge.client import AsyncClient

    addr = f"ipc://{tmp_path}/head"
    ctx = zmq.Context()
    head = open_socket(ctx, zmq.ROUTER, bind=addr)
    codec = Codec()

    def serve() -> None:
        assert head.poll(5000), "the client never sent its Generate"
        peer, *frames = head.recv_multipart()
        gen, _ = codec.decode(frames)
        rid = gen.request_id
        # ntoks says 3 ids, the frame holds 2: the client must drop it, typed, and go on.
        bad = P.ChunkBatch([P.Chunk(rid), P.Chunk(rid, 1)], [0, 0], [3, 0])
        head.send_multipart([peer, *codec.encode(bad, [pack_tokens([5, 6])])])
        box = Outbox()
        box.add(peer, P.Chunk(rid, 0, emitted_at=1.0), [pack_tokens([1, 2]), pack_logprobs([-0.5, -0.25])])
        box.add(peer, P.Chunk(rid, 1, weight_version=3), [pack_tokens([7])])
        for p, msg, bufs in box.messages():
            assert isinstance(msg, P.ChunkBatch) and msg.ntoks == [2, 1]
            head.send_multipart([p, *codec.encode(msg, bufs)])
        box.add(
            peer,
            P.Chunk(rid, 0, finish_reason="stop", top_logprobs=2),
            [pack_tokens([3]), pack_logprobs([-0.1]), pack_tokens([3, 4]), pack_logprobs([-0.1, -2.0])],
        )
        box.add(peer, P.Chunk(rid, 1, finish_reason="length", engine_id="e9"), [pack_tokens([8, 9])])
        for p, msg, bufs in box.messages():
            head.send_multipart([p, *codec.encode(msg, bufs)])

    async def main() -> list:
        client = AsyncClient(addr, timeout_s=10)
        try:
            out = []
            agen = client.stream([1, 2, 3], {"max_tokens": 3}, num_samples=2)
            first = asyncio.ensure_future(agen.__anext__())
            await asyncio.get_running_loop().run_in_executor(None, serve)
            out.append(await first)
            async for ch in agen:
                out.append(ch)
            return out
        finally:
            await client.close()

    try:
        got = asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        head.close(linger=0)
        ctx.term()
    assert [(c.sample_index, c.token_ids, c.logprobs, c.finish_reason) for c in got] == [
        (0, [1, 2], [-0.5, -0.25], None),
        (1, [7], None, None),
        (0, [3], [-0.10000000149011612], "stop"),
        (1, [8, 9], None, "length"),
    ]
    assert got[0].emitted_at == 1.0 and got[1].weight_version == 3 and got[3].engine_id == "e9"
    assert got[2].top_ids == [[3, 4]] and got[2].top_logprobs == [[-0.10000000149011612, -2.0]]
