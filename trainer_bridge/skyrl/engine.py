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
| `generate(input_batch, model=)` | `generate` per prompt (`session_ids` → session affinity; `model` = a loaded LoRA's name → that LoRA, the base model's names → the base model, any other → BadRequest; `cache_salt` → vLLM's prefix-cache salt) |
| `sample({"json": tinker_body})` / `sample(prompt_token_ids, num_samples, sampling_params)` | one request, `num_samples` samples (Tinker: "stop"/"length") |
| `chat_completion` / `completion` / `render_chat_completion` | OpenAI-shaped dicts in and out, over the bus (no HTTP) |
| `pause_generation` / `resume_generation` | `pause("keep")` / `resume()` |
| `abort_generation` | `pause("abort")`: requests are parked with their tokens, resumed by `resume_generation` (no "abort" reaches the generator) |
| `sleep` (level 2 by default, as SkyRL's client) / `wake_up` / `reset_prefix_cache` | the same control ops |
| `start_weight_update` / `update_weights_ipc` / `finish_weight_update` | SkyRL's CUDA IPC sender: chunks collected, one all-or-nothing update at finish |
| `init_weight_update_communicator(BroadcastInitInfo)` | every engine worker joins SkyRL's own vLLM NCCL group (rank_offset + the workers before it), vllm backend only (skyrl/broadcast.py) |
| `start_weight_update` / `update_weights_nccl` / `finish_weight_update` | SkyRL's broadcast sender: one begin whose receive takes its packed broadcast into staging, the commit at finish (version + 1, all-or-nothing) |
| a GPU strategy without CUDA / engines off the vllm backend | Unsupported naming `weight_sync_backend`, saying what to set instead |
| `get_endpoint_url` | `endpoint_url=` if given, else Unsupported (no HTTP endpoint) |
| `aclose` / `teardown` | close an owned client (the next call reopens it) |
| `init_weight_update_communicator` / `update_named_weights` | picks the transport / `update_weights` (tensors) or `load_lora` (`LoraLoadRequest`) |
| `tp_size` / `pp_size` / `dp_size` / `get_world_size` | from the engines' registration |
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import msgspec

from bus.errors import BadRequest, ProtocolError, Unsupported
from bus.frames import logprobs_wanted
from trainer_bridge.client import AsyncClient
from trainer_bridge.sampling import Translated, for_request, translate
from trainer_bridge.skyrl import broadcast as broadcast
from trainer_bridge.skyrl.chunks import has_cuda, named_tensors, unpack_ipc_chunk
from trainer_bridge.skyrl.models import base_aliases, pick_model
from trainer_bridge.skyrl.openai import (
    chat_choices,
    completion_choices,
    openai_params,
    openai_reply,
    request_body,
    text_of,
)
from trainer_bridge.skyrl.tinker import tinker_reply, tinker_request
from trainer_bridge.text import Text, load_text
from trainer_bridge.transports.nccl import warm_up_nccl


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
TRANSPORT_OF_INIT_INFO = {"BroadcastInitInfo": "vllm_nccl", "CudaIpcInitInfo": "cuda_ipc"}

# What each SkyRL weight_sync_backend needs; the error for a machine without it.
_NO_CUDA = (
    "SkyRL's own weight sync ({info}: its CUDA IPC or vLLM NCCL broadcast strategy) moves CUDA tensors and "
    "this trainer has no CUDA device: "
    "on CPU set generator.inference_engine.weight_sync_backend to anything but 'nccl' and send the weights "
    "with rollout-bus's zmq transport (trainer_bridge.skyrl.weights.get_transfer_strategy_cls in place of "
    "SkyRL's, or engine.update_named_weights(tensors))"
)


class RolloutBusEngine(InferenceEngineBase):  # type: ignore[misc,valid-type]
    def __init__(
        self,
        client: AsyncClient | str,
        *,
        tokenizer: Any = None,
        model_name: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        engines: list[dict[str, Any]] | None = None,
        endpoint_url: str | None = None,
        weight_timeout_s: float = 300.0,
    ) -> None:
        """`client`: an AsyncClient or the head's address (then owned and
        closed by `teardown`). `tokenizer`: object or local folder (default:
        the engines' model folder). `model_name`: the name SkyRL's config uses
        for the policy (its `model=` on every call means the base model; only
        the name of a loaded LoRA adapter routes to that adapter); default: the
        engines' `--model`. `sampling_params`: used when a batch has none.
        `engines`: the cluster's engine list (`connect` fetches it).
        `endpoint_url`: the base URL of an OpenAI-compatible HTTP server you run
        in front of this cluster, if any (what `get_endpoint_url` returns).
        `weight_timeout_s`: how long SkyRL's broadcast may take to join / to
        arrive (its NCCL group's store timeout and the begin's deadline)."""
        self._owns_client = isinstance(client, str)
        self._client = AsyncClient(client) if isinstance(client, str) else client
        self._text: Text | None = load_text(tokenizer) if tokenizer is not None else None
        self._model_name = model_name
        self.default_sampling_params = dict(sampling_params or {})
        self._engines = engines
        self._transport = "zmq"
        self._transport_options: dict[str, Any] = {}
        self._weight_version = 0
        self._endpoint_url = endpoint_url
        self._update: Any = None  # the open weight update (start_weight_update .. finish_weight_update)
        self._update_named: list[tuple[str, Any]] = []
        self.weight_timeout_s = float(weight_timeout_s)
        self._broadcast: broadcast.BroadcastGroup | None = None  # SkyRL's NCCL group, once joined

    @property
    def client(self) -> AsyncClient:
        """The AsyncClient. An owned one whose event loop has closed (SkyRL
        calls `asyncio.run` more than once) or that `aclose` closed is
        replaced by a fresh one."""
        loop = self._client._loop
        if self._owns_client and self._client._closed:
            self._client = _fresh(_options(self._client))
        elif self._owns_client and loop is not None and loop.is_closed():
            old = self._client
            self._client = _fresh(_options(old))
            old._closed = True
            if old._sock is not None:
                # Every socket of its context first (the handshake monitor too),
                # else term() waits for the open one forever.
                if old._monitor is not None:
                    old._monitor.close(linger=0)
                    old._monitor = None
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

    def _loaded_loras(self) -> set[str]:
        return {n for e in self._engines or () for n in e.get("loras", ())}

    # ------------------------------------------------------------ identity / topology

    @property
    def model_name(self) -> str:
        if self._model_name:
            return self._model_name
        if self._engines:
            return self._engines[0]["model"]
        return self._text.name if self._text else ""

    def get_endpoint_url(self) -> str:
        """SkyRL: the base URL of the OpenAI-compatible HTTP data plane that
        generators hand to external HTTP clients (LiteLLM's OPENAI_BASE_URL).
        rollout-bus serves over ZeroMQ, not HTTP: a `tcp://` address there
        would fail later inside the HTTP client with no word about why, so
        this returns `endpoint_url=` when given and otherwise raises
        Unsupported naming it. `chat_completion` / `completion` serve the same
        requests over the bus; `client.address` is the bus address."""
        if self._endpoint_url:
            return self._endpoint_url
        raise Unsupported(
            "rollout-bus has no HTTP endpoint (it serves over ZeroMQ at "
            f"{self.client.address}): call chat_completion/completion on this engine, or pass "
            "endpoint_url= (an OpenAI-compatible server you run in front of the cluster)",
            field="endpoint_url",
        )

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

    async def _lora(self, model: str | None) -> str | None:
        """SkyRL passes its policy's name as `model` on every call: the base
        model's (model_name=, the engines' --model) or a loaded LoRA adapter's
        (that adapter serves it); any other name is refused, listing what is
        served (trainer_bridge/skyrl/models.py). A name not known yet is asked
        of the head once (the engines may have loaded it since `connect`)."""
        try:
            return pick_model(model, base_aliases(self._model_name, self._engines), self._loaded_loras())
        except BadRequest:
            await self.refresh()
            return pick_model(model, base_aliases(self._model_name, self._engines), self._loaded_loras())

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
        if input_batch.get("cache_salt") is not None:  # SkyRL: a top-level field; vLLM's prefix-cache salt
            tr.params = msgspec.structs.replace(tr.params, cache_salt=str(input_batch["cache_salt"]))
        text = await self._tok()
        if prompts is not None:
            ids = [text.chat(p) for p in prompts]
        assert ids is not None  # exactly one of the two was given (checked above)
        sessions = input_batch.get("session_ids") or [None] * len(ids)
        if len(sessions) != len(ids):
            raise BadRequest(f"{len(sessions)} session_ids for {len(ids)} prompts", field="session_ids")
        lora = await self._lora(model)
        results = await asyncio.gather(*(self._one(list(p), tr, s, lora) for p, s in zip(ids, sessions, strict=True)))
        samples = [s for r in results for s in r.samples]  # prompt-major, like vLLM's n
        return self._output(samples, text, tr)

    @staticmethod
    def _output(samples: Sequence[Any], text: Text, tr: Translated) -> dict[str, Any]:
        logprobs = logprobs_wanted(tr.params.logprobs)
        return {
            # Decoded from the returned ids (cut at a stop string as asked): text.output_text.
            "responses": [text_of(s, text, tr) for s in samples],
            "response_ids": [list(s.token_ids) for s in samples],
            "stop_reasons": [s.finish_reason for s in samples],
            "response_logprobs": [list(s.logprobs or []) for s in samples] if logprobs else None,
            # Per sample: each prompt token's logprob given its prefix (None for the first).
            "prompt_logprobs": [s.prompt_logprobs for s in samples] if tr.params.prompt_logprobs is not None else None,
            "rollout_expert_indices": None,
        }

    async def sample(
        self,
        prompt_token_ids: Sequence[int] | Mapping[str, Any],
        num_samples: int | None = None,
        sampling_params: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Tinker semantics: `num_samples` samples of one prompt (one request,
        one engine), stop reasons "stop" or "length" only. Two forms:
        SkyRL 0.3.0's `sample({"json": body})` (its RemoteInferenceClient's:
        body = {model, prompt: {chunks: [...]}, num_samples, sampling_params
        (Tinker's), session_id, include_prompt_logprobs, topk_prompt_logprobs})
        returns its SampleResponse dict; the project's own
        `sample(ids, num_samples, vllm_style_params)` returns generate's dict."""
        if isinstance(prompt_token_ids, Mapping):
            return await self._sample_tinker(prompt_token_ids)
        if num_samples is None:
            raise BadRequest("num_samples is required with prompt token ids", field="num_samples")
        sp = sampling_params if sampling_params is not None else self.default_sampling_params
        tr = for_request(sp, num_samples, prefix="sampling_params.")  # as AsyncClient.sample: n must agree
        tr.params = msgspec.structs.replace(tr.params, logprobs=True)  # Tinker: every sequence has logprobs
        res = await self._one(list(prompt_token_ids), tr, None, None)
        for s in res.samples:
            if s.finish_reason not in ("stop", "length"):
                raise ProtocolError(f"sample {s.index} ended with {s.finish_reason!r}", request_id=res.request_id)
        return self._output(res.samples, await self._tok(), tr)

    async def _sample_tinker(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        # Tinker's session_id names a sampling session (every sample of one
        # sampling client), not a conversation, and nothing ever ends it: as a
        # head session it would pin them all on one engine and stay on the
        # head for its session_ttl_s. Each sample is placed on its own.
        _, body = request_body(request_payload)
        req = tinker_request(body)
        res = await self._one(req.ids, req.tr, None, await self._lora(body.get("model")))
        return tinker_reply(req, res)

    # ------------------------------------------------------------ OpenAI-shaped, over the bus

    async def _default_max_tokens(
        self, tr: Translated, prompt_len: int, body: Mapping[str, Any], field: str
    ) -> Translated:
        """No max_tokens / max_completion_tokens: vLLM's server generates up to
        the context limit, max_model_len - prompt length; so does this (the
        engines report max_model_len when they register)."""
        if body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None:
            return tr
        limits = [int(e.get("max_model_len") or 0) for e in self._engines or await self.refresh()]
        limit = min((x for x in limits if x > 0), default=0)
        if limit <= 0:
            raise BadRequest(
                "max_tokens is required: the engines did not report max_model_len",
                field="max_tokens",
            )
        if prompt_len >= limit:
            raise BadRequest(f"prompt ({prompt_len}) fills max_model_len={limit}", field=field)
        tr.params = msgspec.structs.replace(tr.params, max_tokens=limit - prompt_len)
        return tr

    async def chat_completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        """`{"json": <OpenAI chat request>}` → an OpenAI chat.completion dict
        (plus `token_ids` / `prompt_token_ids`, as vLLM's `return_token_ids`)."""
        session_id, body = request_body(request_payload)
        tr = openai_params(body, chat=True)
        text = await self._tok()
        ids = text.chat(
            body.get("messages") or [],
            add_generation_prompt=body.get("add_generation_prompt", True),
            **(body.get("chat_template_kwargs") or {}),
        )
        tr = await self._default_max_tokens(tr, len(ids), body, "messages")
        res = await self._one(ids, tr, session_id, await self._lora(body.get("model")))
        return openai_reply("chat.completion", body, res, ids, chat_choices(res.samples, text, tr), self.model_name)

    async def completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        """`{"json": <OpenAI completion request>}` → a text_completion dict;
        `prompt` may be text, token ids, or a list of either."""
        session_id, body = request_body(request_payload)
        tr = openai_params(body, chat=False)
        text = await self._tok()
        prompt: Any = body.get("prompt")
        batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts = [text.prompt_ids(p) for p in (prompt if batch else [prompt])]
        tr = await self._default_max_tokens(tr, max(len(p) for p in prompts), body, "prompt")
        lora = await self._lora(body.get("model"))
        results = await asyncio.gather(*(self._one(p, tr, session_id, lora) for p in prompts))
        choices = completion_choices(results, text, tr)
        return openai_reply(
            "text_completion", body, results[0], [t for p in prompts for t in p], choices, self.model_name
        )

    async def render_chat_completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        """Apply the chat template and tokenize, without generating."""
        _, body = request_body(request_payload)
        text = await self._tok()
        ids = text.chat(
            body.get("messages") or [],
            add_generation_prompt=body.get("add_generation_prompt", True),
            **(body.get("chat_template_kwargs") or {}),
        )
        return {"token_ids": ids, "prompt": text.decode(ids, skip_special_tokens=False), "features": None}

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

    async def sleep(self, level: int = 2, tags: list[str] | None = None, **_: Any) -> dict[str, Any]:
        """Level 2 by default, as SkyRL's client (its colocated loop re-syncs
        the weights before `wake_up(tags=["kv_cache"])`); level 1 keeps them."""
        if tags:
            raise Unsupported("sleep by tags: rollout-bus sleeps whole engines (wake_up takes tags)", field="tags")
        return await self.client.sleep(level)

    async def wake_up(self, tags: list[str] | None = None, **_: Any) -> dict[str, Any]:
        return await self.client.wake_up(tags)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> dict[str, Any]:
        return await self.client.reset_prefix_cache()

    async def init_weight_update_communicator(self, init_info: Any) -> dict[str, Any]:
        """Pick the transport from SkyRL's init info (CUDA IPC → "cuda_ipc",
        rollout-bus's own strategy's info → its transport, anything else →
        "zmq"). NCCL: the group is set up here, with every healthy engine
        (trainer_bridge.transports.nccl.warm_up_nccl), so the first update does not pay for it;
        SkyRL's BroadcastInitInfo: every engine worker joins SkyRL's own group
        (skyrl/broadcast.join; SkyRL's create_sender joins rank 0 meanwhile);
        the other transports need no set-up. A GPU transport on a machine
        without CUDA, or SkyRL's group with engines that are not on the vllm
        backend, is refused with an Unsupported naming weight_sync_backend."""
        kind = type(init_info).__name__
        transport = getattr(init_info, "transport", None) or TRANSPORT_OF_INIT_INFO.get(kind, "zmq")
        if isinstance(init_info, Mapping):
            transport = init_info.get("transport", transport)
            self._transport_options = dict(init_info.get("options", {}))
        if transport in ("nccl", "cuda_ipc", "vllm_nccl") and not has_cuda():
            raise Unsupported(_NO_CUDA.format(info=kind), field="weight_sync_backend")
        if kind == "BroadcastInitInfo":
            engines = await broadcast.updatable_engines(self.client)
            broadcast.check_backends(engines)
            self._broadcast = broadcast.group_of(init_info, engines, self.weight_timeout_s)
            self._transport = transport
            return {"transport": transport, "joined": await broadcast.join(self.client, self._broadcast)}
        self._transport = transport
        out: dict[str, Any] = {"transport": self._transport}
        if self._transport == "nccl":
            # The NCCL group is set up now, not inside the first update (an empty
            # transaction the engines join the group in; transports.nccl.warm_up_nccl).
            out["warm_up"] = await warm_up_nccl(self.client, self._transport_options)
        return out

    async def update_named_weights(self, request: Any) -> dict[str, Any]:
        """`request`: a SkyRL `LoraLoadRequest` (→ `load_lora`), or tensors: an
        object with `names` + `tensors` (SkyRL's `WeightChunk`), a
        `{name: tensor}` mapping or `(name, tensor)` pairs (→ `update_weights`
        over the chosen transport, all engines, all-or-nothing)."""
        if getattr(request, "lora_path", ""):
            out = await self.client.load_lora(getattr(request, "lora_name", "") or "default", path=request.lora_path)
            await self.refresh()  # its name routes to it from now on (_lora)
            return out
        named = named_tensors(request)
        return await self.client.update_weights(named, transport=self._transport, **self._transport_options)

    # ------------------------------------------------------------ SkyRL's chunked update
    #
    # SkyRL 0.3.0's own senders call, on rank 0: start_weight_update, then
    # CudaIpcWeightTransferSender: one update_weights_ipc per chunk (a packed
    # buffer shared by IPC handle, freed when the call returns): the chunks
    # are copied here and pushed at finish as ONE all-or-nothing update
    # (every engine, version + 1) over the transport init_weight_update_communicator
    # chose; rank 0 holds one copy of the weights meanwhile (on the chunks' device).
    # BroadcastWeightTransferSender: one update_weights_nccl while its own
    # thread broadcasts: the engines receive it into staging inside that
    # call's begin (skyrl/broadcast.open_update); finish commits it.

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> dict[str, Any]:
        if self._update is not None:
            raise BadRequest("a weight update is already open: finish_weight_update first", field="weight_update")
        self._update = {"is_checkpoint_format": is_checkpoint_format}
        self._update_named = []
        return {"transport": self._transport}

    def _open_update(self, call: str) -> None:
        if self._update is None:
            raise BadRequest(f"{call} outside a weight update: call start_weight_update first", field="weight_update")

    async def update_weights_ipc(self, update_info: Mapping[str, Any]) -> dict[str, Any]:
        """One chunk of SkyRL's CUDA IPC sender (skyrl/chunks.unpack_ipc_chunk)."""
        self._open_update("update_weights_ipc")
        if "txn" in self._update:  # the broadcast already staged this update on the engines
            raise BadRequest("IPC chunks in an update that update_weights_nccl filled", field="weight_update")
        return {"received": unpack_ipc_chunk(update_info, self._update_named)}

    async def update_weights_nccl(self, update_info: Mapping[str, Any]) -> dict[str, Any]:
        """SkyRL's broadcast sender's receive call (`{names, dtype_names,
        shapes, packed: True}`), awaited while SkyRL's thread broadcasts:
        returns once every engine holds the whole update staged (committed by
        finish_weight_update). A failure aborts it everywhere and closes the
        update (old weights, old version)."""
        self._open_update("update_weights_nccl")
        if self._broadcast is None:
            raise BadRequest(
                "update_weights_nccl before init_weight_update_communicator(BroadcastInitInfo)", field="init_info"
            )
        if "txn" in self._update or self._update_named:
            raise BadRequest(
                "one update_weights_nccl per weight update, and no IPC chunks in it", field="weight_update"
            )
        try:
            self._update["txn"], out = await broadcast.open_update(self.client, self._broadcast, update_info)
        except BaseException:
            self._update, self._update_named = None, []
            raise
        return out

    async def finish_weight_update(self) -> dict[str, Any]:
        """Push every chunk received since start_weight_update: one update."""
        self._open_update("finish_weight_update")
        txn = self._update.get("txn")
        named, self._update_named, self._update = self._update_named, [], None
        if txn is not None:  # SkyRL's broadcast, staged on every engine: the head commits it
            return await txn.commit()
        if not named:
            return {"updated": 0}
        return await self.client.update_weights(named, transport=self._transport, **self._transport_options)

    async def teardown(self) -> None:
        if self._owns_client:
            await self.client.close()

    async def aclose(self) -> None:
        """SkyRL's Tinker path closes its client after each batch: the
        connection of an owned client closes (the next call opens a new one);
        a client that was handed in stays open (its owner closes it)."""
        await self.teardown()


def _options(c: AsyncClient) -> dict[str, Any]:
    """What it takes to open the same connection again (CURVE keys and the join token included)."""
    o = {"address": c.address, "timeout_s": c.timeout_s, "control_timeout_s": c.control_timeout_s, "curve": c._curve}
    return {**o, "token_file": c.token_file or ""}


def _fresh(options: dict[str, Any]) -> AsyncClient:
    o = dict(options)
    curve = o.pop("curve")
    c = AsyncClient(o.pop("address"), **o)
    c._curve = curve
    return c
