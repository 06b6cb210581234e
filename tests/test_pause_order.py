"""Issue 22: the reply to `pause()` must not overtake the chunks the engines
produced before they paused ("chunks arrive 0.2-0.3 ms after pause() returned,
4 of 40 rounds under load"). The engine's ack used to travel on its events
socket while its chunks travel on its data socket: two connections, no order
between them. Now the ack follows the chunks on the data connection, and the
head relays what it holds before it replies.

Checked on the wire (a raw DEALER on the head's frontend, messages in arrival
order), so the client's own thread scheduling cannot blur the order: after the
ControlReply of a pause, no chunk may arrive until the resume is sent."""

from __future__ import annotations

import time

import pytest
import zmq

from bus import protocol as P
from bus.auth import read_token
from bus.codec import Codec
from bus.frames import pack_tokens

ROUNDS = 16
STREAMS = 8


def _recv(sock: zmq.Socket, codec: Codec, timeout_s: float) -> object | None:
    if not sock.poll(int(timeout_s * 1000)):
        return None
    msg, _ = codec.decode(sock.recv_multipart(copy=False))
    return msg


@pytest.mark.timeout(300)
def test_no_chunk_arrives_after_the_pause_reply(cluster_factory):
    cl = cluster_factory(2)
    cl.wait_ready(2)
    codec = Codec()
    token = read_token(cl.token_file)  # pause/resume change the cluster: they need the join token
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    cl.credential().apply(sock, None)  # a token holder: past the handshake
    sock.connect(cl.frontend)
    late: list[tuple[int, str]] = []
    try:
        for rnd in range(ROUNDS):
            mode = ("abort", "keep")[rnd % 2]
            params = P.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            rids = [f"r{rnd}-{i}" for i in range(STREAMS)]
            for i, rid in enumerate(rids):
                sock.send_multipart(codec.encode(P.Generate(rid, params), [pack_tokens([7, 3, i + 1, rnd + 1])]))
            # Let the engines produce: pause while they stream.
            seen = 0
            deadline = time.monotonic() + 30
            while seen < STREAMS and time.monotonic() < deadline:
                msg = _recv(sock, codec, 1.0)
                seen += isinstance(msg, (P.Chunk, P.ChunkBatch))
            sock.send_multipart(codec.encode(P.Control(f"pause-{rnd}", P.Pause(mode=mode), timeout_s=30, token=token)))
            finals = 0
            while True:
                msg = _recv(sock, codec, 30)
                assert msg is not None, "no reply to the pause"
                if isinstance(msg, P.ControlReply) and msg.request_id == f"pause-{rnd}":
                    assert not msg.errors and not msg.missing, msg
                    break
            # Paused: whatever arrives now was produced before the pause and overtaken by its reply.
            quiet_until = time.monotonic() + 0.3
            while (left := quiet_until - time.monotonic()) > 0:
                msg = _recv(sock, codec, left)
                if isinstance(msg, (P.Chunk, P.ChunkBatch)):
                    late.append((rnd, mode))
            sock.send_multipart(codec.encode(P.Control(f"resume-{rnd}", P.Resume(), timeout_s=30, token=token)))
            resumed = False
            deadline = time.monotonic() + 60
            while (not resumed or finals < STREAMS) and time.monotonic() < deadline:
                msg = _recv(sock, codec, 5)
                if isinstance(msg, P.ControlReply) and msg.request_id == f"resume-{rnd}":
                    resumed = True
                elif isinstance(msg, P.Chunk):
                    finals += msg.finish_reason is not None
                elif isinstance(msg, P.ChunkBatch):
                    finals += sum(ch.finish_reason is not None for ch in msg.chunks)
                elif isinstance(msg, P.Error):
                    raise AssertionError(msg)
            assert resumed and finals == STREAMS, (rnd, resumed, finals)
    finally:
        sock.close(linger=0)
        ctx.term()
    assert not late, f"chunks arrived after the pause reply in rounds {sorted(set(late))} of {ROUNDS}"
