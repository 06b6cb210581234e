"""Request forwarding of the head, the shell: feeds the forwarding core
(router_node/forwarding_core.py) the events of the frontend and of the
engines' data sockets, and executes the actions it returns
(router_node/actions.py) on the sockets. Every decision is the core's.

Hazards this module owns:
- actions run in the order given, each to completion; a send that reports its
  peer gone (the frontend's `on_peer_gone` / `on_peer_full`) feeds the core a
  new event from inside the send: the core's state is whole before any of its
  actions runs, so that is safe;
- chunks for clients are gathered over one drain of an engine's data socket
  and leave when the drain ends, one message per client (a lone chunk as the
  engine sent it, several as one ChunkBatch). Nothing waits for more: a drain
  reads only what had already arrived, so a head that keeps up sends each
  chunk at once, and a head that falls behind sends what piled up in one
  message per client instead of one per chunk (what a byte stream's reads do
  for an HTTP router). Everything else sent to a client (errors, control
  replies) flushes the gathered chunks first (order per client).

Ownership: the router loop thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog
import zmq

from bus import protocol as P
from bus.codec import Codec, one_message, split_chunks
from bus.endpoint import Endpoint, send_multipart
from bus.errors import RolloutBusError
from router_node.actions import Action, FailRequest, RelayToClient, SendToClient, SendToEngine
from router_node.config import RouterConfig
from router_node.flights import Flight
from router_node.forwarding_core import ForwardingCore, Pick, PlaceSession
from router_node.policies import Sessions
from router_node.prefix import PrefixPlacement
from router_node.registry import EngineEntry

log = structlog.get_logger("router_node")

_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: IntFlag arithmetic per frame otherwise (bus/endpoint.py)
# Chunks one client's message may gather (a drain reads at most 512 engine
# messages, each possibly a ChunkBatch): past it, that client's chunks leave at once.
MAX_GATHERED = 1024

__all__ = ["Forwarder", "Pick", "PlaceSession"]


class Forwarder:
    def __init__(
        self,
        cfg: RouterConfig,
        codec: Codec,
        engines: dict[str, EngineEntry],
        sessions: Sessions,
        *,
        pick: Pick,
        place_session: PlaceSession,
        counters: dict[str, int],
        prefix: PrefixPlacement | None = None,
    ) -> None:
        self.codec = codec
        self.engines = engines  # the registry (owned by the router)
        self.core = ForwardingCore(
            cfg, engines, sessions, pick=pick, place_session=place_session, counters=counters, prefix=prefix
        )
        self.flights = self.core.flights
        # client -> [(chunk, buffers, the engine's frames or None)], in order:
        # what this drain gathered for each client (flush sends it)
        self.gathered: dict[bytes, list[tuple[P.Chunk, list[Any], list[Any] | None]]] = {}
        self.front: Endpoint  # set by the router once its frontend endpoint exists
        # Set by the router: engine `e` took no request (e.unreachable says why);
        # its health follows at once (SILENT: its legs move, nothing is placed there).
        self.on_unreachable: Callable[[EngineEntry], None] = lambda e: None
        self._run: dict[type, Callable[[Any], None]] = {
            SendToEngine: self._send_to_engine,
            SendToClient: self._send_to_client,
            FailRequest: self._fail_request,
        }

    def execute(self, actions: list[Action]) -> None:
        run = self._run
        for a in actions:
            if type(a) is RelayToClient:  # the commonest action (a streamed chunk): no table lookup, no wrapper call
                self._gather(a.client, a.chunk, a.buffers, a.frames)
            else:
                run[type(a)](a)

    # ------------------------------------------------------------ client requests

    def on_generate(self, client: bytes, msg: P.Generate, buffers: list[Any]) -> None:
        self.execute(self.core.generate(client, msg, [b.buffer for b in buffers], time.monotonic()))

    def on_cancel(self, client: bytes, msg: P.Cancel, _: list[Any]) -> None:
        self.execute(self.core.cancel(client, msg.request_id))

    def client_gone(self, client: bytes) -> None:
        """The frontend could not reach `client` (ROUTER_MANDATORY): stop its work."""
        self.execute(self.core.client_gone(client))

    # ------------------------------------------------------------ engine replies

    def engine_handlers(self, e: EngineEntry, endpoint: Callable[[], Endpoint]) -> dict[type, Any]:
        """The handler table of engine `e`'s data socket (`endpoint()`: its Endpoint)."""
        core = self.core
        eid = e.engine_id

        def on_error(_peer: bytes, msg: P.Error, _b: list[Any]) -> None:
            self.execute(core.engine_error(eid, msg))

        def on_chunks(_peer: bytes, msg: Any, buffers: list[Any]) -> None:
            # Gathered, not sent: the drain's end flushes (after_drain below).
            if type(msg) is not P.Chunk:
                for ch, bufs in split_chunks(msg, buffers):
                    self.execute(core.chunk(eid, ch, bufs, None))
            else:  # a chunk alone: it may be relayed as it came
                self.execute(core.chunk(eid, msg, buffers, endpoint().frames))

        return {P.Error: on_error, P.Chunk: on_chunks, P.ChunkBatch: on_chunks}

    def after_drain(self) -> None:
        """An engine socket's drain ended: what it gathered for clients leaves."""
        if self.gathered:
            self.flush()

    def flush(self) -> None:
        """Send every client its gathered chunks, one message each. The box is
        emptied before any send: a send that reports its client gone runs the
        core (and maybe this flush again) from inside it."""
        box = self.gathered
        if not box:
            return
        self.gathered = {}
        for client, items in box.items():
            self._send_gathered(client, items)

    def _flush_client(self, client: bytes) -> None:
        items = self.gathered.pop(client, None)
        if items:
            self._send_gathered(client, items)

    def _send_gathered(self, client: bytes, items: list[tuple[P.Chunk, list[Any], list[Any] | None]]) -> None:
        if len(items) == 1:
            chunk, bufs, frames = items[0]
            if frames is not None:
                self.front.send_frames([client, *frames])  # as the engine sent it: no re-encoding
            else:
                self.front.send(client, chunk, bufs)
            return
        self.front.send(client, *one_message([(c, b) for c, b, _ in items]))

    # ------------------------------------------------------------ failover and failure

    def evacuate(self, e: EngineEntry, reason: str) -> None:
        """Engine `e` is gone or hung: its requests go elsewhere or end (the core decides)."""
        self.execute(self.core.evacuate(e.engine_id, reason, time.monotonic()))

    def forget_engine(self, engine_id: str) -> None:
        self.core.forget_engine(engine_id)

    def fail_flight(self, fl: Flight, code: Any, message: str, field: str | None = None) -> None:
        self.execute(self.core.fail(fl, code, message, field))

    def fail_client(self, client: bytes, code: Any, message: str, field: str | None = None) -> None:
        self.execute(self.core.fail_client(client, code, message, field))

    def fail_all(self, code: Any, message: str) -> None:
        self.execute(self.core.fail_all(code, message))

    # ------------------------------------------------------------ executing actions

    def _send_to_engine(self, a: SendToEngine) -> None:
        e = self.engines.get(a.engine_id)
        if e is None:
            return
        msg = a.msg
        if isinstance(msg, P.Generate):
            part = self.core.parts.get(msg.request_id)
            if part is None or part.engine_id != a.engine_id:
                return  # its flight ended or moved while this batch ran (an earlier send failed)
        try:
            # Hazard: never a blocking send. A DEALER whose one connection is
            # gone for good blocks a send forever: libzmq ends the pipe when the
            # peer refuses the handshake, which is what a restarted engine on
            # the same address does to the head's connection of its previous
            # life (the secret is per incarnation) - that froze the head's loop.
            send_multipart(e.sock, self.codec.encode(msg, a.buffers), _NOBLOCK)
        except zmq.ZMQError as err:
            if not a.nonblock:
                self._unreachable(e, msg, err)
                return
            log.debug("cancel_not_sent", engine_id=a.engine_id, request_id=msg.request_id, error=str(err))
        except RolloutBusError as err:  # e.g. EncodeFailed: this flight ends, the head goes on
            if not isinstance(msg, P.Generate):
                raise
            self.execute(self.core.leg_unsent(msg.request_id, err))

    def _unreachable(self, e: EngineEntry, msg: Any, err: zmq.ZMQError) -> None:
        """The head's connection to `e` takes nothing (no pipe: refused or never
        made; or 100k messages queued): the engine is unreachable until it
        registers again, and this leg moves with its others (or ends)."""
        self.link_refused(
            e,
            f"the head's data connection to it takes no request ({err.strerror}): refused at the handshake "
            "(a restarted engine on the same address) or full; it serves again once it registers anew",
            getattr(msg, "request_id", None),
        )

    def link_refused(self, e: EngineEntry, reason: str, request_id: str | None = None) -> None:
        """`e` cannot be reached (router_node/data_links.py, or a send above)."""
        if self.engines.get(e.engine_id) is not e:
            return  # replaced or forgotten meanwhile
        if not e.unreachable:
            e.unreachable = reason
            self.core.counters["engine_unreachable"] += 1
            log.warning("engine_unreachable", engine_id=e.engine_id, request_id=request_id, reason=reason)
        self.on_unreachable(e)

    def link_dropped(self, e: EngineEntry, reason: str) -> None:
        """The head's data connection to `e` dropped (router_node/data_links.py):
        chunks in flight on it may be lost, so its legs move now."""
        if self.engines.get(e.engine_id) is not e:
            return
        self.core.counters["data_links_dropped"] += 1
        legs = sum(1 for p in self.core.parts.values() if p.engine_id == e.engine_id)
        (log.warning if legs else log.info)("engine_data_link_dropped", engine_id=e.engine_id, legs_moved=legs)
        if legs:
            self.evacuate(e, reason)

    def _send_to_client(self, a: SendToClient) -> None:
        self._gather(a.client, a.chunk, a.buffers, None)

    def _gather(self, client: bytes, chunk: P.Chunk, buffers: list[Any], frames: list[Any] | None) -> None:
        items = self.gathered.get(client)
        if items is None:
            self.gathered[client] = [(chunk, buffers, frames)]
            return
        items.append((chunk, buffers, frames))
        if len(items) >= MAX_GATHERED:
            self._flush_client(client)

    def _fail_request(self, a: FailRequest) -> None:
        self.front.fail(a.client, a.request_id, a.code, a.message, a.field)
