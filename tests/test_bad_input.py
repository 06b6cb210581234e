"""Bad input gets a typed Error naming the field; the node keeps serving."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq

from bus import protocol as P
from bus.codec import Codec, split_chunks

GOOD_PROMPT = np.asarray([5, 6, 7], dtype="<i4").tobytes()


@pytest.fixture(params=["head", "engine"])
def raw(request, torch_cluster):
    """A raw DEALER socket to the head's frontend or straight to an engine."""
    addr = torch_cluster.frontend if request.param == "head" else torch_cluster.data_address("e0")
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 20_000)
    torch_cluster.credential().apply(s, None)  # a token holder (the engines run with --direct-clients)
    s.connect(addr)
    yield s
    s.close(linger=0)
    ctx.term()


def ask(sock: zmq.Socket, frames: list[bytes]):
    sock.send_multipart(frames)
    return Codec().decode(sock.recv_multipart())


def gen(rid: str, **kw) -> bytes:
    params = kw.pop("params", P.SamplingParams(max_tokens=2))
    return msgspec.msgpack.encode(P.Generate(request_id=rid, params=params, **kw))


def assert_still_serving(sock: zmq.Socket) -> None:
    # The head may send a client several chunks as one ChunkBatch (what one drain gathered).
    chunks = split_chunks(*ask(sock, [gen("after"), GOOD_PROMPT]))
    while True:
        assert chunks and all(isinstance(c, P.Chunk) and c.request_id == "after" for c, _ in chunks), chunks
        if chunks[-1][0].finish_reason is not None:
            return
        chunks = split_chunks(*Codec().decode(sock.recv_multipart()))


CASES = {
    "malformed body": ([b"\xc1\xc1 not msgpack"], "protocol", "body"),
    "unknown kind": ([msgspec.msgpack.encode(["no-such-kind", "r"])], "protocol", "kind"),
    "kind not a string": ([msgspec.msgpack.encode([7, "r"])], "protocol", "kind"),
    "body not a message": ([b"G"], "protocol", "body"),
    "protocol 10 layout (kind frame)": ([b"G", gen("r-old"), GOOD_PROMPT], "protocol", "body"),
    "wrong field type": (
        [msgspec.msgpack.encode(["gen", "r-type", [-1.5, "hot"]]), GOOD_PROMPT],
        "bad_request",
        "params.max_tokens",
    ),
    "wrong request id type": ([msgspec.msgpack.encode(["gen", 17]), GOOD_PROMPT], "bad_request", "request_id"),
    "empty prompt": ([gen("r-empty"), b""], "bad_request", "prompt_token_ids"),
    "no prompt frame": ([gen("r-noframe")], "bad_request", "prompt_token_ids"),
    "ragged prompt": ([gen("r-ragged"), b"\x01\x02\x03"], "bad_request", "prompt_token_ids"),
    "max_tokens zero": (
        [gen("r-max0", params=P.SamplingParams(max_tokens=0)), GOOD_PROMPT],
        "bad_request",
        "params.max_tokens",
    ),
    "max_tokens negative": (
        [gen("r-maxneg", params=P.SamplingParams(max_tokens=-3)), GOOD_PROMPT],
        "bad_request",
        "params.max_tokens",
    ),
    "token outside vocabulary": (
        [gen("r-vocab"), np.asarray([5, 10**6], dtype="<i4").tobytes()],
        "bad_request",
        "prompt_token_ids",
    ),
    "negative token": (
        [gen("r-neg"), np.asarray([-4], dtype="<i4").tobytes()],
        "bad_request",
        "prompt_token_ids",
    ),
    "too large message": (
        [gen("r-huge"), np.zeros(40_000, dtype="<i4").tobytes()],
        "bad_request",
        "prompt_token_ids",
    ),
    "bad temperature": (
        [gen("r-temp", params=P.SamplingParams(temperature=-1.0)), GOOD_PROMPT],
        "bad_request",
        "params.temperature",
    ),
    "zero samples": ([gen("r-n0", num_samples=0), GOOD_PROMPT], "bad_request", "num_samples"),
    "unknown lora": ([gen("r-lora", lora="nope"), GOOD_PROMPT], "bad_request", "lora"),
    "not a request": ([msgspec.msgpack.encode(P.Chunk(request_id="x"))], "protocol", "kind"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gets_a_typed_error_and_the_node_keeps_serving(raw, case):
    frames, code, field = CASES[case]
    msg, _ = ask(raw, frames)
    assert isinstance(msg, P.Error), msg
    assert (msg.code, msg.field) == (code, field), msg
    assert msg.message
    assert_still_serving(raw)


def test_error_carries_the_request_id(raw):
    msg, _ = ask(raw, [gen("named-rid", params=P.SamplingParams(max_tokens=0)), GOOD_PROMPT])
    assert msg.request_id == "named-rid"


def test_duplicate_request_id_in_flight_is_refused(raw):
    p = P.SamplingParams(max_tokens=200, ignore_eos=True)
    raw.send_multipart([gen("dup", params=p), GOOD_PROMPT])
    raw.send_multipart([gen("dup", params=p), GOOD_PROMPT])
    errors, finals = [], 0
    while finals < 1:
        whole, bufs = Codec().decode(raw.recv_multipart())
        for msg, _ in split_chunks(whole, bufs):
            if isinstance(msg, P.Error):
                errors.append(msg)
            elif msg.finish_reason is not None:
                finals += 1
    assert [(e.code, e.field) for e in errors] == [("bad_request", "request_id")]
