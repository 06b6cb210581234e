"""The sync `Client` is generated from `AsyncClient` (trainer_bridge/blocking.py),
not hand-mirrored: every public method of AsyncClient exists on Client with the
same parameters and docstring, and the generated methods keep the async
method's behaviour across the thread boundary (deadlines, errors, early exit
of an iterator). The helpers are tested on a small async object, without
sockets; the Client itself runs against real clusters in the other tests."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator

import pytest

from bus.errors import BadRequest, RequestTimeout
from trainer_bridge import AsyncClient, Client
from trainer_bridge import blocking as B

# Where the sync face returns something else than the awaited value: its sync form.
SYNC_RETURNS = {
    "stream": "Iterator[StreamChunk]",
    "paused": "Iterator[Client]",
    "weight_update": "SyncWeightUpdate",
    "weight_sender": "SyncWeightSender",
}


def public_methods(cls: type) -> dict[str, object]:
    return {
        n: getattr(cls, n)
        for n in dir(cls)
        if not n.startswith("_")
        and callable(getattr(cls, n))
        and not isinstance(inspect.getattr_static(cls, n), property)
    }


def test_client_has_every_public_method_of_async_client_with_its_signature():
    amethods, smethods = public_methods(AsyncClient), public_methods(Client)
    assert set(amethods) == set(smethods), set(amethods) ^ set(smethods)
    for name in [*amethods, "__init__"]:
        a, s = inspect.signature(getattr(AsyncClient, name)), inspect.signature(getattr(Client, name))
        assert list(a.parameters.values()) == list(s.parameters.values()), name
        want = SYNC_RETURNS.get(name, a.return_annotation)
        assert s.return_annotation == want, (name, s.return_annotation)
        assert inspect.getdoc(getattr(Client, name)), f"Client.{name} has no docstring"


def test_generated_methods_carry_the_async_docs_and_their_own_names():
    for name in ("generate", "stream", "pause", "update_weights", "weight_sender", "weight_update"):
        fn = getattr(Client, name)
        assert not inspect.iscoroutinefunction(fn) and not inspect.isasyncgenfunction(fn)
        adoc = getattr(AsyncClient, name).__doc__
        if name in SYNC_RETURNS:  # the async doc, then what the sync face hands back
            assert fn.__doc__.startswith(adoc) and SYNC_RETURNS[name] in fn.__doc__[len(adoc) :]
        else:
            assert fn.__doc__ == adoc
        assert fn.__qualname__ == f"Client.{name}" and fn.__module__ == Client.__module__


class Engine:
    """What a face needs of its async object, with observable side effects."""

    timeout_s = 5.0
    control_timeout_s = 5.0

    def __init__(self) -> None:
        self.closed_streams = 0
        self.started = 0

    async def echo(self, x: int, *, timeout_s: float | None = None) -> tuple[int, bool]:
        """Echo."""
        return x, asyncio.get_running_loop() is not None

    async def slow(self, *, timeout_s: float | None = None) -> None:
        await asyncio.sleep(60)

    async def fail(self) -> None:
        raise BadRequest("nope", field="x")

    async def count(self, n: int, *, timeout_s: float | None = None) -> AsyncIterator[int]:
        self.started += 1
        try:
            for i in range(n):
                yield i
                await asyncio.sleep(0)
        finally:
            self.closed_streams += 1

    async def close(self) -> None:
        pass


class Face(B.BlockingFace):
    echo = B.blocking(Engine.echo)
    slow = B.blocking(Engine.slow)
    fail = B.blocking(Engine.fail)
    count = B.blocking_iter(Engine.count)


@pytest.fixture
def face():
    f = Face(Engine(), "test-face")
    yield f
    f.close()
    assert not f._thread.is_alive()


def test_a_generated_method_runs_on_the_loop_thread_and_raises_typed_errors(face):
    assert face.echo(3) == (3, True)
    with pytest.raises(BadRequest) as e:
        face.fail()
    assert e.value.field == "x"
    with pytest.raises(TypeError):
        face.echo()  # type: ignore[call-arg]


def test_the_outer_guard_names_timeout_s(face, monkeypatch):
    monkeypatch.setattr(B, "_SLACK_S", 0.2)
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout) as e:
        face.slow(timeout_s=0.1)  # the call's own timeout_s bounds the guard
    assert e.value.field == "timeout_s" and time.monotonic() - t0 < 5


def test_an_iterator_is_lazy_and_an_early_stop_closes_the_async_one(face):
    it = face.count(100)
    time.sleep(0.1)
    assert face._aclient.started == 0  # nothing runs before the first next()
    assert [next(it), next(it)] == [0, 1]
    it.close()
    deadline = time.monotonic() + 5
    while face._aclient.closed_streams == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert face._aclient.closed_streams == 1
    assert list(face.count(3)) == [0, 1, 2]


class _KeptLink:
    """A GPU link whose buffers must outlive the coordinator's commit round (cuda_ipc)."""

    keeps_buffers = True
    transport = "cuda_ipc"

    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True


class _HeadWithAnOpenUpdate:
    """The one query a sender's exit makes: the head's decisions, open until `closed`."""

    timeout_s = control_timeout_s = 5.0

    def __init__(self, update_id: str) -> None:
        self.update_id, self.queries, self.closed = update_id, 0, False

    async def _query(self, kind: str, view: type) -> object:
        from bus.views import DecisionsView

        self.queries += 1
        if self.queries >= 3:  # the coordinator's commit round ends meanwhile
            self.closed = True
        return DecisionsView(decisions={} if self.closed else {self.update_id: "commit"})

    async def close(self) -> None:
        return None


def test_sync_weight_sender_keeps_kept_buffers_until_the_commit_round_is_over():
    # Leaving `with client.weight_sender(...)` over cuda_ipc must wait for the
    # coordinator's commit round before freeing the rank's buckets; freed early,
    # the engines' commit fails with "CUDA error: invalid resource handle"
    # (tests/gpu/test_vllm_multi_sender.py[cuda_ipc], run 52).
    from trainer_bridge.sync_client import SyncWeightSender
    from trainer_bridge.transports.gpu import GpuSender

    head = _HeadWithAnOpenUpdate("u1")
    sender = GpuSender(
        type(_KeptLink()), head, "u1", 1, [], bucket_bytes=1 << 20, timeout_s=5.0, cast=lambda t: t, options={}
    )
    link = sender._link = _KeptLink()
    face = B.BlockingFace(head, "test-sync-sender")
    try:
        with SyncWeightSender(face, sender):
            pass
        assert link.released and head.closed and head.queries >= 3
    finally:
        face._finalizer()
