"""Helpers shared by the GPU tests (tests/gpu): prompts, engine options, a
step-driver for a backend object, a transformers reference check, timings."""

from __future__ import annotations

import json
import os
import random
import time

from bus.protocol import SamplingParams
from engine_node.backend import SeqRequest


def _count_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


# Counted once, when the tests are collected: later, tests set
# CUDA_VISIBLE_DEVICES in this process around engine starts, and torch caches
# the count of whatever was visible when CUDA was first initialized, so a
# count taken mid-session can see 1 GPU on a 2-GPU machine (that is how the
# trainer-GPU0 -> engine-GPU1 nccl test came to skip on nvidia-h200-x2).
_GPU_COUNT = _count_gpus()


def gpu_count() -> int:
    return _GPU_COUNT


def record_timing(name: str, **values) -> None:
    """Print (and append to $ROLLOUT_BUS_GPU_TIMINGS, JSON lines) one timing row for RESULTS.md."""
    row = {"name": name, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **values}
    line = json.dumps(row, default=_plain)
    print("TIMING " + line, flush=True)
    path = os.environ.get("ROLLOUT_BUS_GPU_TIMINGS")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _plain(o):
    """Typed control results (bus.protocol *Result) as the dicts they read as."""
    to_dict = getattr(o, "to_dict", None)
    if to_dict is None:
        raise TypeError(f"{type(o).__name__} is not JSON serializable")
    return to_dict()


def drive(backend, seq_ids, timeout_s: float = 60.0):
    """Step `backend` until every sequence of `seq_ids` finished. Returns
    {seq_id: {"tokens", "logprobs", "finish"}}."""
    res = {s: {"tokens": [], "logprobs": [], "finish": None} for s in seq_ids}
    deadline = time.monotonic() + timeout_s
    while any(r["finish"] is None for r in res.values()):
        if time.monotonic() > deadline:
            left = {s: len(r["tokens"]) for s, r in res.items() if r["finish"] is None}
            raise TimeoutError(f"sequences not finished after {timeout_s}s: {left}")
        outs = backend.step()
        if not outs and not backend.has_work():
            time.sleep(0.001)
        for o in outs:
            r = res.get(o.seq_id)
            if r is None:
                continue
            r["tokens"].extend(o.token_ids)
            if o.logprobs is not None:
                r["logprobs"].extend(o.logprobs)
            if o.finish_reason is not None:
                r["finish"] = o.finish_reason
    return res


VOCAB = 4096
N_NEW = 24
ENGINE_OPTS = dict(
    gpu_memory_utilization=0.3,
    max_model_len=2048,
    enforce_eager=True,
    dtype="bfloat16",
    seed=0,
    enable_lora=True,
    max_lora_rank=16,
    max_loras=4,
)


def prompts(n: int = 8, length: int = 12, seed: int = 1) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(4, VOCAB) for _ in range(length)] for _ in range(n)]


PROMPTS = prompts()


def greedy(max_tokens: int = N_NEW, logprobs: bool = False) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)


_n = 0  # sequence id counter


def run_greedy(be, ps=PROMPTS, n=N_NEW, lora=None, logprobs=False, timeout_s=60.0):
    global _n
    ids = []
    for p in ps:
        _n += 1
        sid = f"g{_n}"
        be.add(SeqRequest(sid, list(p), greedy(n, logprobs), n, seed=None, lora=lora))
        ids.append(sid)
    res = drive(be, ids, timeout_s)
    return [res[s]["tokens"] for s in ids], [res[s] for s in ids]


def hf_check(model_dir: str, outs, ps=PROMPTS, state_dict=None):
    """Teacher-forced check of greedy outputs against transformers in fp32 (weights
    rounded to bf16, as the engine holds them): returns (max over positions of
    logp(HF argmax) - logp(engine's token), fraction of positions where they agree).
    Exact sequence equality is not expected: bf16 kernels flip near-ties, and one
    flip changes the rest of a greedy sequence; the gap stays small, while a
    different model gives gaps of several nats."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    if state_dict is not None:
        m.load_state_dict(state_dict, strict=False)
    gaps, agree = [], 0
    with torch.no_grad():
        for prm in m.parameters():
            prm.copy_(prm.to(torch.bfloat16).float())
        for p, o in zip(ps, outs, strict=True):
            x = torch.tensor([list(p) + list(o)], device="cuda")
            lp = torch.log_softmax(m(x).logits[0].float(), -1)
            for t, tok in enumerate(o):
                row = lp[len(p) - 1 + t]
                gaps.append((row.max() - row[tok]).item())
                agree += int(row.argmax().item() == tok)
    del m
    torch.cuda.empty_cache()
    return max(gaps), agree / len(gaps)


HF_GAP_TOL = 0.3  # nats


def match_frac(a, b) -> float:
    tot = sum(len(x) for x in a)
    eq = sum(sum(1 for u, v in zip(x, y, strict=False) if u == v) for x, y in zip(a, b, strict=True))
    return eq / max(1, tot)


def vllm_cluster(model: str, timeout_s: float = 300.0, **backend_options):
    """One vllm engine node behind a head (tests.cluster.Cluster), ready; on a
    failed start the engine's log tail is printed and every process ended."""
    from tests.cluster import Cluster

    c = Cluster(1, backend="vllm", model=model, backend_options={**ENGINE_OPTS, **backend_options})
    try:
        c.wait_ready(1, timeout_s=timeout_s)
    except BaseException:
        print(c.log("e0")[-5000:])
        c.close()
        raise
    return c
