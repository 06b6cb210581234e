"""The client's queries and control plane: health, engines, stats, and the
ops fanned out to every engine (pause/resume, sleep/wake, prefix cache,
LoRA unload), each a request/reply to the head over the `HeadLink`.

This is also what the weight paths (`trainer_bridge/weights.py`, the senders
in `trainer_bridge/transports/`) need from a client: they take a
`ControlPort`, so they do not import the `AsyncClient` that imports them.

Every wait has a deadline; a timeout names the knob (`control_timeout_s`,
or the call's `timeout_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import msgspec

from bus import protocol as P
from bus.errors import AuthRefused, ControlError, HeadUnavailable, ProtocolError, RequestTimeout
from trainer_bridge.connection import HeadLink
from trainer_bridge.streams import GRACE_S
from trainer_bridge.update_ids import keep_sender_secret, sender_secret


class ControlPort(HeadLink):
    # Set by the client's constructor (AsyncClient.__init__).
    control_timeout_s: float
    _token: str  # the cluster's join token: control ops that change the cluster need it

    async def end_session(self, session_id: str) -> bool:
        """Forget the session's engine binding; True when it existed."""
        rep: P.QueryReply = await self._request(
            P.EndSession(request_id=self._new_id(), session_id=session_id), self.control_timeout_s, "control_timeout_s"
        )
        return _body(rep, P.SessionEnded).ended

    # ------------------------------------------------------------ queries

    async def _query(self, what: str, cls: type[_B], timeout_s: float | None = None) -> _B:
        """The head's typed answer to `what` (bus/views.py: P.QUERY_BODIES)."""
        t = timeout_s or self.control_timeout_s
        knob = "timeout_s" if timeout_s else "control_timeout_s"  # the one the caller set
        rep: P.QueryReply = await self._request(P.Query(request_id=self._new_id(), what=what), t, knob)
        return _body(rep, cls)

    async def health_view(self, timeout_s: float | None = None) -> P.HealthView:
        """The cluster's health, typed (`health()` is the same as plain dicts)."""
        return await self._query("health", P.HealthView, timeout_s)

    async def engine_views(self) -> list[P.EngineView]:
        """Every registered engine, typed (`engines()` is the same as plain dicts)."""
        return (await self._query("engines", P.EnginesView)).engines

    async def health(self, timeout_s: float | None = None) -> dict[str, Any]:
        """{"healthy": bool, "engines": {engine_id: detail}} (P.HealthView as dicts)."""
        return P.as_dict(await self.health_view(timeout_s))

    async def engines(self) -> list[dict[str, Any]]:
        """Every registered engine's detail (state, address, backend, load…)."""
        return [P.as_dict(e) for e in await self.engine_views()]

    async def stats(self) -> dict[str, Any]:
        """The head's counters, requests in flight and open sessions."""
        return P.as_dict(await self._query("stats", P.StatsView))

    async def wait_ready(self, num_engines: int = 1, timeout_s: float | None = None) -> dict[str, Any]:
        """Wait until `num_engines` engines are healthy (deadline: timeout_s,
        default 120 s, which bounds every query inside it too; a head that is
        down or restarting is asked again until then). No head ever heard at
        this address: HeadUnavailable naming it, within connect_timeout_s when
        no timeout_s was given (nothing is there, or the address is wrong), or
        at an explicit timeout_s (a script that starts the head and waits for
        it gives the head that long to come up)."""
        patient = timeout_s is not None
        timeout_s = 120.0 if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        last: object = None
        refused: AuthRefused | None = None  # the last refusal for want of a token that may yet appear
        # A head that ever answered this client (restarting, or stopped a
        # moment) is asked again until the deadline.
        answered = self._last_rx > 0
        while True:
            left = deadline - time.monotonic()
            h: P.HealthView | None
            try:
                h = await self.health_view(timeout_s=max(0.05, left))
            except HeadUnavailable as e:
                if not answered and e.field == "connect_timeout_s" and (not patient or left <= 0.05):
                    knob, within = (
                        ("timeout_s", timeout_s) if patient else ("connect_timeout_s", self.connect_timeout_s)
                    )
                    raise HeadUnavailable(
                        f"no head answered at {self.address} within {knob}={within}: "
                        "is it running, and is this its frontend address?",
                        address=self.address,
                        field=knob,
                    ) from None
                h, last = None, e.message
            except RequestTimeout as e:
                h, last = None, e.message
            except AuthRefused as e:
                # Refused for want of the join token while one may still be published
                # on this host (the launcher is starting): asked again until the deadline.
                if not (patient and e.field == "token" and self._token_may_appear):
                    raise
                h, last, refused = None, e.message, e
            if h is not None:
                answered, last = True, P.as_dict(h)
                if sum(1 for e in h.engines.values() if e.healthy) >= num_engines:
                    return P.as_dict(h)
            if time.monotonic() >= deadline and refused is not None:
                raise refused
            if time.monotonic() >= deadline and not answered:
                raise HeadUnavailable(
                    f"no head answered at {self.address} within timeout_s={timeout_s}: "
                    "is it running, and is this its frontend address?",
                    address=self.address,
                    field="timeout_s",
                )
            if time.monotonic() >= deadline:
                raise RequestTimeout(
                    f"fewer than {num_engines} healthy engine(s) after timeout_s={timeout_s}: {last}", field="timeout_s"
                )
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------ control plane

    async def control(
        self, op: P.Op, *, targets: list[str] | None = None, timeout_s: float | None = None, strict: bool = True
    ) -> dict[str, P.Result]:
        """Fan `op` out to the engines; returns {engine_id: the op's typed
        result} (a `P.*Result`: `r.parked`; by key as well: `r["parked"]`). With
        strict, any engine error or missing ack raises ControlError (which
        carries results, errors {engine_id: EngineFailure(code, message, field)}
        and missing)."""
        return await self._control_sent(op, targets=targets, timeout_s=timeout_s, strict=strict)

    def _control_sent(
        self, op: P.Op, *, targets: list[str] | None = None, timeout_s: float | None = None, strict: bool = True
    ) -> Coroutine[Any, Any, dict[str, P.Result]]:
        """`control`, but the op is SENT NOW, before this returns: ops sent
        back to back keep their order at the head and on every engine (a
        pipelined pause → update → resume). Await what it returns (always:
        the deadline of its reply starts then)."""
        t = timeout_s or self.control_timeout_s
        if isinstance(op, P.ReceiveWeights) and not op.sender_secret:
            # a GPU part: the head takes it only from a sender of its update
            op = msgspec.structs.replace(op, sender_secret=sender_secret(self, op.update_id))
        msg = P.Control(request_id=self._new_id(), op=op, targets=targets, timeout_s=t, token=self._token)
        return self._control_reply(op, msg, self._issue(msg), t, strict)

    async def _control_reply(
        self, op: P.Op, msg: P.Control, fut: asyncio.Future, t: float, strict: bool
    ) -> dict[str, P.Result]:
        rep: P.ControlReply = await self._reply(msg, fut, t + GRACE_S, "control_timeout_s")
        if isinstance(op, P.BeginWeightUpdate):
            keep_sender_secret(self, op.update_id, rep.sender_secret)  # the opener's alone
        if strict and (rep.errors or rep.missing):
            parts = [
                f"{eid}: [{f.code}] {f.message}" + (f" (field={f.field})" if f.field else "")
                for eid, f in sorted(rep.errors.items())
            ]
            if rep.missing:
                parts.append(f"no ack within timeout_s={t} from {rep.missing}")
            raise ControlError(
                f"{P.OP_NAMES[type(op)]} failed on some engines: " + "; ".join(parts),
                results=dict(rep.results),
                errors=dict(rep.errors),
                missing=list(rep.missing),
                request_id=msg.request_id,
            )
        return dict(rep.results)

    async def pause(
        self, mode: str = "abort", *, lora: str | None = None, timeout_s: float | None = None
    ) -> dict[str, P.PauseResult]:
        """Returns once every engine is quiescent for the scope; per engine a
        PauseResult (parked / frozen / held counts)."""
        t = timeout_s or self.control_timeout_s
        return expect(await self.control(P.Pause(mode=mode, lora=lora, timeout_s=t), timeout_s=t), P.PauseResult)

    async def resume(self, *, lora: str | None = None, force: bool = False) -> dict[str, P.ResumeResult]:
        """Open the gate (all scopes, or adapter `lora`); per engine a
        ResumeResult. Pauses are held per holder: while another live client
        holds the pause, this releases only this client's own hold, the
        engines stay paused and the answer is {} (see docs/guarantees.md, Leases).
        `force=True`: release every holder's hold and open the gate now."""
        return expect(await self.control(P.Resume(lora=lora, force=force)), P.ResumeResult)

    async def is_paused(self, *, lora: str | None = None) -> bool:
        """True when every engine is paused (for adapter `lora`, when given)."""
        res = expect(await self.control(P.IsPaused(lora=lora)), P.IsPausedResult)
        return bool(res) and all(r.paused for r in res.values())

    @contextlib.asynccontextmanager
    async def paused(self, mode: str = "abort", *, lora: str | None = None) -> AsyncIterator[Any]:
        """`async with client.paused("abort"): await client.update_weights(...)`;
        resumes even when the body raises."""
        await self.pause(mode, lora=lora)
        try:
            yield self
        finally:
            await self.resume(lora=lora)

    async def sleep(self, level: int = 1) -> dict[str, P.SleepResult]:
        """Put both tags ("weights", "kv_cache") to sleep on every engine (1:
        offload the weights, 2: discard them); {engine_id: SleepResult}."""
        return expect(await self.control(P.Sleep(level=level)), P.SleepResult)

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, P.WakeUpResult]:
        """Wake `tags` (None: both) in any order and split, e.g. ["weights"],
        a weight update, then ["kv_cache"]; requests run once no tag sleeps.
        {engine_id: WakeUpResult} (`detail["asleep"]`: the tags still asleep)."""
        return expect(await self.control(P.WakeUp(tags=tags)), P.WakeUpResult)

    async def reset_prefix_cache(self) -> dict[str, P.ResetPrefixCacheResult]:
        """Drop every engine's cached prefix blocks; per engine a result."""
        return expect(await self.control(P.ResetPrefixCache()), P.ResetPrefixCacheResult)

    async def unload_lora(self, name: str) -> dict[str, P.LoraResult]:
        """Unload adapter `name` from every engine."""
        return expect(await self.control(P.UnloadLora(name=name)), P.LoraResult)


_B = TypeVar("_B", bound=P.Body)
_R = TypeVar("_R", bound=P.ResultBase)


def _body(rep: P.QueryReply, cls: type[_B]) -> _B:
    """The reply's body as the type its question is answered with; another
    body is a protocol error (a head of another version)."""
    if not isinstance(rep.body, cls):
        raise ProtocolError(
            f"the head answered {type(rep.body).__name__}, expected {cls.__name__}", request_id=rep.request_id
        )
    return rep.body


def expect(results: dict[str, P.Result], cls: type[_R]) -> dict[str, _R]:
    """{engine_id: cls}: the typed results of an op whose result type is known."""
    return P.expect(results, cls, str(cls.__struct_config__.tag or cls.__name__))
