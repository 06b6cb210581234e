"""Issue 34 row 16: `Client.generate` takes any batch, as `LLM.generate` does.

The head caps a client's requests in flight (--max-inflight-per-client); the
client learns the cap from the head's pongs and paces its submissions under
it (trainer_bridge/pacing.py), absorbing a refusal at the cap by sending that
request again once a slot frees. A batch that fails cancels what it sent:
nothing runs on behind it. On fe0cb18 a batch past the cap failed with
LimitExceeded and the admitted requests ran on.

Real head and a paced null engine over IPC; the cap is 40 to keep it cheap.
"""

from __future__ import annotations

import time

import pytest
import zmq

from bus import protocol as P
from bus.codec import Codec
from bus.errors import BadRequest
from bus.frames import pack_tokens
from bus.roles import Plain
from tests.cluster import Cluster, wait_until

pytestmark = pytest.mark.timeout(120)

CAP = 40


def _past_the_cap(frontend: str, cred: Plain) -> P.Error:
    """A raw peer (no pacing) sends CAP + 1 long requests: the head's refusal."""
    codec = Codec()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 5000)  # a peer the head never admitted must not block the clean-up
    cred.apply(s, None)  # the handshake's client credential (bus/roles.py), as a real client's
    s.connect(frontend)
    try:
        params = P.SamplingParams(max_tokens=400, ignore_eos=True)
        for i in range(CAP + 1):
            s.send_multipart(codec.encode(P.Generate(request_id=f"r{i}", params=params), [pack_tokens([4, 5, 6])]))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if s.poll(500):
                msg, _ = codec.decode(s.recv_multipart())
                if isinstance(msg, P.Error):
                    return msg
        raise AssertionError("the head never refused the request past the cap")
    finally:
        for i in range(CAP + 1):
            s.send_multipart(codec.encode(P.Cancel(request_id=f"r{i}")))
        s.close(linger=0)
        ctx.term()


def test_a_batch_larger_than_the_cap_completes_and_a_failed_batch_leaves_nothing_running():
    with Cluster(
        1,
        backend="null",
        model="null",
        backend_options={"tokens_per_step": 1, "step_delay_s": 0.002, "capacity": 4096},
        router_args=["--max-inflight-per-client", str(CAP)],
    ) as cl:
        c = cl.client(timeout_s=90)
        c.wait_ready(1, 60)
        prompts = [[4, 5, i % 1000 + 10] for i in range(400)]  # 10x the cap
        out = c.generate(prompts, {"max_tokens": 8, "ignore_eos": True})
        assert [r.token_ids for r in out] == [[(p[-1] + 1 + j) % 32000 for j in range(8)] for p in prompts]
        assert all(r.finish_reason == "length" for r in out)
        gate = c._aclient.inflight
        assert gate.cap == CAP and gate.learned and gate.inflight == 0  # learned from the head's pongs

        # The head still refuses a peer past its cap, naming the field.
        err = _past_the_cap(cl.frontend, cl.credential())
        assert err.code == "limit_exceeded" and err.field == "max_inflight_per_client", err
        assert "max_inflight_per_client" in err.message and str(CAP) in err.message

        # A failed batch cancels what it sent: nothing of it runs on.
        t0 = time.monotonic()
        with pytest.raises(BadRequest):
            c.generate([[4, 5, 6]] * 30 + [[4, 5, 10**6]], {"max_tokens": 2000, "ignore_eos": True})
        wait_until(lambda: c.stats()["in_flight"] == 0, 5, "the failed batch's requests to end")
        assert time.monotonic() - t0 < 4.0  # 2000 paced tokens take > 4 s: they were cancelled, not finished
        assert len(c.generate([[4, 5, 6]] * 3, {"max_tokens": 3})) == 3
