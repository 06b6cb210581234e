"""Issue 22, "no poison pill": one request or one update must not kill a
process, and a request that kills engines anyway (a model bug we cannot see
from its fields) reaches at most one more engine before it ends, typed.

Real head, real engines, loopback/IPC; each cluster is small and torn down
(and leak-checked) by the fixtures.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq

from bus import protocol as P
from bus.codec import Codec
from bus.errors import EngineDead, RolloutBusError
from bus.frames import pack_tokens
from tests.cluster import wait_until
from tests.poison_backend import POISON_PREFIX

pytestmark = pytest.mark.timeout(180)


def _alive(cl) -> dict[str, bool]:
    return {k: p.poll() is None for k, p in cl.procs.items()}


def _serves(cl) -> None:
    r = cl.client().generate([1, 2, 3], {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
    assert len(r.token_ids) == 3


def _raw_generate(cl, msg: P.Generate, prompt: list[int]) -> object:
    """Send one Generate over a raw DEALER (the fields the Client would never
    build) and return the first reply the head sends back."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        cl.credential().apply(s, None)  # a token holder: past the handshake
        s.connect(cl.frontend)
        s.send_multipart(Codec().encode(msg, [pack_tokens(prompt)]))
        assert s.poll(30_000), "the head must answer"
        frames = s.recv_multipart()
        return Codec().decode(frames)[0]
    finally:
        s.close(linger=0)


@pytest.mark.parametrize("offset, n", [(2**64 - 1, 2), (2**63, 1), (-1, 1)])
def test_a_sample_offset_past_64_bits_is_refused_at_the_decoder_and_kills_no_engine(torch_cluster, offset, n):
    cl = torch_cluster
    msg = P.Generate(
        request_id="poison",
        params=P.SamplingParams(max_tokens=2, temperature=0.0),
        num_samples=n,
        sample_offset=offset,
    )
    reply = _raw_generate(cl, msg, [1, 2, 3])
    assert isinstance(reply, P.Error), reply
    assert reply.code == "bad_request" and reply.field == "sample_offset", reply
    time.sleep(1.0)  # an engine that got it would be dead by now
    assert all(_alive(cl).values()), _alive(cl)
    _serves(cl)


def _weights(tiny_model: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + torch.randn(p.shape, generator=g) * 0.01) for n, p in m.named_parameters()]


def test_an_update_version_past_2_53_is_refused_and_the_next_update_lands(torch_cluster, tiny_model):
    cl = torch_cluster
    c = cl.client()
    named = _weights(tiny_model, 1)
    with pytest.raises(RolloutBusError) as ei:
        with c.weight_update(version=2**64 - 1, timeout_s=20) as upd:
            upd.sender(0).send(named)
    assert ei.value.field == "op.version", repr(ei.value)  # the FinishWeightUpdate inside the Control
    before = c.health()["weight_version"]
    assert before < 2**53
    res = c.update_weights(named)  # the head crashed here in the same encode
    assert {r["weight_version"] for r in res.values()} == {before + 1}, res
    assert all(_alive(cl).values()), _alive(cl)
    _serves(cl)


def test_a_request_that_kills_engines_is_failed_over_once_then_ends_typed(cluster_factory):
    # The head's failover bound: the poison wraps null engines (no model to load in each).
    cl = cluster_factory(3, backend="tests.poison_backend:factory", model="null", backend_options={"inner": "null"})
    cl.wait_ready(3)
    c = cl.client(timeout_s=60)
    with pytest.raises(EngineDead) as ei:
        c.generate([*POISON_PREFIX, 1, 2], {"max_tokens": 4})
    rid = ei.value.request_id
    assert rid and rid in ei.value.message and "--max-engine-deaths" in ei.value.message, str(ei.value)
    # The head hears a death when the dying process's sockets close, a moment
    # before the kernel reaps it (poll() still says alive): wait for the exit.
    dead: list[str] = []

    def two_gone() -> bool:
        dead[:] = [k for k, ok in _alive(cl).items() if not ok]
        return len(dead) >= 2

    wait_until(two_gone, 10, f"two engine processes to exit ({ei.value.message})")
    time.sleep(0.5)  # a third death would follow at once: give it the chance to show
    dead = [k for k, ok in _alive(cl).items() if not ok]
    assert len(dead) == 2 and "head" not in dead, (dead, str(ei.value))  # the first and one failover, no third
    wait_until(lambda: c.health()["healthy"], 20, "the third engine to serve")
    _serves(cl)


def test_the_decoder_refusal_names_the_field_over_the_wire(torch_cluster):
    """A raw Generate with a 64 KB session id: refused by the head's decoder,
    the error names the field and echoes at most 1 KB of it."""
    cl = torch_cluster
    msg = P.Generate(request_id="long", params=P.SamplingParams(max_tokens=2), session_id="s" * 65536)
    reply = _raw_generate(cl, msg, [1, 2, 3])
    assert isinstance(reply, P.Error) and reply.field == "session_id", reply
    assert len(msgspec.msgpack.encode(reply)) <= 2048, len(msgspec.msgpack.encode(reply))
    _serves(cl)
