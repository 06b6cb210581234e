"""MoE routing replay (R3, issue 37 §3) on vLLM 0.24: a Qwen3-MoE-shaped model
(`make_tiny_model.py --preset qwen3moe`: 1.25B params, 32 experts, top-4, 12
layers) behind a real head and one vllm engine node started with
`return_routed_experts`.

- equality: each request's routes (the prompt's + every token's but the last)
  equal what vLLM's own `LLM.generate(enable_return_routed_experts=True)`
  returns for the same greedy request (RequestOutput.outputs[0].routed_experts);
- pause("abort") / resume: the parked request is re-prefilled as prompt + tokens
  so far; its rows are whole (one per position, none repeated, the prompt's
  once) and agree with the uninterrupted reference (a re-prefill recomputes a
  position in a prefill instead of a decode step: bf16 may flip a near-tied
  route, so that part is a fraction, recorded);
- cost: tokens/s of a batch with routes asked vs the same engine without them
  vs an engine started without the option (target: <= 5 % slower), and bytes
  per token on the wire against vLLM's HTTP base64 (np.save + base64 in JSON,
  vllm/entrypoints/openai/chat_completion/serving.py), as TIMING lines.

The model: $ROLLOUT_BUS_GPU_MOE_MODEL if it holds one, else built into
$ROLLOUT_BUS_GPU_MODEL_DIR/qwen3moe with $TINY_MODEL_SCRIPT (default
.device/make_tiny_model.py, else ../shared/tools/make_tiny_model.py) on cuda.
"""

from __future__ import annotations

import base64
import gc
import io
import json
import os
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest

from tests.cluster import wait_until
from tests.gpu.common import prompts, record_timing, vllm_cluster

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(400)]

# vLLM LLM's defaults (CUDA graphs): the same engine settings on both sides,
# so the same kernels run and the routes can be compared exactly.
OPTS = dict(gpu_memory_utilization=0.3, max_model_len=2048, dtype="bfloat16", seed=0)
CLUSTER_OPTS = dict(OPTS, enforce_eager=False, enable_lora=False)
PROMPTS = prompts(4, 24, seed=3)
N = 32
GREEDY = {"max_tokens": N, "temperature": 0.0, "ignore_eos": True}
ROUTES = {**GREEDY, "return_routed_experts": True, "routed_experts_prompt": True}
LONG_PROMPT = prompts(1, 16, seed=9)[0]
LONG_N = 400
BATCH = prompts(64, 32, seed=11)
BATCH_N = 256


def _script() -> str:
    for p in (
        os.environ.get("TINY_MODEL_SCRIPT"),
        ".device/make_tiny_model.py",
        os.path.join("..", "shared", "tools", "make_tiny_model.py"),
    ):
        if p and os.path.isfile(p):
            return p
    pytest.skip("no make_tiny_model.py (set TINY_MODEL_SCRIPT)")


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    given = os.environ.get("ROLLOUT_BUS_GPU_MOE_MODEL")
    if given and os.path.isfile(os.path.join(given, "config.json")):
        return given
    root = os.environ.get("ROLLOUT_BUS_GPU_MODEL_DIR") or str(tmp_path_factory.mktemp("models"))
    d = os.path.join(root, "qwen3moe")
    if not os.path.isfile(os.path.join(d, "config.json")):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, _script(), d, "--preset", "qwen3moe", "--device", "cuda"], check=True, timeout=300
        )
        record_timing("r3_model_built", seconds=round(time.perf_counter() - t0, 1))
    return d


def _http_bytes(routes: np.ndarray) -> int:
    """What vLLM's HTTP server sends for one output's routes: np.save'd, base64'd,
    a JSON string field (vllm/entrypoints/openai/chat_completion/serving.py)."""
    buf = io.BytesIO()
    np.save(buf, routes)
    return len(json.dumps({"routed_experts": base64.b64encode(buf.getvalue()).decode("ascii")})) - 2


@pytest.fixture(scope="module")
def reference(moe_model):
    """vLLM's own LLM.generate, one greedy request at a time (started and stopped first)."""
    from vllm import LLM
    from vllm import SamplingParams as VSP

    t0 = time.perf_counter()
    llm = LLM(model=moe_model, enable_return_routed_experts=True, **OPTS)
    started = time.perf_counter() - t0
    out = {}
    for i, (p, n) in enumerate([*((p, N) for p in PROMPTS), (LONG_PROMPT, LONG_N)]):
        sp = VSP(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0]
        assert o.routed_experts is not None, "LLM.generate returned no routed_experts"
        out[i] = (list(o.token_ids), np.asarray(o.routed_experts))
    record_timing(
        "r3_llm_reference", engine_start_s=round(started, 1), shape=list(out[0][1].shape), dtype=str(out[0][1].dtype)
    )
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return out


@pytest.fixture(scope="module")
def routed(moe_model, reference):
    t0 = time.perf_counter()
    c = vllm_cluster(moe_model, **CLUSTER_OPTS, return_routed_experts=True)
    record_timing("r3_engine_ready", seconds=round(time.perf_counter() - t0, 1))
    yield c, c.client(timeout_s=120, control_timeout_s=120)
    c.close()


def _rows(chunks) -> tuple[np.ndarray | None, np.ndarray]:
    pr = [ch.prompt_routed_experts for ch in chunks if ch.prompt_routed_experts is not None]
    assert len(pr) <= 1, "the prompt's routes came more than once"
    out = np.concatenate([ch.routed_experts for ch in chunks if ch.routed_experts is not None])
    return (pr[0] if pr else None), out


def test_routes_equal_llm_generate(routed, reference):
    _c, cl = routed
    wire = http = rows = 0
    for i, p in enumerate(PROMPTS):
        toks, want = reference[i]
        chunks = list(cl.stream(p, ROUTES))
        got_toks = [t for ch in chunks for t in ch.token_ids]
        assert got_toks == toks, f"prompt {i}: greedy tokens differ from LLM.generate"
        prompt_rows, out_rows = _rows(chunks)
        assert prompt_rows is not None and prompt_rows.shape == (len(p), *want.shape[1:])
        assert out_rows.dtype == np.uint8 and out_rows.shape == (N - 1, *want.shape[1:])
        got = np.concatenate([prompt_rows, out_rows])
        assert got.shape == want.shape, (got.shape, want.shape)
        diff = float((got != want).any(axis=(1, 2)).mean())
        assert diff == 0.0, f"prompt {i}: {diff:.1%} of positions route differently from LLM.generate"
        # the wire: the rows' frames + their RoutedExperts (msgpack) per chunk
        for ch in chunks:
            for r in (ch.prompt_routed_experts, ch.routed_experts):
                if r is not None:
                    wire += r.nbytes
            if ch.routed_experts is not None or ch.prompt_routed_experts is not None:
                wire += len(msgspec.msgpack.encode([0, 0, 0, "uint8", 0]))
        http += _http_bytes(want)
        rows += len(want)
    record_timing(
        "r3_wire_bytes_per_token",
        shape_per_token=list(reference[0][1].shape[1:]),
        rollout_bus=round(wire / rows, 2),
        vllm_http_base64=round(http / rows, 2),
        ratio=round(http / max(1, wire), 2),
    )
    # Whole requests (the head joins the rows into one chunk) carry the same.
    res = cl.generate(PROMPTS[0], ROUTES)
    s = res.samples[0]
    np.testing.assert_array_equal(np.concatenate([s.prompt_routed_experts, s.routed_experts]), reference[0][1])


def test_routes_survive_pause_abort_and_resume(routed, reference):
    _c, cl = routed
    toks_ref, want = reference[len(PROMPTS)]
    chunks: list = []
    err: list = []

    def run() -> None:
        try:
            for ch in cl.stream(LONG_PROMPT, {**ROUTES, "max_tokens": LONG_N}):
                chunks.append(ch)
        except Exception as e:  # handed to the test
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_until(lambda: len(chunks) >= 20, 60, "first tokens")
    parked = sum(r.parked for r in cl.pause("abort").values())
    cl.resume()
    t.join(120)
    assert not err, err
    toks = [x for ch in chunks for x in ch.token_ids]
    prompt_rows, out_rows = _rows(chunks)
    assert len(toks) == LONG_N and prompt_rows is not None
    assert len(prompt_rows) == len(LONG_PROMPT) and len(out_rows) == LONG_N - 1, "whole: one row per position"
    np.testing.assert_array_equal(prompt_rows, want[: len(LONG_PROMPT)])
    same = next((i for i, (a, b) in enumerate(zip(toks, toks_ref, strict=True)) if a != b), len(toks))
    agree = float(
        (out_rows[: max(0, same - 1)] == want[len(LONG_PROMPT) :][: max(0, same - 1)]).all(axis=(1, 2)).mean()
    )
    record_timing(
        "r3_pause_abort_resume", parked=parked, tokens_equal_to=same, of=LONG_N, route_agreement=round(agree, 4)
    )
    assert parked == 1
    assert agree >= 0.95, f"routes after pause/resume agree with LLM.generate on only {agree:.1%} of positions"


def _throughput(cl, params: dict) -> float:
    cl.generate(BATCH[:8], {**params, "max_tokens": 16})  # warm
    best = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        res = cl.generate(BATCH, {**params, "max_tokens": BATCH_N})
        dt = time.perf_counter() - t0
        best = max(best, sum(len(r.samples[0].token_ids) for r in res) / dt)
    return best


TPUT: dict[str, float] = {}


def test_throughput_with_routes_on_the_routed_engine(routed):
    _c, cl = routed
    TPUT["option_on_routes_asked"] = _throughput(cl, ROUTES)
    TPUT["option_on_not_asked"] = _throughput(cl, GREEDY)
    record_timing("r3_tokens_per_s", batch=len(BATCH), new_tokens=BATCH_N, **{k: round(v) for k, v in TPUT.items()})


def test_throughput_without_the_option(moe_model, routed):
    c, _cl = routed
    c.close()  # one engine on the GPU at a time
    plain = vllm_cluster(moe_model, **CLUSTER_OPTS)
    try:
        off = _throughput(plain.client(timeout_s=120), GREEDY)
    finally:
        plain.close()
    on = TPUT.get("option_on_routes_asked")
    record_timing(
        "r3_tokens_per_s_vs_off",
        option_off=round(off),
        **{k: round(v) for k, v in TPUT.items()},
        slowdown_pct=round(100 * (1 - on / off), 2) if on else None,
        target_pct=5,
    )
