"""`AsyncClient`: generation, streaming, Tinker-style sampling, text, and the
weight paths, on top of the control plane (`control_port.ControlPort`) and
the head link (`connection.HeadLink`).

Its socket belongs to the asyncio loop that first used it. Each request has
one deadline timer, not one per chunk. Every wait has a deadline; a timeout
names the knob (`timeout_s`, `control_timeout_s`). Errors are typed and carry
the request id. Sampling params (a `SamplingParams` or a vLLM-style dict)
go through `trainer_bridge/sampling.py`, as on the SkyRL path.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import msgspec

from bus import protocol as P
from bus import roles
from bus.addresses import check_address
from bus.auth import KeyDir, find_token
from bus.errors import BadRequest, ProtocolError
from bus.frames import pack_tokens
from trainer_bridge.control_port import ControlPort, expect
from trainer_bridge.pacing import gather_or_cancel
from trainer_bridge.pipelined import update_paused
from trainer_bridge.sampling import for_request
from trainer_bridge.streams import (
    TIMED_OUT,
    SampleAssembler,
    at_client_cap,
    check_num_samples,
    final_error,
    is_batch,
    to_stream_chunk,
)
from trainer_bridge.text import Text, attach_text, is_text_prompt, load_text, to_ids
from trainer_bridge.types import GenerationResult, SampledSequence, SampleResponse, StreamChunk
from trainer_bridge.weights import WeightUpdate, join_update, push_weights


class AsyncClient(ControlPort):
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
        """`head_timeout_s`: nothing heard from the head for this long after its
        connection dropped (a dead head) ends every open request with
        HeadUnavailable; `head_stall_timeout_s`: the same while the connection
        stays up (a stopped or frozen head, which may come back with every
        stream intact); `connect_timeout_s`: a
        request that reached no head within this long does too;
        `ping_interval_s`: how often the client pings the head (its lease).
        `curve_dir`: the cluster's key folder (security on: its head.key is
        the server key); `client_key`: this client's key, a name in
        curve_dir/clients/ (default "default") or the path of a .key_secret
        file - its public key must be on the head's allow-list
        (docs/security.md). `tokenizer`: a Hugging Face tokenizer or a local model
        folder; without one, text/chat prompts load the tokenizer of the
        engines' model folder. `token_file`: the cluster's join token, needed
        by control ops that change the cluster (pause, updates, sleep, LoRA);
        None: $ROLLOUT_BUS_TOKEN_FILE, else the file launch.py published for
        `address` on this host (bus.auth.token_path_for); "": none."""
        found = find_token(address, token_file)
        super().__init__(
            check_address(address),  # a malformed one is refused here, not by zmq on first use
            curve=KeyDir(curve_dir).client(client_key) if curve_dir else None,
            # The token proves us at the handshake (bus/roles.py): the frontend
            # admits no one else once the head has one.
            plain=roles.as_role(found[0] if found else None, roles.CLIENT),
            head_timeout_s=head_timeout_s,
            connect_timeout_s=connect_timeout_s,
            ping_interval_s=ping_interval_s,
            head_stall_timeout_s=head_stall_timeout_s,
        )
        self._tokenizer_spec = tokenizer
        self._text: Text | None = None  # loaded on first use
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self._token = found[0] if found else ""
        self.token_file: str | None = found[1] if found else None  # where the join token came from
        # No token given and none found yet: a launcher on this host may publish
        # it after this client was made (a script that starts both): a refusal
        # for want of it looks again (_recover_refusal).
        self._token_may_appear = token_file is None and found is None

    def _recover_refusal(self, err: Any) -> bool:
        if not (self._token_may_appear and err.field == "token"):
            return False
        found = find_token(self.address)
        if found is None:
            return False
        self._token, self.token_file, self._token_may_appear = found[0], found[1], False
        plain = roles.as_role(found[0], roles.CLIENT)
        assert plain is not None
        self._reconnect_as(plain)
        return True

    # ------------------------------------------------------------ generation

    async def stream(
        self,
        prompt_ids: Sequence[int],
        params: P.SamplingParams | dict[str, Any] | None = None,
        *,
        num_samples: int | None = None,
        session_id: str | None = None,
        lora: str | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
        max_staleness: int | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Chunks as the engine produces them (per step, per sample). Ends
        after every sample's final chunk; raises the request's typed error.
        `num_samples` None: the params' `n`, else 1.
        `max_staleness=k`: a sample whose oldest token falls more than k weight
        versions behind is regenerated; a chunk whose `restarts` grew says
        "discard this sample's earlier tokens"."""
        tr = for_request(params, num_samples)
        async for ch, _ in self._chunks(
            prompt_ids,
            tr.params,
            tr.num_samples,
            session_id=session_id,
            lora=lora,
            timeout_s=timeout_s,
            request_id=request_id,
            max_staleness=max_staleness,
        ):
            yield ch

    async def _chunks(
        self,
        prompt_ids: Sequence[int],
        sp: P.SamplingParams,
        num_samples: int,
        *,
        session_id: str | None = None,
        lora: str | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
        max_staleness: int | None = None,
        _stream: bool = True,
    ) -> AsyncIterator[tuple[StreamChunk, list[list[int]]]]:
        check_num_samples(num_samples)
        rid = request_id or self._new_id()
        timeout = timeout_s or self.timeout_s
        msg = P.Generate(
            request_id=rid,
            params=sp,
            num_samples=num_samples,
            session_id=session_id,
            lora=lora,
            stream=_stream,
            timeout_s=timeout,
            max_staleness=max_staleness,
        )
        prompt = [pack_tokens(prompt_ids)]
        gate = self.inflight
        retry_until = time.monotonic() + timeout
        while True:  # once, unless the head refused it at its per-client cap before it started
            await gate.acquire(timeout, rid)
            st = self._open_stream(rid, timeout, num_samples)
            try:
                self._send(msg, prompt)
                st.sent = True
                while st.open_samples:
                    item, toks, rest = await st.queue.get()
                    if type(item) is not P.Chunk:
                        st.open_samples = 0  # a final answer (error, timeout, close): nothing left to cancel
                        if item is TIMED_OUT:
                            self._send(P.Cancel(request_id=rid))
                        if at_client_cap(item) and not st.received and time.monotonic() < retry_until:
                            break  # not the caller's error: sent again once a slot frees (trainer_bridge/pacing.py)
                        raise final_error(item, rid, timeout)
                    st.received = True
                    if item.finish_reason is not None:
                        st.open_samples -= 1
                    yield to_stream_chunk(rid, item, toks, rest), item.version_changes
                else:
                    return
            finally:
                self._close_stream(st)
                gate.release()
            await gate.refused()

    async def _collect(
        self, prompt_ids: Sequence[int], sp: P.SamplingParams, num_samples: int, **kw: Any
    ) -> GenerationResult:
        acc = SampleAssembler()
        rid = kw.pop("request_id", None) or self._new_id()
        async for ch, changes in self._chunks(prompt_ids, sp, num_samples, request_id=rid, _stream=False, **kw):
            acc.add(ch, changes)
        return acc.result(rid)

    async def generate(
        self,
        prompt_ids: Sequence[int] | Sequence[Sequence[int]] | str | list[dict[str, Any]],
        params: P.SamplingParams | dict[str, Any] | None = None,
        *,
        num_samples: int | None = None,
        session_id: str | None = None,
        lora: str | None = None,
        timeout_s: float | None = None,
        max_staleness: int | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """One prompt → a GenerationResult; a batch → a list in input order.
        A prompt is token ids, a string or a chat (a list of messages: the
        model's chat template); with a tokenizer, samples carry `text`.
        `num_samples` None: the params' `n` (vLLM's name), else 1.
        `max_staleness=k`: every sample's tokens come from at most k weight
        versions before the current one when it finished (regenerated
        otherwise; SampleOutput.restarts counts it)."""
        tr = for_request(params, num_samples)
        kw = dict(session_id=session_id, lora=lora, timeout_s=timeout_s, max_staleness=max_staleness)
        text = await self._text_for(prompt_ids)
        ids: Any = prompt_ids if text is None else to_ids(text, prompt_ids)
        out: Any
        if is_batch(ids):
            # Any batch size: the requests pace themselves under the head's
            # per-client cap (trainer_bridge/pacing.py); a failure cancels the rest.
            out = await gather_or_cancel(self._collect(p, tr.params, tr.num_samples, **kw) for p in ids)
        else:
            out = await self._collect(ids, tr.params, tr.num_samples, **kw)
        if text is None:
            return out
        return attach_text(
            out,
            text,
            skip_special_tokens=tr.params.skip_special_tokens,
            include_stop_str_in_output=tr.params.include_stop_str_in_output,
        )

    async def sample(
        self,
        prompt_ids: Sequence[int],
        num_samples: int,
        params: P.SamplingParams | dict[str, Any] | None = None,
        *,
        lora: str | None = None,
        timeout_s: float | None = None,
        max_staleness: int | None = None,
    ) -> SampleResponse:
        """Tinker semantics: num_samples sequences, each with tokens, logprobs
        and stop_reason "stop" or "length" (all samples share one engine)."""
        tr = for_request(params, num_samples)
        sp = msgspec.structs.replace(tr.params, logprobs=True)
        res = await self._collect(
            prompt_ids, sp, tr.num_samples, lora=lora, timeout_s=timeout_s, max_staleness=max_staleness
        )
        seqs = []
        for s in res.samples:
            if s.finish_reason not in ("stop", "length"):
                raise ProtocolError(f"sample {s.index} ended with {s.finish_reason!r}", request_id=res.request_id)
            seqs.append(SampledSequence(tokens=s.token_ids, logprobs=s.logprobs, stop_reason=s.finish_reason))
        return SampleResponse(sequences=seqs)

    async def cancel(self, request_id: str) -> None:
        """Ask for the request's end: its stream finishes with "cancelled"."""
        self._send(P.Cancel(request_id=request_id))

    # ------------------------------------------------------------ text

    async def text(self) -> Text:
        """The client's `trainer_bridge.text.Text` (tokenizer + chat template):
        the one given to the constructor, else the engines' model folder's."""
        if self._text is None:
            spec = self._tokenizer_spec
            if spec is None:
                models = [e.model for e in await self.engine_views() if os.path.isdir(e.model)]
                if not models:
                    raise BadRequest("no tokenizer given and no engine serves a local model folder", field="tokenizer")
                spec = models[0]
            self._text = load_text(spec)
        return self._text

    async def _text_for(self, prompt: Any) -> Text | None:
        if self._tokenizer_spec is None and self._text is None and not is_text_prompt(prompt):
            return None  # token-only traffic pays nothing
        return await self.text()

    async def tokenize(self, prompt: str | list[dict[str, Any]], *, add_special_tokens: bool = True) -> list[int]:
        """Text → ids (`add_special_tokens` as the tokenizer's), or a chat → its template's ids."""
        t = await self.text()
        return (
            t.encode(prompt, add_special_tokens=add_special_tokens) if isinstance(prompt, str) else t.prompt_ids(prompt)
        )

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Ids → text."""
        return (await self.text()).decode(token_ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------ weights

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        *,
        transport: str = "zmq",
        bucket_bytes: int | None = None,
        targets: list[str] | None = None,
        timeout_s: float | None = None,
        check_finite: bool = True,
        pause: str | None = None,
        **transport_options: Any,
    ) -> dict[str, P.WeightsCommitted]:
        """Push new weights into every engine: begin → buckets → commit (the
        head's two-phase commit). One update at a time: while another client's
        update holds the cluster this raises UpdateInProgress naming it.
        `check_finite`: engines refuse a NaN / inf value before their vote,
        naming the tensor (False skips the pass over the bytes). `named_tensors`: a list (planned: engines
        validate before any byte moves) or any iterable, e.g. a generator
        (streamed: buckets are packed and sent as tensors arrive, the trainer
        holds at most two buckets). All-or-nothing across the cluster: on any
        failure before the commit every engine keeps its old weights and
        version, and the error names the engine and tensor; an engine that
        misses the commit itself is reported stale by the head.
        `transport_options` go to the GPU transports (cuda_ipc, nccl).
        `pause` ("abort" | "keep"): pause every engine before and resume after,
        pipelined (sent back to back, awaited once; the resume always goes
        out): trainer_bridge/pipelined.py. A zero-copy cuda_ipc update whose
        layout the engines hold is ONE op (trainer_bridge/transports/one_trip.py)."""
        t = timeout_s or self.control_timeout_s

        def push(pipeline: Any = None) -> Any:
            # Not list(): a generator is streamed (packed as it yields).
            return push_weights(
                self,
                named_tensors,
                transport=transport,
                bucket_bytes=bucket_bytes,
                targets=targets,
                timeout_s=t,
                options=transport_options,
                check_finite=check_finite,
                pipeline=pipeline,
            )

        if pause is None:
            return await push()
        return await update_paused(self, pause, t, push)

    def weight_update(
        self,
        *,
        senders: int = 1,
        version: int | None = None,
        targets: list[str] | None = None,
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
        transport: str = "zmq",
        check_finite: bool = True,
        **transport_options: Any,
    ) -> WeightUpdate:
        """One update fed by several sender ranks (zmq, cuda_ipc or nccl: each
        rank delivers its own part, metas included), committed at once:
        `async with client.weight_update(senders=2) as upd:` then each rank
        `await upd.sender(rank).send(named_tensors)` (or, from its own
        process, `await client.weight_sender(upd.update_id, rank,
        sender_secret=upd.sender_secret)`: hand both to that process); leaving
        the block commits on every engine (version += 1 once), an exception
        (or a sender that failed or never finished) aborts everywhere."""
        return WeightUpdate(
            self,
            senders=senders,
            version=version,
            targets=targets,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s or self.control_timeout_s,
            transport=transport,
            options=transport_options,
            check_finite=check_finite,
        )

    async def weight_sender(
        self,
        update_id: str,
        rank: int,
        *,
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
        engines: list[str] | None = None,
        sender_secret: str = "",
        **transport_options: Any,
    ) -> Any:
        """Join update `update_id` (opened by another process) as sender `rank`.
        `sender_secret`: the update's (the coordinator's `upd.sender_secret`):
        engines take bytes for an update only from its senders.
        Over cuda_ipc use it as `async with`: its exit keeps this rank's buckets
        until the coordinator's commit round is over. `engines`: this rank
        feeds only these engines (colocated: the one on its own GPU; the
        others get its empty part)."""
        return await join_update(
            self,
            update_id,
            rank,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s or self.control_timeout_s,
            options=transport_options,
            engines=engines,
            sender_secret=sender_secret,
        )

    async def sync_stale(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        *,
        transport: str = "zmq",
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
        **transport_options: Any,
    ) -> dict[str, P.WeightsCommitted]:
        """Bring every STALE engine (below the cluster weight version: restarted
        from its checkpoint, joined late) up to date from the trainer's current
        tensors — the ones the cluster serves. Only the stale engines receive
        them; each ends at the cluster version (set, not incremented) and serves
        again. {} when none is stale. No pause needed: stale engines serve nothing."""
        h = await self.health_view()
        stale = list(h.stale or [eid for eid, e in h.engines.items() if e.stale])
        if not stale:
            return {}
        return await push_weights(
            self,
            list(named_tensors),
            transport=transport,
            bucket_bytes=bucket_bytes,
            targets=stale,
            timeout_s=timeout_s or self.control_timeout_s,
            options=transport_options,
            version=h.weight_version,
        )

    async def load_lora(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: Iterable[tuple[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
        targets: list[str] | None = None,
    ) -> dict[str, P.ConfigResult]:
        """Load (or replace in place) adapter `name` from a PEFT folder `path`
        or from `tensors` (PEFT names) + `config` (r, lora_alpha, target_modules).
        Per engine its adapter set after the op (a LoraResult; a WeightsCommitted
        when the tensors were staged)."""
        if (path is None) == (tensors is None):
            raise ValueError("load_lora takes exactly one of path= or tensors=")
        if path is not None:
            op = P.LoadLora(name=name, path=path, config=config or {})
            return dict(expect(await self.control(op, targets=targets), P.LoraResult))
        committed = await push_weights(
            self,
            list(tensors or ()),
            transport="zmq",
            bucket_bytes=None,
            targets=targets,
            timeout_s=self.control_timeout_s,
            options={},
            target=f"lora:{name}",
            extra_args={"lora_config": dict(config or {})},
        )
        return dict(committed)
