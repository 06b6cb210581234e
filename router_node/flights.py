"""The head's in-flight ledger: what it forwards, per client request and per
engine leg, and the token track of every sample. No I/O.

A client's Generate is a `Flight`; each Generate the head sends to an engine
on its behalf is a `Part` (a leg). The head sees every token it forwards (one
`SampleTrack` per sample), which is what failover re-submits.

Hazards this module owns:
- a flight leaves `flights` exactly once (`drop_flight` says whether it was
  still there), and with it its client's in-flight count;
- an engine leg's request id is unique among live legs, and never one that an
  engine still owes finals for (`retired`): a leg cancelled or evacuated from an
  engine that is alive still sends what it produced, and its "cancelled"
  finals; a new leg under the same id on that engine would take them as its own.

Ownership: the router loop thread (through router_node/forwarding_core.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from bus import protocol as P
from bus.frames import (
    chunk_versions,
    logprobs_wanted,
    note_version,
    route_itemsize,
    token_bytes,
    token_count,
    top_k_of,
)


@dataclasses.dataclass(eq=False, slots=True)
class SampleTrack:
    tokens: bytearray = dataclasses.field(default_factory=bytearray)  # the token frame layout (bus.frames)
    logprobs: bytearray = dataclasses.field(default_factory=bytearray)
    marks: list[list[int]] = dataclasses.field(default_factory=list)  # [offset, version]
    done: bool = False
    top_ids: bytearray = dataclasses.field(default_factory=bytearray)  # k per token (bus.frames)
    top_logprobs: bytearray = dataclasses.field(default_factory=bytearray)
    restarts: int = 0  # staleness restarts over every leg (what the client sees)
    leg_restarts: int = 0  # the current leg's own count (Chunk.restarts from its engine)
    # -- issue 37: routed-expert rows (bus.frames layout), for a non-streamed
    # request's one chunk; `leg_routes`: bytes held when the current leg began.
    routes: bytearray = dataclasses.field(default_factory=bytearray)
    routes_meta: P.RoutedExperts | None = None  # totals so far (rows, prompt_rows)
    leg_routes: int = 0


@dataclasses.dataclass(eq=False, slots=True)
class Flight:
    """A client's request while the head has it."""

    client: bytes
    msg: P.Generate
    prompt: bytes  # the prompt frame as received (its last msg.resume_len tokens: output the client has)
    samples: dict[int, SampleTrack]
    parts: set[str] = dataclasses.field(default_factory=set)
    failovers: int = 0
    open: int = 0
    started: float = 0.0
    # Engines that died or hung with this request in flight: at
    # cfg.max_engine_deaths it is ended, never sent to another (a poison request).
    deaths: list[str] = dataclasses.field(default_factory=list)

    @property
    def key(self) -> tuple[bytes, str]:
        return (self.client, self.msg.request_id)


@dataclasses.dataclass(eq=False, slots=True)
class Part:
    """One Generate the head sent to one engine on behalf of a Flight."""

    rid: str
    flight: Flight
    engine_id: str
    open: int  # samples of it not finished
    indices: list[int]  # the flight's sample indexes it carries
    prefix: int = 0  # tokens of the sample's track it was sent with (a restart keeps them)


class Ledger:
    """Flights by (client, request id), legs by engine request id, and the
    legs engines still owe finals for."""

    def __init__(self) -> None:
        self.flights: dict[tuple[bytes, str], Flight] = {}
        self.inflight_of: dict[bytes, int] = {}  # client -> its flights (cfg.max_inflight_per_client)
        self.parts: dict[str, Part] = {}
        # (engine id, leg id) -> finals that engine still owes for a leg the head
        # let go of (cancelled or evacuated): its late chunks are dropped, and
        # the id is not given to a new leg there until they came.
        self.retired: dict[tuple[str, str], int] = {}
        self._rid = itertools.count(1)

    def add_flight(self, fl: Flight) -> None:
        self.flights[fl.key] = fl
        self.inflight_of[fl.client] = self.inflight_of.get(fl.client, 0) + 1

    def drop_flight(self, fl: Flight) -> bool:
        """Remove `fl` (False: it was already gone)."""
        if self.flights.pop(fl.key, None) is None:
            return False
        n = self.inflight_of.get(fl.client, 0) - 1
        if n > 0:
            self.inflight_of[fl.client] = n
        else:
            self.inflight_of.pop(fl.client, None)
        return True

    def leg_id(self, engine_id: str, client_rid: str, whole: bool) -> str:
        """Fast path: a whole request keeps the client's id on its engine when
        no live leg uses it and that engine owes nothing under it."""
        if whole and client_rid not in self.parts and (engine_id, client_rid) not in self.retired:
            return client_rid
        rid = f"~{next(self._rid):x}"
        while rid in self.parts or (engine_id, rid) in self.retired:
            rid = f"~{next(self._rid):x}"
        return rid

    def add_part(self, part: Part) -> None:
        self.parts[part.rid] = part
        part.flight.parts.add(part.rid)

    def pop_part(self, rid: str) -> Part | None:
        part = self.parts.pop(rid, None)
        if part is not None:
            part.flight.parts.discard(rid)
        return part

    def retire(self, part: Part) -> None:
        """The head let go of `part` while its engine may still answer it."""
        if part.open > 0:
            key = (part.engine_id, part.rid)
            self.retired[key] = self.retired.get(key, 0) + part.open

    def owed(self, engine_id: str, rid: str, *, final: bool, error: bool = False) -> None:
        """A late chunk (or Error) of a retired leg arrived: count its finals."""
        key = (engine_id, rid)
        n = self.retired.get(key)
        if n is None:
            return
        if error or (final and n <= 1):
            del self.retired[key]
        elif final:
            self.retired[key] = n - 1

    def forget_engine(self, engine_id: str) -> None:
        """The engine is gone for good (forgotten, re-registered): it owes nothing."""
        for key in [k for k in self.retired if k[0] == engine_id]:
            del self.retired[key]


# ------------------------------------------------------------ sample tracks


def restart_leg(tr: SampleTrack, keep: int, leg_restarts: int) -> None:
    """The staleness bound restarted the sample on its engine: what this leg
    produced after its first `keep` tokens is dropped; the client is told by
    `restarts`."""
    if tr.tokens and tr.top_ids:
        k = len(tr.top_ids) // len(tr.tokens)
        del tr.top_ids[token_bytes(k * keep) :]
        del tr.top_logprobs[token_bytes(k * keep) :]
    del tr.tokens[token_bytes(keep) :]
    del tr.logprobs[token_bytes(keep) :]
    m = tr.routes_meta
    if m is not None:  # back to the rows the leg began with (the new attempt sends its own)
        del tr.routes[tr.leg_routes :]
        m.rows = len(tr.routes) // max(1, m.layers * m.top_k * route_itemsize(m.dtype))
        m.prompt_rows = min(m.prompt_rows, m.rows)
    tr.marks = [m for m in tr.marks if m[0] < keep]
    tr.restarts += leg_restarts - tr.leg_restarts
    tr.leg_restarts = leg_restarts


def record(tr: SampleTrack, ch: P.Chunk, head: list[Any], toks: Any, lps: Any) -> None:
    """Append a chunk's tokens (and logprobs, top-k rows, version marks) to its track."""
    if toks:
        note_version(tr.marks, token_count(tr.tokens), ch.weight_version)
    tr.tokens += toks
    if lps is not None:
        tr.logprobs += lps
    if ch.top_logprobs and len(head) >= 4:
        tr.top_ids += head[2]
        tr.top_logprobs += head[3]


def record_routes(tr: SampleTrack, meta: P.RoutedExperts, frame: Any) -> None:
    """Append a chunk's routed-expert rows to its track (non-streamed requests)."""
    tr.routes += frame
    if tr.routes_meta is None:
        tr.routes_meta = P.RoutedExperts(meta.rows, meta.layers, meta.top_k, meta.dtype, meta.prompt_rows)
    else:
        tr.routes_meta.rows += meta.rows
        tr.routes_meta.prompt_rows += meta.prompt_rows


def aggregate(fl: Flight, tr: SampleTrack, last: P.Chunk, prompt_frames: list[Any]) -> tuple[P.Chunk, list[bytes]]:
    """The one chunk of a finished sample of a non-streamed request. The track
    holds only tokens engines produced for this request: the client's own
    resumed tokens (msg.resume_len) are in its prompt, never in the track."""
    version, changes = chunk_versions(tr.marks, last.weight_version)
    out = P.Chunk(
        request_id=fl.msg.request_id,
        sample_index=last.sample_index,
        weight_version=version,
        finish_reason=last.finish_reason,
        version_changes=changes,
        emitted_at=last.emitted_at,
        num_prompt_tokens=token_count(fl.prompt) - fl.msg.resume_len,
        engine_id=last.engine_id,
        restarts=tr.restarts,
        top_logprobs=last.top_logprobs,
        prompt_logprobs=last.prompt_logprobs,
        stop_reason=last.stop_reason,
        text=last.text,
    )
    bufs = [bytes(tr.tokens)]
    if logprobs_wanted(fl.msg.params.logprobs):
        bufs.append(bytes(tr.logprobs))
        if top_k_of(fl.msg.params.logprobs):
            bufs += [bytes(tr.top_ids), bytes(tr.top_logprobs)]
    bufs += [bytes(b) for b in prompt_frames]
    if tr.routes_meta is not None and tr.routes_meta.rows:
        out.routed_experts = tr.routes_meta
        bufs.append(bytes(tr.routes))
    return out, bufs
