"""The synchronous face of an asyncio object, generated rather than mirrored.

A `BlockingFace` owns a private event loop on a daemon thread and the async
object living on it (`_aclient`); every coroutine of that object runs there,
so the face is safe to call from any thread. Its methods are made from the
async ones:

    class Client(BlockingFace):
        generate = blocking(AsyncClient.generate)         # awaits on the loop
        stream = blocking_iter(AsyncClient.stream)        # async iterator -> iterator
        weight_sender = blocking(AsyncClient.weight_sender, wrap=SyncWeightSender)

The generated function keeps the async method's name, docstring and
signature (`functools.wraps`, so `help()` and `inspect.signature` show it;
ParamSpec, so mypy checks the arguments). It looks the method up on the
async object by name, so a subclass's override is the one that runs.

Deadlines: each coroutine has its own; the outer wait here only guards a
wedged loop: the call's `timeout_s` (or the client's larger default) + 30 s.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

import structlog

from bus.errors import RequestTimeout

log = structlog.get_logger("trainer_bridge.blocking")

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
W = TypeVar("W")

_END = object()
_SLACK_S = 30.0  # the outer guard's margin over the coroutine's own deadline


class BlockingFace:
    """Runs `_aclient` (an object with async methods, `timeout_s`,
    `control_timeout_s` and `async close()`) on a private loop thread."""

    _aclient: Any

    def __init__(self, aclient: Any, thread_name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=thread_name, daemon=True)
        self._thread.start()
        self._aclient = aclient
        self._finalizer = weakref.finalize(self, _close_loop, self._loop, self._thread, aclient)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        # Generated methods carry the async method's qualname: name them here.
        for name, v in vars(cls).items():
            if getattr(v, "__blocking__", False):
                v.__qualname__ = f"{cls.__qualname__}.{name}"
                v.__module__ = cls.__module__

    def _call(self, coro: Any, timeout_s: float | None = None) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        # The coroutine has its own deadline; this outer one only guards a wedged loop.
        limit = (timeout_s or max(self._aclient.timeout_s, self._aclient.control_timeout_s)) + _SLACK_S
        try:
            return fut.result(limit)
        except TimeoutError:
            fut.cancel()
            raise RequestTimeout(
                f"client call did not return within {limit}s (timeout_s + 30)", field="timeout_s"
            ) from None

    def _pump(self, agen: AsyncIterator[T], timeout_s: float | None) -> Iterator[T]:
        """Iterate `agen` on the loop, handing its items to this thread."""
        q: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                async for item in agen:
                    q.put(item)
                q.put(_END)
            except BaseException as e:  # handed to the consumer thread
                q.put(e)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        limit = (timeout_s or self._aclient.timeout_s) + _SLACK_S
        try:
            while True:
                item = q.get(timeout=limit)
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        except queue.Empty:
            raise RequestTimeout(f"stream stalled for {limit}s (timeout_s + 30)", field="timeout_s") from None
        finally:
            # The consumer stopped early: cancelling the pump closes the async
            # iterator on its loop (which cancels the request).
            if not fut.done():
                fut.cancel()

    def close(self) -> None:
        """Close the async client and stop the loop thread (idempotent)."""
        self._finalizer()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _timeout_reader(fn: Callable[..., Any]) -> Callable[[tuple[Any, ...], dict[str, Any]], float | None]:
    """How to find the call's `timeout_s` (bound as the method would bind it)."""
    sig = inspect.signature(fn)
    if "timeout_s" not in sig.parameters:
        return lambda args, kwargs: None

    def read(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
        bound = sig.bind(None, *args, **kwargs)
        bound.apply_defaults()
        return bound.arguments["timeout_s"]

    return read


def _mark(call: Callable[..., Any], fn: Callable[..., Any], returns: str | None = None) -> None:
    call.__blocking__ = True  # type: ignore[attr-defined]
    if returns is not None:  # what the sync face returns, for help() and inspect
        call.__signature__ = inspect.signature(fn).replace(return_annotation=returns)  # type: ignore[attr-defined]
        call.__doc__ = f"{fn.__doc__ or ''}\n\nSync face: returns {returns} (`with`, `for`, no `await`)."


def blocking(fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]) -> Callable[Concatenate[Any, P], R]:
    """The sync method that runs async method `fn` on the face's loop."""
    name, timeout_of = fn.__name__, _timeout_reader(fn)

    @functools.wraps(fn)
    def call(self: BlockingFace, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._call(getattr(self._aclient, name)(*args, **kwargs), timeout_of(args, kwargs))

    _mark(call, fn)
    return call


def blocking_wrapped(
    fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]], wrap: Callable[[Any, R], W]
) -> Callable[Concatenate[Any, P], W]:
    """`blocking(fn)` whose result (an async object) is handed back as
    `wrap(face, result)`: its sync face."""
    name, timeout_of = fn.__name__, _timeout_reader(fn)

    @functools.wraps(fn)
    def call(self: BlockingFace, *args: P.args, **kwargs: P.kwargs) -> W:
        return wrap(self, self._call(getattr(self._aclient, name)(*args, **kwargs), timeout_of(args, kwargs)))

    _mark(call, fn, getattr(wrap, "__name__", None))
    return call


def facade(fn: Callable[Concatenate[Any, P], R], wrap: Callable[[Any, R], W]) -> Callable[Concatenate[Any, P], W]:
    """A plain (not async) method returning an async object: its sync face."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(self: BlockingFace, *args: P.args, **kwargs: P.kwargs) -> W:
        return wrap(self, getattr(self._aclient, name)(*args, **kwargs))

    _mark(call, fn, getattr(wrap, "__name__", None))
    return call


def blocking_iter(fn: Callable[Concatenate[Any, P], AsyncIterator[T]]) -> Callable[Concatenate[Any, P], Iterator[T]]:
    """An async-iterator method as a sync iterator (lazy, like a generator:
    nothing is sent before the first `next`)."""
    name, timeout_of = fn.__name__, _timeout_reader(fn)
    returns = str(inspect.signature(fn).return_annotation).replace("AsyncIterator", "Iterator")

    @functools.wraps(fn)
    def call(self: BlockingFace, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        return self._pump(getattr(self._aclient, name)(*args, **kwargs), timeout_of(args, kwargs))

    _mark(call, fn, returns)
    return call


def _close_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, aclient: Any) -> None:
    if loop.is_closed():
        return
    try:
        asyncio.run_coroutine_threadsafe(aclient.close(), loop).result(5)
    except Exception as e:  # closing is best effort: the loop is stopped below either way
        log.warning("client_close_failed", error=repr(e))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    if not thread.is_alive():  # a wedged loop cannot be closed; its daemon thread dies with the process
        loop.close()
