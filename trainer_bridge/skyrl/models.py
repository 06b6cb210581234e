"""Which model a SkyRL call's `model=` names, without I/O (RolloutBusEngine._lora).

SkyRL passes the name it knows the policy by on every data-plane call
(`resolve_policy_model_name`: the served name or the policy's path, or its
LoRA adapter's name). The cluster serves one base model and the LoRA adapters
loaded on it: a name that is neither is refused, listing what is served,
rather than silently answered by the base model (issue 35). None / "" mean the
base model, as SkyRL's own client has it, unless adapters are loaded: then the
call must say which (SkyRL refuses the same under LoRA weight sync).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from bus.errors import BadRequest


def base_aliases(model_name: str | None, engines: Iterable[Mapping[str, Any]] | None) -> set[str]:
    """The names the base model answers to: `model_name=` and each engine's
    --model as given, absolute, and its folder's name."""
    names = {model_name} if model_name else set()
    for e in engines or ():
        m = str(e.get("model") or "").rstrip("/")
        if m:
            names |= {m, os.path.abspath(m) if m.startswith((".", "/", "~")) else m, os.path.basename(m)}
    names.discard("")
    return names


def pick_model(model: str | None, aliases: set[str], loras: set[str]) -> str | None:
    """The LoRA adapter `model` names, None for the base model; BadRequest
    (field "model") for a name this cluster does not serve."""
    if model is None or model == "":
        if loras:
            raise BadRequest(
                f"model={model!r} while LoRA adapters are loaded ({', '.join(sorted(loras))}): name the adapter, "
                f"or the base model ({_listing(aliases)}), so a request does not silently bypass the adapter",
                field="model",
            )
        return None
    if model in loras:
        return model
    if model in aliases:
        return None
    raise BadRequest(
        f"model={model!r} is not served by this cluster: the base model is {_listing(aliases)}"
        + (f"; loaded LoRA adapters: {', '.join(sorted(loras))}" if loras else "; no LoRA adapter is loaded")
        + " (RolloutBusEngine(model_name=...) adds the name SkyRL's config uses for the base model)",
        field="model",
    )


def _listing(aliases: set[str]) -> str:
    return " / ".join(repr(a) for a in sorted(aliases)) or "(unknown until connect)"
