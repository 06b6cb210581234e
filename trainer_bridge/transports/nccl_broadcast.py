"""The nccl sender's broadcast of one update: check-in, then every bucket,
packing overlapped with broadcasting.

    launch the packs of buckets 0 and 1 (pack stream, two kept buffers)
    wait until every engine worker checked in (NcclArgs.check_in) — or the op
      carrying the update failed first: then nothing is broadcast
    connect (first update of a group only)
    for each bucket k: the broadcast stream waits for k's pack, broadcasts it,
      and the pack of k + 2 is launched into the buffer k's broadcast frees

A bucket that is one whole contiguous tensor on the sender's device (an
embedding, lm_head: larger than a bucket) is broadcast from that tensor's own
storage, not packed. Packing runs on its own CUDA stream, ordered after the
trainer's writes (the pack stream waits for the current stream first), so
the pack of bucket k + 1 runs on the GPU while bucket k is on the wire; a
pack buffer is reused only after an event says its broadcast finished.

Hazards this module owns:
- the check-in comes BEFORE anything collective (the group's set-up too):
  an op refused by the head, a node or a backend never reaches the receive,
  and a sender that broadcast anyway would block inside NCCL until its
  timeout with a group nobody can use again;
- the two pack buffers are the sender's (kept across updates, freed with it);
  streams and events are used only on CUDA (a CPU "device" runs the same
  order synchronously: the CPU tests).

torch is imported lazily.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from trainer_bridge.transports.packing import by_bucket, direct_source, pack_fast

CHECK_IN_POLL_S = 0.0002

log = structlog.get_logger("trainer_bridge.transports.nccl_broadcast")


class NotCheckedIn(Exception):
    """The op failed before every engine worker entered its receive: nothing was broadcast."""


def check_in_key(token: str) -> str:
    return f"rollout_bus/in/{token}"


def verdict_key(token: str) -> str:
    """b"ok", or the name of the first tensor with a NaN / inf (NcclArgs.verdict)."""
    return f"rollout_bus/ok/{token}"


def go_key(token: str) -> str:
    """b"1": broadcast; b"0": the trainer will not (the op failed elsewhere)."""
    return f"rollout_bus/go/{token}"


def forget_token(store: Any, token: str) -> None:
    """Delete one op's keys from the sender's store once every engine has
    acked it (every worker read its go and verdict): a long run would
    otherwise keep three keys per update for the sender's life. Never before
    the acks: a worker still waiting for its go would wait out its timeout."""
    for key in (check_in_key(token), go_key(token), verdict_key(token)):
        try:
            store.delete_key(key)
        except RuntimeError as e:  # the store is gone (sender closed): nothing left to free
            log.debug("nccl_store_key_not_deleted", key=key, error=repr(e))


def wait_check_in(store: Any, token: str, workers: int, stop: threading.Event | None, timeout_s: float) -> float:
    """Block until `workers` engine workers added 1 under the token's key,
    then tell them to go. NotCheckedIn once `stop` is set (the op failed);
    TimeoutError naming nccl_timeout_s. Either way the workers that checked
    in are told not to wait for a broadcast (their receive fails, their
    update is dropped, old weights kept). Returns the seconds waited."""
    t0 = time.perf_counter()
    end = t0 + timeout_s
    key = check_in_key(token)
    try:
        while int(store.add(key, 0)) < workers:
            if stop is not None and stop.is_set():
                raise NotCheckedIn(f"the op failed before every engine worker entered its receive ({key})")
            if time.perf_counter() > end:
                raise TimeoutError(
                    f"nccl: {int(store.add(key, 0))} of {workers} engine worker(s) entered the receive within "
                    f"nccl_timeout_s={timeout_s}"
                )
            time.sleep(CHECK_IN_POLL_S)
    except BaseException:
        store.set(go_key(token), b"0")
        raise
    store.set(go_key(token), b"1")
    return time.perf_counter() - t0


class Streams:
    """The broadcast (current) stream and the pack stream of a CUDA device;
    on a CPU device everything runs in order and events are None."""

    def __init__(self, device: Any, pack_stream: Any) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.main = torch.cuda.current_stream(device) if self.cuda else None
        self.pack = pack_stream
        if self.cuda:
            self.pack.wait_stream(self.main)  # the packs read what the trainer wrote so far

    def on_pack(self) -> Any:
        import torch

        return torch.cuda.stream(self.pack) if self.cuda else contextlib.nullcontext()

    def record(self, stream: Any) -> Any:
        import torch

        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream: Any, ev: Any) -> None:
        if ev is not None:
            stream.wait_event(ev)


class Broadcast:
    """One update's buckets, broadcast in order with packing overlapped."""

    def __init__(self, sender: Any, metas: list[Any], sizes: list[int], tensors: list[Any]) -> None:
        self.s = sender
        self.sizes = sizes
        dev = sender.device
        self.parts = by_bucket(metas, tensors, len(sizes))
        self.direct = [direct_source(ms, ts, sizes[i], dev) for i, (ms, ts) in enumerate(self.parts)]
        self.st = Streams(dev, sender.pack_stream())
        self.bufs = sender.pack_buffers(max([n for n, d in zip(sizes, self.direct, strict=True) if d is None] or [0]))
        self.packed: list[Any] = [None] * len(sizes)
        self.freed: list[Any] = [None, None]  # per buffer: the event after its last broadcast
        self.pack_s = 0.0

    def launch_pack(self, i: int) -> None:
        if i >= len(self.sizes) or self.direct[i] is not None:
            return
        t0 = time.perf_counter()
        slot = i % 2
        self.st.wait(self.st.pack, self.freed[slot])
        with self.st.on_pack():
            ms, ts = self.parts[i]
            pack_fast(i, ms, self.sizes, ts, self.s.device, out=self.bufs[slot])
            self.packed[i] = self.st.record(self.st.pack)
        self.pack_s += time.perf_counter() - t0

    def source(self, i: int) -> Any:
        d = self.direct[i]
        return d if d is not None else self.bufs[i % 2][: self.sizes[i]]

    def run(self, comm: Any) -> None:
        """Broadcast every bucket (the packs of buckets 0 and 1 are launched already)."""
        for i in range(len(self.sizes)):
            if self.direct[i] is None and self.st.cuda:
                self.st.wait(self.st.main, self.packed[i])
            comm.broadcast(self.source(i), src=0)
            if self.direct[i] is None:
                self.freed[i % 2] = self.st.record(self.st.main)
            self.launch_pack(i + 2)


def send_update(
    sender: Any,
    metas: list[Any],
    sizes: list[int],
    tensors: list[Any],
    check_in: str = "",
    stop: threading.Event | None = None,
    check: Callable[[], Callable[[], str | None]] | None = None,
) -> dict[str, float]:
    """The whole broadcast of one update (see the module doc); where its time
    went. `check` (with `check_in`): launches the NaN/inf check (here, after
    the op is out: its ~339 launches at 7B are not on the way to the
    engines) on a stream beside the broadcast; its result is waited for once
    every broadcast is launched, and put in the store for the engine workers
    (`sender.last_verdict`: the bad tensor's name)."""
    import torch

    t0 = time.perf_counter()
    dev = sender.device
    sender.last_verdict = None
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        b = Broadcast(sender, metas, sizes, tensors)
        b.launch_pack(0)
        b.launch_pack(1)
        verdict = check() if check is not None and check_in else None
        t1 = time.perf_counter()
        waited = 0.0
        if check_in:
            waited = wait_check_in(sender.store, check_in, sender.world_size - 1, stop, sender.timeout_s)
        t2 = time.perf_counter()
        told = verdict is None or not check_in
        try:
            sender.connect()
            t3 = time.perf_counter()
            b.run(sender.comm)
            t4 = time.perf_counter()
            if not told:
                assert verdict is not None
                bad = sender.last_verdict = verdict()
                sender.store.set(verdict_key(check_in), b"ok" if bad is None else bad.encode())
                told = True
            t5 = time.perf_counter()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        finally:
            if not told:  # the workers must not wait for a verdict that never comes
                sender.store.set(verdict_key(check_in), b"<the trainer's send failed>")
    t6 = time.perf_counter()
    sender.last_send_info = {"buckets": len(sizes), "direct_buckets": sum(d is not None for d in b.direct)}
    return {
        "prepare_s": round(t1 - t0, 4),  # the first two packs and the NaN/inf check launched
        "check_in_s": round(waited, 4),
        "connect_s": round(t3 - t2, 4),
        "launch_s": round(t4 - t3, 4),  # broadcasts + the other packs launched
        "pack_launch_s": round(b.pack_s, 4),
        "verdict_s": round(t5 - t4, 4),  # the NaN/inf check's wait (it ran beside the broadcast)
        "sync_s": round(t6 - t5, 4),
        "send_s": round(t6 - t2, 4),  # from the last check-in to every byte sent
    }
