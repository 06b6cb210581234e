"""Issue 34 row 13: a stalled head and a dead head are told apart by the client.

The client watches its connection (a zmq socket monitor): a head stopped
(SIGSTOP) for 5 s under 8 streams keeps its connection, so the client waits
up to `head_stall_timeout_s` (30 s) and every stream completes once it is
continued; a head killed (-9) drops the connection, and the client reports
HeadUnavailable within `head_timeout_s` (2 s). On fe0cb18 the stopped head
cost 8 of 8 streams (HeadUnavailable after 2 s).

Real head and null engines (paced: one token per 5 ms step) over IPC.
"""

from __future__ import annotations

import signal
import time

import pytest

from bus.errors import HeadUnavailable
from tests.cluster import Cluster, Streams, wait_until

pytestmark = pytest.mark.timeout(120)

PACED = {"tokens_per_step": 1, "step_delay_s": 0.005}
N_TOKENS = 800


def test_a_stopped_head_loses_no_stream_and_a_killed_one_is_reported_in_head_timeout():
    with Cluster(2, backend="null", model="null", backend_options=PACED, heartbeat_interval_s=0.3) as cl:
        cl.wait_ready(2)
        c = cl.client(timeout_s=90)  # head_timeout_s 2.0, head_stall_timeout_s 30 (the defaults)
        params = {"max_tokens": N_TOKENS, "ignore_eos": True}
        streams = Streams(c, [[3, 1, 4, i] for i in range(8)], params)
        wait_until(lambda: all(n >= 20 for n in streams.counts()), 60, "every stream's first tokens")
        cl.kill("head", signal.SIGSTOP)
        time.sleep(5.0)
        cl.kill("head", signal.SIGCONT)
        streams.join(90)
        assert streams.counts() == [N_TOKENS] * 8
        assert all(s[-1].finish_reason == "length" for s in streams.chunks)

        streams = Streams(c, [[3, 1, 4, i] for i in range(4)], params)
        wait_until(lambda: all(n >= 20 for n in streams.counts()), 60, "every stream's first tokens")
        t0 = time.monotonic()
        cl.kill("head")
        for t in streams.threads:
            t.join(30)
        took = time.monotonic() - t0
        assert all(isinstance(e, HeadUnavailable) and e.field == "head_timeout_s" for e in streams.errors), (
            streams.errors
        )
        # head_timeout_s (2 s) plus a ping interval (0.5 s) of judging, and slack for a loaded CI machine.
        assert took < 5.0, took
