"""`Client`: the synchronous face of `AsyncClient`, generated from it
(`trainer_bridge/blocking.py`): every public method of AsyncClient exists
here with the same signature and docstring and runs on a private loop thread,
so the client is safe to call from any thread. Written by hand: the
constructor, `paused()` (a sync context manager yielding this Client) and
the sync faces of the multi-sender weight update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from bus import protocol as P
from trainer_bridge.async_client import AsyncClient
from trainer_bridge.blocking import BlockingFace, blocking, blocking_iter, blocking_wrapped, facade


class SyncWeightSender:
    def __init__(self, client: BlockingFace, sender: Any) -> None:
        self._client, self._sender = client, sender

    def send(self, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        """Pack and stream this rank's tensors (any iterable), then declare its end."""
        return self._client._call(self._sender.send(named_tensors))

    def wait_released(self, timeout_s: float | None = None) -> Any:
        """cuda_ipc: keep this rank's buckets until the coordinator's commit round
        is over (or it aborted), then free them. Other transports: nothing to wait for."""
        wait = getattr(self._sender, "wait_released", None)
        return None if wait is None else self._client._call(wait(timeout_s), timeout_s)

    def __enter__(self) -> SyncWeightSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        # The sender's own exit decides what leaving means (cuda_ipc: keep the
        # buckets until the coordinator's commit round is over). Probing for a
        # transport attribute here once went stale (`_ipc` was renamed) and let
        # a rank free its buckets before the commit: "invalid resource handle".
        aexit = getattr(self._sender, "__aexit__", None)
        if aexit is not None:
            self._client._call(aexit(*exc))


class SyncWeightUpdate:
    """A multi-sender update from the sync Client (see AsyncClient.weight_update):
    `with c.weight_update(senders=2) as upd: upd.sender(0).send(named)` commits
    on leaving the block."""

    def __init__(self, client: BlockingFace, upd: Any) -> None:
        self._client, self._upd = client, upd

    @property
    def update_id(self) -> str:
        return self._upd.update_id

    @property
    def sender_secret(self) -> str:
        """For a sender rank in another process, with update_id (WeightUpdate.sender_secret)."""
        return self._upd.sender_secret

    @property
    def results(self) -> dict[str, P.WeightsCommitted]:
        return self._upd.results

    def sender(self, rank: int = 0) -> SyncWeightSender:
        return SyncWeightSender(self._client, self._upd.sender(rank))

    def prepare(self) -> dict[str, P.WeightsPrepared]:
        return self._client._call(self._upd.prepare())

    def commit(self) -> dict[str, P.WeightsCommitted]:
        return self._client._call(self._upd.commit())

    def abort(self) -> None:
        self._client._call(self._upd.abort())

    def __enter__(self) -> SyncWeightUpdate:
        self._client._call(self._upd.open())
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._client._call(self._upd.__aexit__(exc_type, exc, tb))


class Client(BlockingFace):
    """Synchronous client. Runs an AsyncClient on a private event-loop thread."""

    _aclient: AsyncClient

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:5555",
        *,
        timeout_s: float = 600.0,
        control_timeout_s: float = 120.0,
        curve_dir: str | None = None,
        client_key: str | None = None,
        tokenizer: Any = None,
        token_file: str | None = None,
        head_timeout_s: float = 2.0,
        connect_timeout_s: float = 3.0,
        ping_interval_s: float = 0.5,
        head_stall_timeout_s: float = 30.0,
    ) -> None:
        """`head_timeout_s`, `head_stall_timeout_s`, `connect_timeout_s`, `ping_interval_s`: head
        liveness (AsyncClient). `timeout_s`: a request's deadline; `control_timeout_s`: a control
        op's; `curve_dir`: the cluster's key folder (launch.py --curve) and
        `client_key`: this client's key in it, a name or a .key_secret path
        (AsyncClient); `tokenizer`: a Hugging Face tokenizer or a local model
        folder (else the engines' model's); `token_file`: the cluster's join
        token (None: found as AsyncClient says; "": none)."""
        aclient = AsyncClient(
            address,
            timeout_s=timeout_s,
            control_timeout_s=control_timeout_s,
            curve_dir=curve_dir,
            client_key=client_key,
            tokenizer=tokenizer,
            token_file=token_file,
            head_timeout_s=head_timeout_s,
            connect_timeout_s=connect_timeout_s,
            ping_interval_s=ping_interval_s,
            head_stall_timeout_s=head_stall_timeout_s,
        )
        super().__init__(aclient, "rollout-bus-client")

    @property
    def address(self) -> str:
        return self._aclient.address

    def __enter__(self) -> Client:
        return self

    # generation
    generate = blocking(AsyncClient.generate)
    sample = blocking(AsyncClient.sample)
    stream = blocking_iter(AsyncClient.stream)
    cancel = blocking(AsyncClient.cancel)
    end_session = blocking(AsyncClient.end_session)
    # text
    text = blocking(AsyncClient.text)
    tokenize = blocking(AsyncClient.tokenize)
    detokenize = blocking(AsyncClient.detokenize)
    # queries
    health = blocking(AsyncClient.health)
    engines = blocking(AsyncClient.engines)
    health_view = blocking(AsyncClient.health_view)
    engine_views = blocking(AsyncClient.engine_views)
    stats = blocking(AsyncClient.stats)
    wait_ready = blocking(AsyncClient.wait_ready)
    # control plane
    control = blocking(AsyncClient.control)
    pause = blocking(AsyncClient.pause)
    resume = blocking(AsyncClient.resume)
    is_paused = blocking(AsyncClient.is_paused)
    sleep = blocking(AsyncClient.sleep)
    wake_up = blocking(AsyncClient.wake_up)
    reset_prefix_cache = blocking(AsyncClient.reset_prefix_cache)
    # weights
    update_weights = blocking(AsyncClient.update_weights)
    weight_update = facade(AsyncClient.weight_update, SyncWeightUpdate)
    weight_sender = blocking_wrapped(AsyncClient.weight_sender, SyncWeightSender)
    sync_stale = blocking(AsyncClient.sync_stale)
    load_lora = blocking(AsyncClient.load_lora)
    unload_lora = blocking(AsyncClient.unload_lora)

    @contextlib.contextmanager
    def paused(self, mode: str = "abort", *, lora: str | None = None) -> Iterator[Client]:
        """`with client.paused("abort"): client.update_weights(...)` — resumes
        even when the body raises."""
        self.pause(mode, lora=lora)
        try:
            yield self
        finally:
            self.resume(lora=lora)
