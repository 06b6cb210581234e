"""fp8 rollout engines fed bf16 weights (issue 11, item 3) on a real GPU.

An engine started with quantization="fp8" on a bf16 checkpoint quantizes online
(fp8 weights, one dynamic scale per tensor). The trainer pushes bf16 tensors;
the workers reload them through vLLM's layerwise reload, which re-quantizes
(engine_node/backends/vllm/fp8.py). After an update the engine must generate
what a FRESH fp8 engine started on the same weights generates: the fp8 bytes
and scales are the same function of the same bf16 values.

Reported (TIMING lines, RESULT lines):
  - greedy token agreement, updated vs fresh fp8 engine on B;
  - teacher-forced logprob gap (max / mean over the fresh engine's greedy
    continuations, prompt_logprobs on prompt + continuation): updated vs fresh,
    and, as the control that shows the measure can fail, the engine still on A
    vs fresh B;
  - the fp8 engine vs transformers in fp32 on B (what fp8 costs, for reference);
  - update timings: cuda_ipc, zmq (buckets smaller than a layer, so fused
    layers straddle buckets), and a refused partial update.

Model: tests/gpu/conftest.py's TEST_MODEL (hidden 256, intermediate 688, q/kv
heads 4/2 x 64): every GEMM dimension is a multiple of 16 as the fp8 kernels
want. No LoRA (one variable at a time).
"""

from __future__ import annotations

import gc
import json
import math
import time

import pytest

from engine_node.backend import SeqRequest
from tests.gpu.common import ENGINE_OPTS, PROMPTS, greedy, hf_check, match_frac, record_timing, run_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

FP8_OPTS = {
    **{k: v for k, v in ENGINE_OPTS.items() if k not in ("enable_lora", "max_lora_rank", "max_loras")},
    "gpu_memory_utilization": 0.25,
    "quantization": "fp8",
}
TF_GAP_TOL = 0.02  # nats: same fp8 bytes, same kernels; a wrong scale or stale layer costs far more
CONTROL_GAP_MIN = 1.0  # nats: a different model (A vs B) is this far off at least


def result(name: str, **values) -> None:
    """A RESULT line (the agreement numbers), also kept with the timings (TIMING line, JSON lines file)."""
    print("RESULT " + json.dumps({"name": name, **values}), flush=True)
    record_timing(name, **values)


def wait(op, timeout_s: float = 300.0):
    return op.future.result(timeout_s)


def start(model_dir):
    from engine_node.backends.vllm.backend import make_backend

    t0 = time.perf_counter()
    be = make_backend(model_dir, **FP8_OPTS)
    return be, time.perf_counter() - t0


def teacher_forced(be, ps, outs, timeout_s: float = 60.0) -> list[list[float]]:
    """log p(o[t] | p + o[:t]) for every continuation token, from the engine's
    prompt logprobs on prompt + continuation (one forward pass each)."""
    ids = {}
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        sid = f"tf{time.monotonic_ns()}-{i}"
        be.add(SeqRequest(sid, list(p) + list(o), greedy(1), 1, prompt_logprobs=0))
        ids[sid] = i
    got: dict[int, list[float]] = {}
    end = time.monotonic() + timeout_s
    finished: set[str] = set()
    while len(finished) < len(ids):
        assert time.monotonic() < end, f"teacher-forced pass not done in {timeout_s}s"
        for o in be.step():
            if o.seq_id not in ids:
                continue
            if o.prompt_logprobs is not None:
                i = ids[o.seq_id]
                got[i] = list(o.prompt_logprobs.logprobs[len(ps[i]) :])
            if o.finish_reason is not None:
                finished.add(o.seq_id)
        time.sleep(0.0005)
    return [got[i] for i in range(len(ps))]


def gaps(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    d = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    assert d and not any(math.isnan(x) for x in d)
    return max(d), sum(d) / len(d)


def _sd(model_dir, device="cuda"):
    import os

    import torch
    from safetensors.torch import load_file

    return {
        k: v.to(torch.bfloat16)
        for k, v in load_file(os.path.join(model_dir, "model.safetensors"), device=device).items()
    }


def push_ipc(be, named, tag):
    from trainer_bridge.transports.cuda_ipc import CudaIpcSender

    sender = CudaIpcSender(bucket_bytes=8 << 20)
    metas, sizes, handles = sender.prepare(named)
    t0 = time.perf_counter()
    try:
        wait(be.begin_weight_update(tag, "cuda_ipc", metas, {"bucket_sizes": sizes}))
        wait(be.receive_weights(handles))
        rc = wait(be.commit_weight_update())
    finally:
        sender.release()  # after the commit's ack: the workers loaded from views of these buckets
    return time.perf_counter() - t0, sum(sizes), rc


def push_zmq(be, named, tag, bucket_bytes):
    from bus.tensors import pack_bucket, plan_buckets

    metas, sizes, tensors = plan_buckets(named, bucket_bytes)
    bufs = [pack_bucket(i, metas, sizes, tensors).numpy().tobytes() for i in range(len(sizes))]
    t0 = time.perf_counter()
    wait(be.begin_weight_update(tag, "zmq", metas, {"bucket_sizes": sizes}))
    for i, buf in enumerate(bufs):
        be.stage_bucket(i, memoryview(buf))
    rc = wait(be.commit_weight_update())
    return time.perf_counter() - t0, sum(sizes), len(sizes), rc


@pytest.fixture(scope="module")
def fresh_b(model_dirs):
    """A fresh fp8 engine on B: greedy outputs, their logprobs, teacher-forced logprobs."""
    be, t_start = start(model_dirs["B"])
    try:
        outs, full = run_greedy(be, logprobs=True)
        tf = teacher_forced(be, PROMPTS, outs)
    finally:
        be.close()
        gc.collect()
    record_timing("fp8_engine_start", seconds=round(t_start, 2), model="tinyB")
    gap, agree = hf_check(model_dirs["B"], outs)
    result("fp8_fresh_B_vs_hf_fp32_B", max_logprob_gap=round(gap, 4), argmax_agreement=round(agree, 3))
    return {"outs": outs, "lps": [r["logprobs"] for r in full], "tf": tf}


def test_fp8_engine_updated_with_bf16_equals_fresh_fp8_engine(model_dirs, fresh_b):
    from engine_node.backend import BackendError

    be, t_start = start(model_dirs["A"])
    try:
        outA, _ = run_greedy(be)
        tf_ctrl = teacher_forced(be, PROMPTS, fresh_b["outs"])
        ctrl_max, ctrl_mean = gaps(tf_ctrl, fresh_b["tf"])
        result("fp8_control_engine_on_A_vs_fresh_B", tf_max_gap=round(ctrl_max, 4), tf_mean_gap=round(ctrl_mean, 4))
        assert outA != fresh_b["outs"] and ctrl_max > CONTROL_GAP_MIN, "the measure tells A from B"

        # round 1: B's bf16 weights over cuda_ipc, re-quantized on load
        sdB = list(_sd(model_dirs["B"]).items())
        t_up, nbytes, rc = push_ipc(be, sdB, "fp8-1")
        record_timing(
            "fp8_weight_update_cuda_ipc",
            bytes=nbytes,
            begin_to_finish_s=round(t_up, 4),
            commit_worker_s=rc["worker_seconds"],
        )
        outs, full = run_greedy(be, logprobs=True)
        tf = teacher_forced(be, PROMPTS, fresh_b["outs"])
        tf_max, tf_mean = gaps(tf, fresh_b["tf"])
        match = match_frac(outs, fresh_b["outs"])
        same_seq = [
            (a["logprobs"], b) for a, b, o, r in zip(full, fresh_b["lps"], outs, fresh_b["outs"], strict=True) if o == r
        ]
        lp_max = max((abs(x - y) for a, b in same_seq for x, y in zip(a, b, strict=True)), default=float("nan"))
        result(
            "fp8_updated_vs_fresh_B",
            greedy_token_match=round(match, 4),
            identical_sequences=f"{len(same_seq)}/{len(outs)}",
            sampled_logprob_max_gap=round(lp_max, 5),
            tf_max_gap=round(tf_max, 5),
            tf_mean_gap=round(tf_mean, 6),
        )
        assert tf_max < TF_GAP_TOL, f"teacher-forced gap {tf_max} nats"
        assert match >= 0.95, f"greedy agreement {match}"

        # round 2: back to A over zmq, buckets smaller than a layer (q/k/v straddle buckets):
        # the workers load every bucket in one call and re-quantize each layer once
        sdA = list(_sd(model_dirs["A"], "cpu").items())
        t_up, nbytes, nb, rc = push_zmq(be, sdA, "fp8-2", bucket_bytes=96 << 10)
        record_timing("fp8_weight_update_zmq", bytes=nbytes, buckets=nb, seconds=round(t_up, 4))
        back, _ = run_greedy(be)
        result("fp8_back_to_A_vs_fresh_A", greedy_token_match=round(match_frac(back, outA), 4))
        assert back == outA, "fp8 engine back on A's bf16 weights: the fresh A engine's output"

        # round 3: B again (a reload after reloads), cuda_ipc
        t_up, _, rc = push_ipc(be, sdB, "fp8-3")
        record_timing("fp8_weight_update_cuda_ipc_round3", begin_to_finish_s=round(t_up, 4))
        again, _ = run_greedy(be)
        assert match_frac(again, outs) == 1.0

        # a partial fused layer (q_proj without k/v) is refused before anything is touched
        part = [(k, v) for k, v in _sd(model_dirs["A"]).items() if k == "model.layers.0.self_attn.q_proj.weight"]
        with pytest.raises(BackendError, match="qkv_proj"):
            push_ipc(be, part, "fp8-bad")
        after, _ = run_greedy(be)
        assert after == again, "refused update left the weights alone"
        result("fp8_partial_fused_update", refused=True, weights_unchanged=True)
    finally:
        be.close()
        gc.collect()
    record_timing("fp8_engine_start", seconds=round(t_start, 2), model="tinyA")
