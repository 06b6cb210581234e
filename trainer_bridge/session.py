"""A multi-turn token-in/token-out trajectory on one engine.

    async with AsyncSession(client, prompt_ids, params={"max_tokens": 64}) as s:
        turn = await s.generate()                 # the model's turn
        s.add_observation(env_ids)                # the environment's tokens (or text)
        turn = await s.generate()
    s.token_ids, s.loss_mask, s.logprobs          # the whole trajectory

The token ids of every turn are kept as generated: earlier turns are never
re-tokenized, so what the trainer scores is exactly what the engine saw.
Every request carries the session id, so the router keeps the trajectory on
one engine (its prefix cache stays warm); closing the session (or leaving the
`with` block) releases it with `end_session`. `Session` is the same over the
synchronous `Client`.

MoE routing replay (issue 37): with `return_routed_experts` in the params,
each turn asks only for the routes of positions the session does not hold yet
(`routed_experts_start`, SGLang's routed_experts_start_len): the previous model
turn's last token and the observation's tokens, then its own output. Each
model Turn keeps what came (`routed_experts`), and `s.routed_experts` is the
whole trajectory's, one row per token but the last (from the first prompt's
first token when `routed_experts_prompt` was asked, else from its end).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from bus import protocol as P
from bus.errors import ClosedByUs
from trainer_bridge.text import prompt_kind

if TYPE_CHECKING:
    from trainer_bridge.client import AsyncClient, Client
    from trainer_bridge.types import SampleOutput


@dataclasses.dataclass
class Turn:
    role: str  # "prompt" | "model" | "observation"
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    engine_id: str = ""
    text: str | None = None
    # issue 37: the routed experts this turn returned: every position the
    # session lacked, up to its own last token (numpy [rows, layers, top_k])
    routed_experts: Any = None


class _Trajectory:
    """The bookkeeping shared by both faces: turns → ids, mask, logprobs."""

    def __init__(self, session_id: str | None, params: Any, lora: str | None) -> None:
        self.session_id = session_id or uuid.uuid4().hex
        self.params = params
        self.lora = lora
        self.turns: list[Turn] = []
        self.closed = False
        self._routes_next = -1  # next position whose route the session lacks (-1: none asked yet)

    @property
    def routed_experts(self) -> Any:
        """The trajectory's routed experts so far (None: none asked)."""
        parts = [t.routed_experts for t in self.turns if t.routed_experts is not None]
        return np.concatenate(parts, axis=0) if parts else None

    def _route_params(self, params: Any) -> Any:
        """`params` asking only for the routes the session lacks (unchanged when
        they ask for no routes)."""
        get = params.get if isinstance(params, Mapping) else (lambda k: getattr(params, k, None))
        if not (get("return_routed_experts") or get("routed_experts_prompt")):
            return params
        if self._routes_next < 0:
            self._routes_next = 0 if get("routed_experts_prompt") else self.prompt_len
        kw = {"return_routed_experts": True, "routed_experts_prompt": True, "routed_experts_start": self._routes_next}
        if isinstance(params, P.SamplingParams):
            return msgspec.structs.replace(params, **kw)
        return {**params, **kw}

    @property
    def token_ids(self) -> list[int]:
        return [t for turn in self.turns for t in turn.token_ids]

    @property
    def prompt_len(self) -> int:
        return len(self.turns[0].token_ids) if self.turns else 0

    @property
    def response_ids(self) -> list[int]:
        """Everything after the first prompt (model turns and observations)."""
        return [t for turn in self.turns[1:] for t in turn.token_ids]

    @property
    def loss_mask(self) -> list[int]:
        """1 per model token, 0 per observation token, over `response_ids`."""
        return [int(turn.role == "model") for turn in self.turns[1:] for _ in turn.token_ids]

    @property
    def logprobs(self) -> list[float]:
        """Over `response_ids`: the model's logprobs, 0.0 for observation tokens."""
        out: list[float] = []
        for turn in self.turns[1:]:
            out.extend(turn.logprobs if turn.logprobs is not None else [0.0] * len(turn.token_ids))
        return out

    @property
    def engine_ids(self) -> set[str]:
        return {t.engine_id for t in self.turns if t.role == "model"}

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedByUs(f"session {self.session_id} is closed")

    def _record(self, s: SampleOutput) -> Turn:
        turn = Turn("model", list(s.token_ids), s.logprobs, s.finish_reason, s.engine_id, s.text)
        parts = [r for r in (s.prompt_routed_experts, s.routed_experts) if r is not None]
        if parts:
            turn.routed_experts = np.concatenate(parts, axis=0)
            self._routes_next += len(turn.routed_experts)
        self.turns.append(turn)
        return turn

    def _observation(self, ids: Sequence[int]) -> Turn:
        self._check_open()
        turn = Turn("observation", [int(t) for t in ids])
        self.turns.append(turn)
        return turn

    def _kw(self, params: Any) -> dict[str, Any]:
        self._check_open()
        return dict(params=params if params is not None else self.params, session_id=self.session_id, lora=self.lora)


class AsyncSession(_Trajectory):
    def __init__(
        self,
        client: AsyncClient,
        prompt: Any,
        *,
        params: Any = None,
        session_id: str | None = None,
        lora: str | None = None,
    ) -> None:
        """`prompt`: token ids, text or a chat (the last two need the client's tokenizer,
        turned into ids once, at the first `generate`)."""
        super().__init__(session_id, params, lora)
        self.client = client
        self._prompt = prompt

    async def _ids(self, x: Any) -> list[int]:

        return [int(t) for t in x] if prompt_kind(x) == "ids" else await self.client.tokenize(x)

    async def generate(self, params: Any = None) -> Turn:
        """The model's next turn, generated from every token so far."""
        kw = self._kw(params)
        if not self.turns:
            self.turns.append(Turn("prompt", await self._ids(self._prompt)))
        res = await self.client.generate(self.token_ids, self._route_params(kw.pop("params")), **kw)
        assert not isinstance(res, list)  # one prompt in, one result out
        return self._record(res.samples[0])

    async def add_observation(self, obs: Any) -> Turn:
        """Append the environment's tokens (ids; text is tokenized without special tokens)."""
        if isinstance(obs, str):
            ids = await self.client.tokenize(obs, add_special_tokens=False)
        else:
            ids = await self._ids(obs)
        return self._observation(ids)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.client.end_session(self.session_id)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class Session(_Trajectory):
    """`AsyncSession` over the synchronous `Client`."""

    def __init__(
        self, client: Client, prompt: Any, *, params: Any = None, session_id: str | None = None, lora: str | None = None
    ) -> None:
        super().__init__(session_id, params, lora)
        self.client = client
        self._prompt = prompt

    def _ids(self, x: Any) -> list[int]:

        return [int(t) for t in x] if prompt_kind(x) == "ids" else self.client.tokenize(x)

    def generate(self, params: Any = None) -> Turn:
        kw = self._kw(params)
        if not self.turns:
            self.turns.append(Turn("prompt", self._ids(self._prompt)))
        res = self.client.generate(self.token_ids, self._route_params(kw.pop("params")), **kw)
        assert not isinstance(res, list)  # one prompt in, one result out
        return self._record(res.samples[0])

    def add_observation(self, obs: Any) -> Turn:
        ids = self.client.tokenize(obs, add_special_tokens=False) if isinstance(obs, str) else self._ids(obs)
        return self._observation(ids)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.client.end_session(self.session_id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
