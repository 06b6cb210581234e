"""The head gathers what an engine sent while the head was behind (a real
head and null engine, a raw zmq client counting messages): after the head was
frozen, the chunks that piled up reach the client in a few messages instead of
one per chunk, every token in order and exactly one final."""

from __future__ import annotations

import signal
import time

import pytest
import zmq

from bus import protocol as P
from bus.codec import Codec, split_chunks
from bus.endpoint import open_socket
from bus.frames import pack_tokens, unpack_tokens

pytestmark = [pytest.mark.timeout(120)]

TOKENS = 400
STEP_S = 0.002
FROZEN_S = 0.4  # about 200 engine steps while the head cannot read


def test_a_head_that_fell_behind_sends_the_backlog_in_one_message_per_client(cluster_factory) -> None:
    cl = cluster_factory(1, backend="null", backend_options={"tokens_per_step": 1, "step_delay_s": STEP_S})
    cl.wait_ready(1)
    ctx = zmq.Context()
    sock = open_socket(ctx, zmq.DEALER, connect=cl.frontend, plain=cl.credential())
    codec = Codec()
    try:
        params = P.SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        msg = P.Generate(request_id="g1", params=params, stream=True, timeout_s=60)
        sock.send_multipart(codec.encode(msg, [pack_tokens([5, 6, 7])]))
        messages = chunks = finals = 0
        sizes: list[int] = []
        tokens: list[int] = []
        frozen = False
        deadline = time.monotonic() + 60
        while finals == 0:
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0 and sock.poll(left_ms), f"no final within 60 s: {chunks} chunks in {messages} messages"
            whole, bufs = codec.decode(sock.recv_multipart())
            messages += 1
            got = split_chunks(whole, bufs)
            sizes.append(len(got))
            for ch, b in got:
                assert isinstance(ch, P.Chunk) and ch.request_id == "g1", ch
                chunks += 1
                tokens += unpack_tokens(bytes(b[0])) if b else []
                finals += ch.finish_reason is not None
            if not frozen and chunks >= 5:
                cl.kill("head", signal.SIGSTOP)  # the engine keeps stepping; its chunks wait for the head
                time.sleep(FROZEN_S)
                cl.kill("head", signal.SIGCONT)
                frozen = True
        assert finals == 1 and len(tokens) == TOKENS, (finals, len(tokens))
        # the backlog left the head in a few gathered messages, not one per chunk
        assert max(sizes) >= 50, sizes
        assert messages <= chunks - 100, (messages, chunks, sizes)
        sock.send_multipart(codec.encode(msg, [pack_tokens([5, 6, 7])]))  # the head serves on: same answer again
        again: list[int] = []
        done = False
        while not done:
            assert sock.poll(30_000), "the second request got no final within 30 s"
            whole, bufs = codec.decode(sock.recv_multipart())
            for ch, b in split_chunks(whole, bufs):
                again += unpack_tokens(bytes(b[0])) if b else []
                done = done or ch.finish_reason is not None
        assert again == tokens  # greedy null engine: the same tokens, in the same order
    finally:
        sock.close(linger=0)
        ctx.term()
