"""Issue 34 row 9: what one request makes the head and an engine hold.

Both keep every sample's tokens so far (the head for failover, the engine for
park / re-submission), so a request's memory is n x (prompt + max_tokens):
- past --max-request-tokens (head and engine, default 2**23) it is refused at
  once with a BadRequest naming the knob (field "max_request_tokens");
- inside it, the tokens are held packed (int32 arrays, 4 bytes a token) and
  the null engine's "all at once" steps are bounded, so 4 x 2**20 streamed
  tokens grow neither process by more than a few tens of MB (fe0cb18: the
  engine grew 230 MB for this request, 780 MB for n=16, which it then admitted).

Real head and engine processes (null backend), RSS sampled every 20 ms.
"""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from bus.errors import BadRequest
from tests.cluster import Cluster

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 2**20 - 8  # the null engine's max_model_len is 2**20


class PeakRss:
    """Peak RSS growth (MB) of each process while the block runs."""

    def __init__(self, procs: dict) -> None:
        self.procs = {k: psutil.Process(p.pid) for k, p in procs.items()}
        self.base = {k: p.memory_info().rss for k, p in self.procs.items()}
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for k, p in self.procs.items():
                self.peak[k] = max(self.peak[k], p.memory_info().rss)
            time.sleep(0.02)

    def __enter__(self) -> PeakRss:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(5)

    def growth_mb(self) -> dict[str, float]:
        return {k: (self.peak[k] - self.base[k]) / 2**20 for k in self.procs}


def test_a_huge_in_budget_request_streams_through_in_bounded_memory():
    with Cluster(1, backend="null", model="null", heartbeat_interval_s=0.5) as cl:
        c = cl.client(timeout_s=120)
        c.wait_ready(1, 60)
        c.generate([4, 5, 6], {"max_tokens": 3})  # warm both processes
        n = 4
        with PeakRss(cl.procs) as rss:
            got = [0] * n
            finishes = {}
            for ch in c.stream([4, 5, 6], {"max_tokens": MAX_TOKENS, "n": n, "ignore_eos": True}):
                got[ch.sample_index] += len(ch.token_ids)
                if ch.finish_reason is not None:
                    finishes[ch.sample_index] = ch.finish_reason
        assert got == [MAX_TOKENS] * n and finishes == dict.fromkeys(range(n), "length")
        growth = rss.growth_mb()
        # 4 x 2**20 tokens are 16 MB as int32: a hop may hold them once plus a
        # step's worth in flight, never a Python list of them (~36 bytes a token).
        assert growth["e0"] < 100, growth
        assert growth["head"] < 100, growth


def test_past_the_budget_is_refused_by_the_head_and_by_an_engine_naming_the_knob():
    with Cluster(
        1,
        backend="null",
        model="null",
        router_args=["--max-request-tokens", "10000"],
        engine_args=["--max-request-tokens", "5000"],
    ) as cl:
        c = cl.client()
        c.wait_ready(1, 60)
        with pytest.raises(BadRequest) as e:
            c.generate([4, 5, 6], {"max_tokens": MAX_TOKENS, "n": 16, "ignore_eos": True})
        assert e.value.field == "max_request_tokens" and "head's --max-request-tokens" in e.value.message
        # Inside the head's budget, past the engine's: the engine refuses it the same way.
        with pytest.raises(BadRequest) as e:
            c.generate([4, 5, 6], {"max_tokens": 3000, "n": 2})
        assert e.value.field == "max_request_tokens" and "engine e0's --max-request-tokens" in e.value.message
        # n x (prompt + max_tokens) inside both: served, and the node still serves.
        r = c.generate([4, 5, 6], {"max_tokens": 1000, "n": 4})
        assert [len(s.token_ids) for s in r.samples] == [1000] * 4
        assert c.health()["healthy"]
