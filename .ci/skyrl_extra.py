"""The `skyrl` extra for CI, from pyproject.toml (its one list).

`python3 .ci/skyrl_extra.py pinned`: the skyrl packages, which CI installs
with --no-deps (their transformers pin would replace the suite's);
`... rest`: what they import and do not declare, installed as usual;
`... check`: import what SkyRL's generator, its Tinker types and its clients
import (tests/test_skyrl_generator.py's imports) — run in a fresh venv after
`pip install -e ".[skyrl]"`, it proves the extra alone is enough.
"""

from __future__ import annotations

import os
import sys


def extra() -> list[str]:
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        return list(tomllib.load(f)["project"]["optional-dependencies"]["skyrl"])


def check() -> None:
    import typing

    if sys.version_info < (3, 12):  # skyrl's pydantic models: typing.TypedDict is accepted from 3.12
        import typing_extensions

        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
    import skyrl_gym  # noqa: F401
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient  # noqa: F401
    from skyrl.tinker import types  # noqa: F401
    from skyrl.train.generators import SkyRLGymGenerator  # noqa: F401
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator as _Gym  # noqa: F401

    import trainer_bridge.skyrl  # noqa: F401

    print("skyrl extra: SkyRLGymGenerator, RemoteInferenceClient, skyrl.tinker.types and trainer_bridge.skyrl import")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "check"
    if what == "check":
        check()
    else:
        pinned = [r for r in extra() if r.startswith("skyrl")]
        print(" ".join(pinned if what == "pinned" else [r for r in extra() if r not in pinned]))
