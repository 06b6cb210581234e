"""SENDERS: the trainer-side sender of every transport, found by lookup.

An entry has `takes_plan` (a one-sender update may announce its metas in the
begin), `push(upd, named, options)` (a whole one-sender update) and
`part_sender(client, update_id, rank, engines, ...)` (one rank's part of an
update). Adding a transport: its member in bus/transport.py, a module here
with its entry, and one line in this table."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from bus import protocol as P
from bus.transport import Transport
from trainer_bridge.transports import cuda_ipc, nccl, vllm_nccl, zmq


class SenderKind(Protocol):
    takes_plan: bool

    def part_sender(self, client: Any, update_id: str, rank: int, engines: list[P.EngineView], **kw: Any) -> Any: ...

    async def push(self, upd: Any, named: Iterable[tuple[str, Any]], options: dict[str, Any]) -> dict[str, Any]: ...


SENDERS: dict[Transport, SenderKind] = {
    Transport.ZMQ: zmq.KIND,
    Transport.CUDA_IPC: cuda_ipc.KIND,
    Transport.NCCL: nccl.KIND,
    Transport.VLLM_NCCL: vllm_nccl.KIND,  # sends nothing: the trainer's own vLLM broadcast
}


def sender_kind(transport: Any) -> SenderKind:
    """The SENDERS entry of `transport`; ValueError naming it when there is none."""
    try:
        return SENDERS[Transport(transport)]
    except (ValueError, KeyError):
        names = ", ".join(t.value for t in SENDERS)
        raise ValueError(f"unknown transport {transport!r} ({names})") from None
