"""SkyRL's `InferenceEngineInterface` over the rollout-bus `AsyncClient`.

    from trainer_bridge.skyrl import RolloutBusEngine
    engine = await RolloutBusEngine.connect("tcp://HEAD:5555", tokenizer=tokenizer)
    generator = SkyRLGymGenerator(generator_cfg, skyrl_gym_cfg, engine, tokenizer)

The whole cluster is one engine to SkyRL (as its HTTP router client is): the
router spreads requests, keeps `session_ids` on one engine, and `finish_session`
releases them. Importable without skyrl (structural typing); when skyrl is
importable the class also subclasses its ABC (the newest `inference_servers`
one, else the older `inference_engines` one), and implements the methods of
both versions.

What maps where:

| SkyRL | rollout-bus |
| --- | --- |
| `generate(input_batch, model=)` | `generate` per prompt (`session_ids` → session affinity; `model` ≠ base → LoRA) |
| `sample(prompt_token_ids, num_samples, sampling_params)` | one request, `num_samples` samples (Tinker: "stop"/"length") |
| `chat_completion` / `completion` / `render_chat_completion` | OpenAI-shaped dicts in and out, over the bus (no HTTP) |
| `pause_generation` / `resume_generation` | `pause("keep")` / `resume()` |
| `abort_generation` | `pause("abort")`: requests are parked with their tokens, resumed by `resume_generation` (no "abort" reaches the generator) |
| `sleep` / `wake_up` / `reset_prefix_cache` | the same control ops |
| `init_weight_update_communicator` / `update_named_weights` | picks the transport / `update_weights` (tensors) or `load_lora` (`LoraLoadRequest`) |
| `tp_size` / `pp_size` / `dp_size` / `get_world_size` | from the engines' registration |
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from bus.errors import BadRequest, ProtocolError, Unsupported
from bus.frames import logprobs_wanted
from trainer_bridge.client import AsyncClient
from trainer_bridge.sampling import Translated, translate
from trainer_bridge.text import Text, load_text


def _skyrl_base() -> type:
    for mod in (
        "skyrl.backends.skyrl_train.inference_servers.base",
        "skyrl.backends.skyrl_train.inference_engines.base",
    ):
        with contextlib.suppress(Exception):
            return __import__(mod, fromlist=["InferenceEngineInterface"]).InferenceEngineInterface
    return object


InferenceEngineBase = _skyrl_base()

# SkyRL's init-info classes → rollout-bus transports (by class name: no skyrl import needed).
TRANSPORT_OF_INIT_INFO = {"BroadcastInitInfo": "nccl", "CudaIpcInitInfo": "cuda_ipc"}

# OpenAI request keys → vLLM-style sampling keys (None: not a sampling key).
OPENAI_KEYS: dict[str, str | None] = {
    "model": None,
    "messages": None,
    "prompt": None,
    "stream": None,
    "user": None,
    "max_completion_tokens": "max_tokens",
    "top_logprobs": None,  # folded into logprobs below
    "chat_template_kwargs": None,  # used by the chat template
    "add_generation_prompt": None,
}


class RolloutBusEngine(InferenceEngineBase):  # type: ignore[misc,valid-type]
    def __init__(
        self,
        client: AsyncClient | str,
        *,
        tokenizer: Any = None,
        model_name: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        engines: list[dict[str, Any]] | None = None,
    ) -> None:
        """`client`: an AsyncClient or the head's address (then owned and
        closed by `teardown`). `tokenizer`: object or local folder (default:
        the engines' model folder). `sampling_params`: used when a batch has
        none. `engines`: the cluster's engine list (`connect` fetches it)."""
        self._owns_client = isinstance(client, str)
        self._client = AsyncClient(client) if isinstance(client, str) else client
        self._text: Text | None = load_text(tokenizer) if tokenizer is not None else None
        self._model_name = model_name
        self.default_sampling_params = dict(sampling_params or {})
        self._engines = engines
        self._transport = "zmq"
        self._transport_options: dict[str, Any] = {}
        self._weight_version = 0

    @property
    def client(self) -> AsyncClient:
        """The AsyncClient. An owned one whose event loop has closed (SkyRL
        calls `asyncio.run` more than once) is replaced by a fresh one."""
        loop = self._client._loop
        if self._owns_client and loop is not None and loop.is_closed():
            old = self._client
            self._client = _fresh(_options(old))
            old._closed = True
            if old._sock is not None:
                old._sock.close(linger=0)
                old._ctx.term()  # type: ignore[union-attr]
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        """Pickles by address (SkyRL hands its client to Ray workers): the copy
        opens its own connection."""
        state = dict(self.__dict__)
        state["_client"] = _options(state["_client"])
        state["_owns_client"] = True
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client = _fresh(state["_client"])

    @property
    def weight_version(self) -> int:
        """SkyRL's policy version counter (it keys prefix-cache salts on it)."""
        return self._weight_version

    def increment_weight_version(self) -> None:
        self._weight_version += 1

    @classmethod
    async def connect(
        cls, client: AsyncClient | str, *, num_engines: int = 1, timeout_s: float = 120.0, **kw: Any
    ) -> RolloutBusEngine:
        """Wait for `num_engines` healthy engines and learn the topology."""
        self = cls(client, **kw)
        await self.client.wait_ready(num_engines, timeout_s)
        await self.refresh()
        return self

    async def refresh(self) -> list[dict[str, Any]]:
        self._engines = [e for e in await self.client.engines() if e["healthy"]]
        return self._engines

    # ------------------------------------------------------------ identity / topology

    @property
    def model_name(self) -> str:
        if self._model_name:
            return self._model_name
        if self._engines:
            return self._engines[0]["model"]
        return self._text.name if self._text else ""

    def get_endpoint_url(self) -> str:
        """The head's bus address: rollout-bus has no HTTP endpoint."""
        return self.client.address

    def _topology(self) -> list[dict[str, Any]]:
        if not self._engines:
            raise BadRequest(
                "topology unknown: build the engine with `await RolloutBusEngine.connect(...)` or call `await refresh()`",
                field="engines",
            )
        return self._engines

    def tp_size(self) -> int:
        return max(e["tp"] for e in self._topology())

    def pp_size(self) -> int:
        return max(e["pp"] for e in self._topology())

    def dp_size(self) -> int:
        """Each engine node is one data-parallel replica (times its own dp)."""
        return sum(e["dp"] for e in self._topology())

    async def get_world_size(self) -> tuple[int, int]:
        """(workers over all engines, workers per engine)."""
        engines = self._engines or await self.refresh()
        per = [e["tp"] * e["pp"] * e["dp"] for e in engines]
        return sum(per), max(per)

    # ------------------------------------------------------------ text

    async def _tok(self) -> Text:
        if self._text is None:
            self._text = await self.client.text()
        return self._text

    # ------------------------------------------------------------ generation

    def _translate(self, sampling_params: Mapping[str, Any] | None) -> Translated:
        sp = sampling_params if sampling_params is not None else self.default_sampling_params
        return translate(sp, prefix="sampling_params.")

    def _lora(self, model: str | None) -> str | None:
        return model if model and model != self.model_name else None

    async def _one(self, ids: list[int], tr: Translated, session_id: Hashable | None, lora: str | None) -> Any:
        return await self.client.generate(
            ids,
            tr.params,
            num_samples=tr.num_samples,
            session_id=None if session_id is None else str(session_id),
            lora=lora,
        )

    async def generate(self, input_batch: Mapping[str, Any], model: str | None = None) -> dict[str, Any]:
        prompts, ids = input_batch.get("prompts"), input_batch.get("prompt_token_ids")
        if (prompts is None) == (ids is None):
            raise BadRequest("give exactly one of prompts / prompt_token_ids", field="prompt_token_ids")
        if input_batch.get("mm_features"):
            raise Unsupported("multi-modal inputs are not served by rollout-bus", field="mm_features")
        tr = self._translate(input_batch.get("sampling_params"))
        text = await self._tok()
        if prompts is not None:
            ids = [text.chat(p) for p in prompts]
        assert ids is not None  # exactly one of the two was given (checked above)
        sessions = input_batch.get("session_ids") or [None] * len(ids)
        if len(sessions) != len(ids):
            raise BadRequest(f"{len(sessions)} session_ids for {len(ids)} prompts", field="session_ids")
        lora = self._lora(model)
        # cache_salt only scopes vLLM's prefix-cache sharing; outputs do not depend on it.
        results = await asyncio.gather(*(self._one(list(p), tr, s, lora) for p, s in zip(ids, sessions, strict=True)))
        samples = [s for r in results for s in r.samples]  # prompt-major, like vLLM's n
        return self._output(samples, text, tr)

    @staticmethod
    def _output(samples: Sequence[Any], text: Text, tr: Translated) -> dict[str, Any]:
        logprobs = logprobs_wanted(tr.params.logprobs)
        return {
            # A stop-string request's text comes from the engine, cut as vLLM cuts it.
            "responses": [
                s.text if s.text is not None else text.decode(s.token_ids, skip_special_tokens=tr.skip_special_tokens)
                for s in samples
            ],
            "response_ids": [list(s.token_ids) for s in samples],
            "stop_reasons": [s.finish_reason for s in samples],
            "response_logprobs": [list(s.logprobs or []) for s in samples] if logprobs else None,
            # Per sample: each prompt token's logprob given its prefix (None for the first).
            "prompt_logprobs": [s.prompt_logprobs for s in samples] if tr.params.prompt_logprobs is not None else None,
            "rollout_expert_indices": None,
        }

    async def sample(
        self, prompt_token_ids: Sequence[int], num_samples: int, sampling_params: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """Tinker semantics: `num_samples` samples of one prompt (one request,
        one engine), stop reasons "stop" or "length" only."""
        sp = dict(sampling_params if sampling_params is not None else self.default_sampling_params)
        if sp.pop("n", num_samples) != num_samples:
            raise BadRequest("sampling_params.n disagrees with num_samples", field="sampling_params.n")
        tr = self._translate(sp)
        tr.num_samples = num_samples
        tr.params = msgspec.structs.replace(tr.params, logprobs=True)  # Tinker: every sequence has logprobs
        res = await self._one(list(prompt_token_ids), tr, None, None)
        for s in res.samples:
            if s.finish_reason not in ("stop", "length"):
                raise ProtocolError(f"sample {s.index} ended with {s.finish_reason!r}", request_id=res.request_id)
        return self._output(res.samples, await self._tok(), tr)

    # ------------------------------------------------------------ OpenAI-shaped, over the bus

    def _openai_params(self, body: Mapping[str, Any], chat: bool) -> Translated:
        sp: dict[str, Any] = {}
        for k, v in body.items():
            if k in OPENAI_KEYS:
                if name := OPENAI_KEYS[k]:
                    sp[name] = v
            else:
                sp[k] = v
        if body.get("stream"):
            raise Unsupported("stream=true: use AsyncClient.stream for streaming", field="stream")
        if chat:  # chat: logprobs is a bool, top_logprobs the k
            sp["logprobs"] = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
        elif body.get("echo"):
            raise Unsupported("echo needs prompt logprobs (issue 10, server-side)", field="echo")
        sp.pop("echo", None)
        if sp.get("max_tokens") is None:
            raise BadRequest("max_tokens (or max_completion_tokens) is required", field="max_tokens")
        return translate(sp)

    @staticmethod
    def _body(request_payload: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
        body = dict(request_payload.get("json", request_payload))
        return body.pop("session_id", None), body

    async def chat_completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        """`{"json": <OpenAI chat request>}` → an OpenAI chat.completion dict
        (plus `token_ids` / `prompt_token_ids`, as vLLM's `return_token_ids`)."""
        session_id, body = self._body(request_payload)
        tr = self._openai_params(body, chat=True)
        text = await self._tok()
        ids = text.chat(
            body.get("messages") or [],
            add_generation_prompt=body.get("add_generation_prompt", True),
            **(body.get("chat_template_kwargs") or {}),
        )
        res = await self._one(ids, tr, session_id, self._lora(body.get("model")))
        choices = []
        for s in res.samples:
            content = (
                s.text if s.text is not None else text.decode(s.token_ids, skip_special_tokens=tr.skip_special_tokens)
            )
            lp = None
            if logprobs_wanted(tr.params.logprobs):

                def tops(i: int, s: Any = s) -> list[dict[str, Any]]:
                    if s.top_ids is None or s.top_logprobs is None:
                        return []
                    return [
                        {"token": text.decode([t], skip_special_tokens=False), "logprob": x, "bytes": None}
                        for t, x in zip(s.top_ids[i], s.top_logprobs[i], strict=True)
                    ]

                lp = {"content": [
                    {"token": text.decode([t], skip_special_tokens=False), "logprob": x, "bytes": None, "top_logprobs": tops(i)}
                    for i, (t, x) in enumerate(zip(s.token_ids, s.logprobs or [], strict=False))
                ]}  # fmt: skip
            choices.append({
                "index": s.index, "message": {"role": "assistant", "content": content}, "finish_reason": s.finish_reason,
                "logprobs": lp, "token_ids": list(s.token_ids),
            })  # fmt: skip
        return self._openai_reply("chat.completion", body, res, ids, choices)

    async def completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        """`{"json": <OpenAI completion request>}` → a text_completion dict;
        `prompt` may be text, token ids, or a list of either."""
        session_id, body = self._body(request_payload)
        tr = self._openai_params(body, chat=False)
        text = await self._tok()
        prompt: Any = body.get("prompt")
        batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts = [text.prompt_ids(p) for p in (prompt if batch else [prompt])]
        lora = self._lora(body.get("model"))
        results = await asyncio.gather(*(self._one(p, tr, session_id, lora) for p in prompts))
        choices: list[dict[str, Any]] = []
        for r in results:
            for s in r.samples:
                lp = None
                if logprobs_wanted(tr.params.logprobs):
                    toks = [text.decode([t], skip_special_tokens=False) for t in s.token_ids]
                    lp = {
                        "tokens": toks,
                        "token_logprobs": list(s.logprobs or []),
                        "top_logprobs": None,
                        "text_offset": None,
                    }
                choices.append({
                    "index": len(choices),
                    "text": s.text if s.text is not None else text.decode(s.token_ids, skip_special_tokens=tr.skip_special_tokens),
                    "finish_reason": s.finish_reason, "logprobs": lp, "token_ids": list(s.token_ids),
                })  # fmt: skip
        return self._openai_reply("text_completion", body, results[0], [t for p in prompts for t in p], choices)

    async def render_chat_completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        """Apply the chat template and tokenize, without generating."""
        _, body = self._body(request_payload)
        text = await self._tok()
        ids = text.chat(
            body.get("messages") or [],
            add_generation_prompt=body.get("add_generation_prompt", True),
            **(body.get("chat_template_kwargs") or {}),
        )
        return {"token_ids": ids, "prompt": text.decode(ids, skip_special_tokens=False), "features": None}

    def _openai_reply(
        self, kind: str, body: Mapping[str, Any], res: Any, prompt_ids: list[int], choices: list[dict]
    ) -> dict[str, Any]:
        n_out = sum(len(c["token_ids"]) for c in choices)
        return {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{res.request_id}",
            "object": kind,
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": choices,
            "prompt_token_ids": prompt_ids,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": n_out,
                "total_tokens": len(prompt_ids) + n_out,
            },
        }

    # ------------------------------------------------------------ sessions

    async def finish_session(self, session_id: Hashable) -> None:
        """Release the session's engine (best effort: never raises, like SkyRL's)."""
        if session_id is None or session_id == "":
            return
        with contextlib.suppress(Exception):
            await self.client.end_session(str(session_id))

    # ------------------------------------------------------------ control plane

    async def pause_generation(self, clear_cache: bool = False) -> dict[str, Any]:
        """Freeze in-flight requests with their KV (`pause("keep")`)."""
        out = await self.client.pause("keep")
        if clear_cache:
            await self.client.reset_prefix_cache()
        return out

    async def abort_generation(self) -> dict[str, Any]:
        """Stop every running request now, freeing the engines (`pause("abort")`):
        each is parked with its tokens and continues on `resume_generation`,
        so no caller sees an aborted or truncated output."""
        return await self.client.pause("abort")

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> dict[str, Any]:
        out = await self.client.pause(getattr(mode, "value", mode))
        if clear_cache:
            await self.client.reset_prefix_cache()
        return out

    async def resume_generation(self) -> dict[str, Any]:
        return await self.client.resume()

    resume = resume_generation

    async def sleep(self, level: int = 1, tags: list[str] | None = None, **_: Any) -> dict[str, Any]:
        if tags:
            raise Unsupported("sleep by tags: rollout-bus sleeps whole engines (wake_up takes tags)", field="tags")
        return await self.client.sleep(level)

    async def wake_up(self, tags: list[str] | None = None, **_: Any) -> dict[str, Any]:
        return await self.client.wake_up(tags)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> dict[str, Any]:
        return await self.client.reset_prefix_cache()

    async def init_weight_update_communicator(self, init_info: Any) -> dict[str, Any]:
        """Pick the transport from SkyRL's init info (NCCL broadcast → "nccl",
        CUDA IPC → "cuda_ipc", anything else → "zmq"). NCCL: the group is set
        up here, with every healthy engine (gpu_transports.warm_up_nccl), so the
        first update does not pay for it; the other transports need no set-up."""
        self._transport = getattr(init_info, "transport", None) or TRANSPORT_OF_INIT_INFO.get(
            type(init_info).__name__, "zmq"
        )
        if isinstance(init_info, Mapping):
            self._transport = init_info.get("transport", self._transport)
            self._transport_options = dict(init_info.get("options", {}))
        out: dict[str, Any] = {"transport": self._transport}
        if self._transport == "nccl":
            # The NCCL group is set up now, not inside the first update (an empty
            # transaction the engines join the group in; gpu_transports.warm_up_nccl).
            from trainer_bridge.gpu_transports import warm_up_nccl

            out["warm_up"] = await warm_up_nccl(self.client, self._transport_options)
        return out

    async def update_named_weights(self, request: Any) -> dict[str, Any]:
        """`request`: a SkyRL `LoraLoadRequest` (→ `load_lora`), or tensors: an
        object with `names` + `tensors` (SkyRL's `WeightChunk`), a
        `{name: tensor}` mapping or `(name, tensor)` pairs (→ `update_weights`
        over the chosen transport, all engines, all-or-nothing)."""
        if getattr(request, "lora_path", ""):
            return await self.client.load_lora(getattr(request, "lora_name", "") or "default", path=request.lora_path)
        named = _named_tensors(request)
        return await self.client.update_weights(named, transport=self._transport, **self._transport_options)

    async def teardown(self) -> None:
        if self._owns_client:
            await self.client.close()


def _options(c: AsyncClient) -> dict[str, Any]:
    """What it takes to open the same connection again (CURVE keys included)."""
    return {"address": c.address, "timeout_s": c.timeout_s, "control_timeout_s": c.control_timeout_s, "curve": c._curve}


def _fresh(options: dict[str, Any]) -> AsyncClient:
    o = dict(options)
    curve = o.pop("curve")
    c = AsyncClient(o.pop("address"), **o)
    c._curve = curve
    return c


def _named_tensors(request: Any) -> list[tuple[str, Any]]:
    if hasattr(request, "tensors") and hasattr(request, "names"):
        return list(zip(request.names, request.tensors, strict=True))
    if isinstance(request, Mapping):
        return list(request.items())
    if isinstance(request, Iterable) and not isinstance(request, (str, bytes)):
        return list(request)
    raise Unsupported(
        f"{type(request).__name__} carries no tensors: SkyRL's NCCL/IPC requests move bytes through SkyRL's own "
        "sender; rollout-bus moves them itself: pass the tensors (a WeightChunk, a dict or (name, tensor) pairs)",
        field="request",
    )
