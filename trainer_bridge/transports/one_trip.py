"""The one-trip update, trainer side: ONE control round trip per zero-copy
cuda_ipc update, and per nccl update, once the engines hold the trainer's layout.

nccl (trainer_bridge/transports/nccl.py): every update names the same plan
(metas, sizes) while the trainer's parameters keep their names, shapes and
dtypes; its digest is the layout. The engines keep the metas and their
staging buffers under it, so the steady state is
`BeginWeightUpdate("nccl", [], [], layout=L, commit=True, transport_args=
NcclArgs(..., check_in=fresh))`: the head decides the version and publishes,
each engine worker checks in and receives the broadcast into its staging,
the engine validates and commits, ONE ack. The trainer broadcasts only once
every worker checked in: a refused op (head or engines) leaves nothing
half-sent, and the trainer falls back to the two round trips by itself.

A zero-copy update (`update_weights(transport="cuda_ipc", zero_copy=True)`,
trainer_bridge/transports/cuda_ipc.py) names the trainer's own parameters;
while they stay where they are, its metas, sizes and handles are the same
bytes every update. Their digest is the LAYOUT id. The first update (or any
after the layout changed) goes the two-round-trip way with its handles and
`layout=L`; engines that commit it keep L and say so
(`WeightsCommitted.layout`). `layouts(client)` remembers, per head
connection and target set, the layout every engine confirmed (and the
engines, so no health read is needed next time). The next update with the same id is ONE op:

    BeginWeightUpdate(update_id, "cuda_ipc", [], [], layout=L, commit=True)
      → the head checks every target holds L, decides the version, publishes
      → each engine: begin + receive + validate + prepare + commit, acks
        WeightsCommitted (detail["path"] == "one_trip")

Falls back to the two-round-trip path by itself (a new update id, a fresh
health read) when the head or every engine refuses the layout (field
"layout": an engine slept, re-joined, committed another layout) — nothing
committed then. An engine that fails while another committed is STALE, as
after a missed commit (router_node/one_trip.py says what a one-op commit
guarantees). The NaN/inf check finishes BEFORE the op leaves: the engines
write at once.
"""

from __future__ import annotations

import hashlib
import operator
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog

from bus import protocol as P
from bus.errors import BadRequest, ControlError
from bus.transport import Transport

log = structlog.get_logger("trainer_bridge.transports.one_trip")


# The last digest and the very objects it was made of: the zero-copy plan and
# handle caches (cuda_ipc.py) hand the same TensorMeta and handle objects
# every update while nothing moved, so an identity pass (no encode, no hash of
# ~135 KB at 7B) finds it again. Hazard: a meta mutated in place would be
# missed; nothing mutates them (the plan cache hands them out read-only).
_LAST_LAYOUT: list[Any] = [(), (), (), ""]


def layout_id(metas: list[Any], sizes: list[int], handles: list[Any]) -> str:
    """The digest of a zero-copy layout: same tensors, same storages → same id
    (the transport args are not part of it: each op carries its own)."""
    m0, s0, h0, got = _LAST_LAYOUT
    if (
        got
        and len(metas) == len(m0)
        and len(handles) == len(h0)
        and all(map(operator.is_, metas, m0))
        and all(map(operator.is_, handles, h0))
        and list(sizes) == s0
    ):
        return got
    h = hashlib.blake2b(digest_size=12)
    h.update(msgspec.msgpack.encode([metas, sizes]))
    for x in handles:
        h.update(x if isinstance(x, bytes) else msgspec.msgpack.encode(x))
    _LAST_LAYOUT[:] = [tuple(metas), list(sizes), tuple(handles), h.hexdigest()]
    return _LAST_LAYOUT[3]


def _key(targets: list[str] | None) -> Any:
    return None if targets is None else tuple(sorted(targets))


class LayoutCache:
    """target set -> (layout id, engines) that every engine of the set confirmed."""

    def __init__(self) -> None:
        self.held: dict[Any, tuple[str, list[P.EngineView]]] = {}

    def holds(self, targets: list[str] | None, layout: str) -> bool:
        got = self.held.get(_key(targets))
        return bool(layout) and got is not None and got[0] == layout

    def engines_for(self, targets: list[str] | None) -> list[P.EngineView] | None:
        got = self.held.get(_key(targets))
        return list(got[1]) if got is not None else None

    def committed(
        self, targets: list[str] | None, layout: str, engines: list[P.EngineView], results: dict[str, Any]
    ) -> None:
        """A two-round-trip update committed: keep its layout only if every
        engine it went to committed and holds it."""
        whole = bool(results) and set(results) == {e.engine_id for e in engines}
        if layout and whole and all(getattr(r, "layout", "") == layout for r in results.values()):
            self.held[_key(targets)] = (layout, list(engines))
        else:
            self.forget(targets)

    def forget(self, targets: list[str] | None) -> None:
        self.held.pop(_key(targets), None)


# One cache per client (head connection): two clients of one process may talk
# to two clusters whose engines share ids ("e0") but hold nothing of the
# other's; a cache per process would hand one cluster's engines to the other.
CACHES: weakref.WeakKeyDictionary[Any, LayoutCache] = weakref.WeakKeyDictionary()


def layouts(client: Any) -> LayoutCache:
    cache = CACHES.get(client)
    if cache is None:
        cache = CACHES[client] = LayoutCache()
    return cache


class Refused(Exception):
    """The one-trip op was refused before any engine committed: fall back."""


def nothing_committed(e: BaseException) -> bool:
    """The head or every engine refused the one-trip op (no commit, none missing)."""
    # "update_id": the head did not take the id (a restarted head, another
    # trainer's update in between): the fallback reads health, a fresh id.
    if isinstance(e, BadRequest) and e.field in ("layout", "commit", "update_id"):
        return True
    return isinstance(e, ControlError) and not e.results and not e.missing and bool(e.errors)


async def send(
    upd: Any,
    layout: str,
    args: Any,
    transport: Transport = Transport.CUDA_IPC,
    deliver: Callable[[Awaitable[Any], float], Awaitable[Any]] | None = None,
) -> dict[str, P.WeightsCommitted]:
    """The one-trip op of `upd` (a trainer_bridge.weights.WeightUpdate whose
    engines hold `layout`); Refused when nothing committed. `deliver`: the
    link's (nccl: publish the op, broadcast once every engine worker is in
    its receive, gather the acks); None: the op's acks are all there is."""
    begin = P.BeginWeightUpdate(
        upd.update_id, transport, [], [], transport_args=args, check_finite=upd.check_finite,
        layout=layout, commit=True, version=upd.version,
    )  # fmt: skip
    reply = upd.client._control_sent(begin, targets=upd.targets, timeout_s=upd.timeout_s)
    if upd.pipeline is not None:
        upd.pipeline.resume()  # right behind the update: the head and engines keep the order
    try:
        res = await (reply if deliver is None else deliver(reply, upd.timeout_s))
    except (BadRequest, ControlError) as e:
        if nothing_committed(e):
            layouts(upd.client).forget(upd.targets)
            upd.state = "aborted"
            raise Refused(str(e)) from e
        if not isinstance(e, ControlError) or not e.results:
            layouts(upd.client).forget(upd.targets)
            raise
        # Committed on some engines; these failed or missed it and are stale now.
        log.warning("weight_one_trip_missed", update_id=upd.update_id, failed=sorted(e.errors), missing=e.missing)
        layouts(upd.client).forget(upd.targets)
        res = dict(e.results)
    except BaseException:
        layouts(upd.client).forget(upd.targets)
        raise
    upd.state = "committed"
    upd.results = P.expect(res, P.WeightsCommitted, "finish_weights")
    return upd.results
