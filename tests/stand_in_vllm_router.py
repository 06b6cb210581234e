"""A STAND-IN for the `vllm-router` launcher, for tests of how a bench runs its
vllm-router arms (order, pairing, labels) on a machine without vllm-router (CI
installs no `bench` extra). It takes vllm-router's command line, ignores all
but --host/--port, and answers there itself as a bench.http_peer (no routing,
no forwarding): figures measured through it say nothing about vllm-router.

A test puts a `vllm-router` script running `python -m tests.stand_in_vllm_router`
first on PATH (see tests/test_bench_scale.py).
"""

from __future__ import annotations

import argparse

from bench import http_peer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", required=True)
    a, _ = ap.parse_known_args()
    return http_peer.main(["--host", a.host, "--port", a.port])


if __name__ == "__main__":
    raise SystemExit(main())
