"""Issue 34 row 1, the other half: the head's data connection to an engine
breaks while requests stream on it (a network blip: here a TCP proxy between
the head and the engine cuts every connection). zmq reconnects, but does not
resend: chunks that were in flight are gone, and the engine ends what it could
not send to the head (engine_node/node.py `_data_peer_gone`). The head sees
its connection drop (router_node/data_links.py) and moves every leg that was
there, from the tokens it relayed: each stream ends whole. Before, those
streams lost tokens or waited for their timeout."""

from __future__ import annotations

import selectors
import socket
import threading
import time

import pytest

from tests.cluster import wait_until

NULL = {"backend": "null", "backend_options": {"tokens_per_step": 1, "step_delay_s": 0.03}}
MAX_TOKENS = 120  # 3.6 s a stream: the cut lands in the middle


class CuttingProxy:
    """A TCP forwarder (fault injection) whose `cut()` closes every open
    connection, both sides, while it keeps accepting new ones."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.server = socket.create_server(listen)
        self.server.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.server, selectors.EVENT_READ, None)
        self.pairs: dict[socket.socket, socket.socket] = {}
        self.cuts = 0
        self._cut = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._cut.is_set():
                self._close_pairs()
                self.cuts += 1
                self._cut.clear()
            for key, _ in self.sel.select(0.02):
                if key.data is None:
                    self._accept()
                else:
                    self._pump(key.fileobj, key.data)  # type: ignore[arg-type]
        self._close_pairs()
        self.server.close()

    def _accept(self) -> None:
        down, _ = self.server.accept()
        up = socket.create_connection(self.upstream)
        for a, b in ((down, up), (up, down)):
            a.setblocking(False)
            self.pairs[a] = b
            self.sel.register(a, selectors.EVENT_READ, b)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            data = src.recv(1 << 16)
            if data:
                dst.setblocking(True)
                dst.sendall(data)
                dst.setblocking(False)
                return
        except OSError:
            pass  # a reset: the pair ends below
        self._close(src)

    def _close(self, s: socket.socket) -> None:
        other = self.pairs.pop(s, None)
        for x in (s, other):
            if x is not None:
                self.pairs.pop(x, None)
                if x.fileno() >= 0:
                    self.sel.unregister(x)
                x.close()

    def _close_pairs(self) -> None:
        for s in list(self.pairs):
            if s in self.pairs:
                self._close(s)

    def cut(self) -> None:
        self._cut.set()
        wait_until(lambda: not self._cut.is_set(), 5, "the proxy's cut")

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)


@pytest.mark.timeout(90)
def test_a_dropped_head_engine_connection_moves_its_legs_and_loses_no_token(cluster_factory):
    cl = cluster_factory(1, tcp=True, **NULL)
    # e1 binds 127.0.0.1:P and tells the head 127.0.0.2:P, where the proxy listens.
    cl.start_engine("e1", extra=["--advertise-host", "127.0.0.2"])
    c = cl.client(timeout_s=40, connect_timeout_s=30)  # the head may still be starting
    wait_until(lambda: any(e["engine_id"] == "e1" for e in c.engines()), 30, "e1 registered")
    (e1,) = [e for e in c.engines() if e["engine_id"] == "e1"]
    port = int(e1["data_address"].rsplit(":", 1)[1])
    proxy = CuttingProxy(("127.0.0.2", port), ("127.0.0.1", port))
    try:
        cl.wait_ready(2)
        results: dict[int, object] = {}

        def stream(i: int) -> None:
            try:
                chunks = list(c.stream([7, i, 9], {"max_tokens": MAX_TOKENS, "ignore_eos": True}))
                results[i] = chunks
            except Exception as e:  # handed to the asserts
                results[i] = e

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        wait_until(lambda: c.health()["engines"]["e1"]["running"] > 0, 20, "streams running on e1")
        time.sleep(0.5)
        proxy.cut()
        for t in threads:
            t.join(60)
    finally:
        proxy.close()
    assert proxy.cuts == 1
    for i in range(8):
        chunks = results.get(i)
        assert isinstance(chunks, list), (i, chunks)
        tokens = [x for ch in chunks for x in ch.token_ids]
        finals = [ch for ch in chunks if ch.finish_reason]
        assert len(tokens) == MAX_TOKENS and len(finals) == 1 and finals[0].finish_reason == "length", (i, len(tokens))
    counters = c.stats()["counters"]
    assert counters["data_links_dropped"] >= 1 and counters["failovers"] >= 1, counters
