"""vLLM-style sampling dicts (what SkyRL, OpenAI-shaped requests and most RL
trainers send) → rollout-bus `SamplingParams`, in one table.

Each key has one rule:

- `wire(...)`: the engine honours it; the value goes into `SamplingParams`
  (optionally converted).
- `client(...)`: exact on the client side (`n` → samples of one request).
- `server(neutral=...)`: NEEDS SERVER SUPPORT (issue 10, server-side part).
  Only the value(s) that mean "off" are accepted now, because dropping them
  is then exact; any other value raises `UnsupportedParameter` naming the
  key. When the engine gains the field, its line becomes `wire(...)`.

A key not in the table raises `BadRequest` naming it: nothing is dropped.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from bus import protocol as P
from bus.errors import BadRequest, Unsupported


class UnsupportedParameter(Unsupported, BadRequest):
    """A known sampling parameter the engines cannot honour yet (`field` names it).
    Also a BadRequest, so `except BadRequest` catches every refused parameter."""


@dataclasses.dataclass
class Translated:
    params: P.SamplingParams
    num_samples: int = 1
    skip_special_tokens: bool = True


@dataclasses.dataclass(frozen=True)
class _Rule:
    kind: str  # "wire" | "client" | "server"
    target: str | None = None  # wire field / Translated field (default: the key)
    conv: Callable[[Any], Any] | None = None
    neutral: Callable[[Any, Mapping[str, Any]], bool] | None = None  # "server": what is exact to drop


def wire(target: str | None = None, conv: Callable[[Any], Any] | None = None) -> _Rule:
    return _Rule("wire", target, conv)


def client(target: str | None = None, conv: Callable[[Any], Any] | None = None) -> _Rule:
    return _Rule("client", target, conv)


def server(*off: Any, when: Callable[[Any, Mapping[str, Any]], bool] | None = None) -> _Rule:
    """Needs engine support; accepted now only when the value is one of `off`
    (or `when(value, all_params)` holds)."""
    return _Rule("server", neutral=when or (lambda v, _all: not isinstance(v, bool) and v in off))


def _top_k(v: Any) -> int:
    return 0 if v == -1 else int(v)  # vLLM: -1 = off; the wire: 0 (or -1) = off


def _logprobs(v: Any) -> bool | int:
    # vLLM: None = none; k >= 0 = the chosen token's logprob, then the top-k
    # alternatives (k = 0: the chosen one only). True: the chosen one only.
    if v is None or v is False:
        return False
    if v is True:
        return True
    if isinstance(v, float) and not v.is_integer():
        raise ValueError("logprobs must be an int")
    return int(v)


def _stop(v: Any) -> list[str]:
    # vLLM accepts one string or a list of strings.
    items = [v] if isinstance(v, str) else list(v)
    if not all(isinstance(x, str) for x in items):
        raise ValueError("stop must be a string or a list of strings")
    return items


def _int(v: Any) -> int:
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError("expected an int")
    return int(v)


def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("expected a bool")
    return v


# One line per parameter. A `server(...)` line would mark one the engines do not
# honour yet; since issue 10's server side every parameter is on the wire.
PARAMS: dict[str, _Rule] = {
    "max_tokens": wire(),
    "temperature": wire(conv=float),
    "top_p": wire(conv=float),
    "top_k": wire(conv=_top_k),
    "seed": wire(),
    "stop_token_ids": wire(conv=lambda v: [int(t) for t in v or ()]),
    "ignore_eos": wire(conv=bool),
    "logprobs": wire(conv=_logprobs),  # True / 0: the chosen token's; k: + top-k
    "n": client("num_samples", conv=int),
    # Client-side text AND the engine's stop-string matching use it.
    "skip_special_tokens": wire(conv=bool),
    "stop": wire(conv=_stop),  # stop strings, matched on the engine node's detokenized text
    "include_stop_str_in_output": wire(conv=bool),
    "min_tokens": wire(conv=_int),
    "min_p": wire(conv=float),
    "repetition_penalty": wire(conv=float),
    "presence_penalty": wire(conv=float),
    "frequency_penalty": wire(conv=float),
    "prompt_logprobs": wire(conv=_int),  # per prompt token, on each sample's final chunk
    "cache_salt": wire(conv=str),  # prefix-cache scope (vLLM's cache_salt); outputs do not depend on it
    # issue 37, MoE routing replay (R3): each sample's routed expert ids
    # (engines started with the return_routed_experts backend option)
    "return_routed_experts": wire(conv=lambda v: _flag(v)),
    "routed_experts_prompt": wire(conv=lambda v: _flag(v)),  # the prompt's routes too
    "routed_experts_start": wire(conv=_int),  # prompt routes skip positions before it
}

# Keys of vLLM's SamplingParams with no effect on the tokens or logprobs the
# client returns: `output_kind` (streaming granularity) and `detokenize` (the
# client detokenizes itself).
IGNORED = frozenset({"output_kind", "detokenize"})


def translate(sp: Mapping[str, Any] | P.SamplingParams | None, *, prefix: str = "") -> Translated:
    """Map a vLLM-style dict to wire params + client-side options. Raises
    BadRequest (unknown key or bad value) or UnsupportedParameter (needs the
    engine), each with `field` = `prefix + key`."""
    if isinstance(sp, P.SamplingParams):
        return Translated(sp, skip_special_tokens=sp.skip_special_tokens)
    wire_kw: dict[str, Any] = {}
    out = Translated(P.SamplingParams())
    for key, value in (sp or {}).items():
        field = prefix + key
        rule = PARAMS.get(key)
        if rule is None:
            if key in IGNORED:
                continue
            raise BadRequest(f"unknown sampling parameter {key!r}", field=field)
        if rule.kind == "server":
            if not rule.neutral(value, sp):  # type: ignore[misc,arg-type]
                raise UnsupportedParameter(
                    f"{key}={value!r} needs engine support that is not there yet (issue 10, server-side)", field=field
                )
            continue
        if value is None:
            continue  # vLLM's None = its default, which ours matches
        try:
            v = rule.conv(value) if rule.conv else value
        except UnsupportedParameter as e:
            e.field = field
            raise
        except (TypeError, ValueError) as e:
            raise BadRequest(f"bad value {value!r} for {key}: {e}", field=field) from None
        if rule.kind == "wire":
            wire_kw[rule.target or key] = v
        else:
            setattr(out, rule.target or key, v)
    out.params = _to_wire(wire_kw, prefix)
    out.skip_special_tokens = out.params.skip_special_tokens
    if out.num_samples < 1:
        raise BadRequest(f"n must be >= 1, got {out.num_samples}", field=prefix + "n")
    return out


def for_request(
    params: Mapping[str, Any] | P.SamplingParams | None, num_samples: int | None, *, prefix: str = "params."
) -> Translated:
    """The client's path (`AsyncClient.generate/stream/sample`): `translate`
    plus the call's `num_samples`. A dict's `n` is the number of samples, as
    on the SkyRL path; given both, they must agree (BadRequest naming `n`).
    None and no `n`: one sample."""
    if num_samples is not None and (
        isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1
    ):
        raise BadRequest(f"num_samples must be an int >= 1, got {num_samples!r}", field="num_samples")
    out = translate(params, prefix=prefix)
    n = params.get("n") if isinstance(params, Mapping) else None
    if num_samples is not None:
        if n is not None and out.num_samples != num_samples:
            raise BadRequest(f"{prefix}n={n!r} disagrees with num_samples={num_samples!r}", field=prefix + "n")
        out.num_samples = num_samples
    return out


_WIRE_FIELDS = P.SamplingParams.__struct_fields__


def _to_wire(kw: dict[str, Any], prefix: str) -> P.SamplingParams:
    """Type-checked construction (SamplingParams is array_like on the wire)."""
    row = [kw.get(f, getattr(P.SamplingParams(), f)) for f in _WIRE_FIELDS]
    try:
        return msgspec.convert(row, P.SamplingParams)
    except msgspec.ValidationError as e:
        m = re.search(r"\$\[(\d+)\]", str(e))  # "Expected `int`, got `str` - at `$[0]`"
        name = _WIRE_FIELDS[int(m.group(1))] if m else "params"
        raise BadRequest(f"bad value for {name}: {e}", field=prefix + name) from None


def needs_server() -> list[str]:
    """The parameters still waiting for engine support."""
    return [k for k, r in PARAMS.items() if r.kind == "server"]
