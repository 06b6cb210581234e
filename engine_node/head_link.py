"""An engine node's connection to the head: the control SUB it takes commands
from, the events DEALER it registers and acks on, and the registration itself
(Register → RegisterReply, re-registration when a restarted head asks, Rejoin).

Ownership: the node's loop thread (both sockets, every method here).

Hazards:
- the events identity is the head's proof that acks (and, + b"/hb", heartbeats:
  engine_node/heartbeat.py) are ours (router_node/router.py _engine_of); its
  random part is never published, so nobody can reconnect under it once we
  are dead;
- a Register is sent NOBLOCK: a DEALER without a connected head (refused
  handshake, head down) would block the loop; `check` sends it again every
  second until the head answers or register_timeout_s ends the node;
- security on: the head's ZAP handler refusing our engine credential is final
  (libzmq does not retry): its monitor event ends the node with a clear error
  instead of a silent wait for register_timeout_s; so does a run of handshakes
  closed without a reason before we registered (bus/handshake_refusal.py: the
  refusal's other face, under load);
- a refusal with `retry` (our id is held by a live engine: our previous life,
  not yet seen dead, or a twin) is retried until register_timeout_s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from bus import protocol as P
from bus.auth import read_token
from bus.codec import Codec
from bus.endpoint import Endpoint, open_monitored, open_socket
from bus.handshake_refusal import HANDSHAKE_EVENTS, RefusalJudge, silent_words
from bus.roles import Plain
from bus.sockets import CONTROL_HWM, CurveKeys
from engine_node.config import EngineNodeConfig

_REGISTER_EVERY_S = 1.0  # Register is re-sent this often until the head answers
_REGISTER_INFLIGHT_S = 0.5  # a Rejoin this soon after a Register waits for its reply


class NodeFatal(Exception):
    """The node cannot go on (registration refused, head never answered)."""


class HeadLink:
    def __init__(
        self,
        ctx: zmq.Context,
        cfg: EngineNodeConfig,
        codec: Codec,
        *,
        identity: bytes,
        curve: CurveKeys | None,
        plain: Plain | None,
        register_msg: Callable[[str], P.Register],
        on_command: Callable[[bytes, P.Command, list[Any]], None],
        log: Any,
    ) -> None:
        self.cfg = cfg
        self.codec = codec
        self.log = log
        self.register_msg = register_msg  # token -> the Register to send
        # The join token (run_engine_node already refused a bad file, naming it).
        self.token = read_token(cfg.token_file) if cfg.token_file else ""
        self.identity = identity  # engine_node/node_setup.py events_identity
        self.sub = open_socket(
            ctx,
            zmq.SUB,
            connect=cfg.head_control,
            hwm=CONTROL_HWM,
            subscribe=[b"*\x00", cfg.engine_id.encode() + b"\x00"],
            curve=curve,
            plain=plain,
        )
        # A head that refuses our credential (AUTH) or wants one we lack
        # (PROTOCOL: a token-less engine against a head with a token) ends the node.
        # A run of silent handshake failures counts too (bus/handshake_refusal.py).
        # The monitor is attached before the connect (bus/endpoint.py open_monitored).
        self.events, monitor = open_monitored(
            ctx, zmq.DEALER, connect=cfg.head_events, events=HANDSHAKE_EVENTS, hwm=CONTROL_HWM,
            identity=self.identity, curve=curve, plain=plain,
        )  # fmt: skip
        self.monitor: zmq.Socket | None = monitor
        self.curve_used = curve is not None and cfg.head_events.startswith("tcp://")
        self.refusals = RefusalJudge()
        self.sub_ep = Endpoint(self.sub, codec, {P.Command: on_command}, name="control", routed=True, error_reply=None)
        self.events_ep = Endpoint(
            self.events,
            codec,
            {P.RegisterReply: self._on_register_reply, P.Rejoin: self._on_rejoin},
            name="events",
            routed=False,
            error_reply=None,
        )
        self.registered = False
        self.refused: str | None = None  # the last retryable refusal (id held by a live engine)
        self.fatal: str | None = None  # set by a handler; the node's loop raises NodeFatal
        # The head's identity on our data socket (RegisterReply.data_peer): acks
        # go there, behind every chunk produced before them (b"": events socket).
        self.head_peer = b""
        self.sent_at = 0.0
        self.deadline = 0.0

    # ------------------------------------------------------------ registration

    def start(self) -> None:
        now = time.monotonic()
        self._register(now)
        self.deadline = now + self.cfg.register_timeout_s

    def _register(self, now: float) -> None:
        try:
            self.events.send_multipart(self.codec.encode(self.register_msg(self.token)), zmq.NOBLOCK)
        except zmq.Again:
            self.log.debug("register_not_sent", reason="no head connection yet; sent again at the next tick")
        self.sent_at = now

    def check(self, now: float) -> None:
        """Tick: re-send Register until the head answers; end at register_timeout_s."""
        if self.registered:
            return
        if now > self.deadline:
            knob = f"register_timeout_s={self.cfg.register_timeout_s}"
            if self.refused:
                raise NodeFatal(f"the head refused registration for {knob}: {self.refused}")
            raise NodeFatal(f"the head never answered Register within {knob}")
        if now - self.sent_at > _REGISTER_EVERY_S:
            self._register(now)

    def on_monitor(self) -> None:
        assert self.monitor is not None
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            refusal = self.refusals.judge(event)  # type: ignore[arg-type]
            if refusal is None:
                continue
            if refusal.get("silent") and self.registered:
                # A head that took us once closing handshakes without a reason is
                # far likelier a network fault or a head restarting than a new
                # refusal: the heartbeat deadline judges it, not this.
                self.log.warning("head_handshakes_failing", silent_in_a_row=self.refusals.silent_in_a_row)
                self.refusals = RefusalJudge()
                continue
            if refusal["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH and self.curve_used:
                raise NodeFatal(
                    f"the head at {self.cfg.head_events} refused this engine's CURVE key (ZAP status {refusal['value']}): "
                    f"the engines/*.key_secret in curve_dir={self.cfg.curve_dir} is not an engine credential of this "
                    "cluster (copy the head's key folder)"
                )
            how = f" ({silent_words()})" if refusal.get("silent") else ""
            raise NodeFatal(
                f"the head at {self.cfg.head_events} refused this engine at the handshake{how}: "
                f"{'a wrong' if self.token else 'no'} join token (unauthorized, field=token; "
                f"token_file={self.cfg.token_file!r}; docs/security.md)"
                + (f" or CURVE key (curve_dir={self.cfg.curve_dir})" if self.curve_used else "")
            )

    def _on_register_reply(self, _peer: bytes, msg: P.RegisterReply, _b: list[Any]) -> None:
        if not msg.ok and msg.retry and not self.registered:
            if self.refused != msg.error:
                self.log.warning("register_refused_retrying", error=msg.error)
            self.refused = msg.error
            return
        if not msg.ok:
            self.fatal = f"the head refused registration: {msg.error}"
            return
        if not self.registered:
            self.log.info("engine_registered")
        self.registered = True
        self.head_peer = msg.data_peer.encode()

    def _on_rejoin(self, _peer: bytes, msg: P.Rejoin, _b: list[Any]) -> None:
        """The head does not know us (it restarted on the same addresses):
        register again at once, with our weight version and LoRAs (heartbeats
        carry paused / sleeping / running). Requests the old head forwarded
        end when their chunks find its data connection gone (core.peer_gone)."""
        now = time.monotonic()
        if not self.registered and now - self.sent_at < _REGISTER_INFLIGHT_S:
            return  # a Register is on its way already
        self.log.warning("engine_rejoining", reason=msg.reason[:200])
        self.registered = False
        self.refused = None
        self.head_peer = b""
        self._register(now)
        self.deadline = now + self.cfg.register_timeout_s

    # ------------------------------------------------------------ acks

    def send_event(self, msg: Any) -> None:
        """An ack over the events socket (no data connection to the head yet).
        Never blocks: a DEALER whose connection was refused at the handshake has
        no pipe, and a blocking send would freeze the loop before the monitor's
        event ends the node (the head republishes what it misses an ack of)."""
        try:
            self.events.send_multipart(self.codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.log.warning(
                "ack_not_sent", reason="no connection to the head's events socket", what=type(msg).__name__
            )

    def close(self) -> None:
        if self.monitor is not None:
            self.events.disable_monitor()
            self.monitor.close(linger=0)
        self.sub_ep.close()
        self.events_ep.close()
