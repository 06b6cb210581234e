"""GPU tests: vLLM backend on real GPUs (run on the device machine, see tests/gpu/RESULTS.md).

Every test here is marked `gpu` and skipped, with the reason, when CUDA is not
available or vLLM is not importable, so CPU CI collects and skips them.

Environment knobs:
  ROLLOUT_BUS_GPU_MODEL_DIR  where the test models are built (default: a temp dir)
  ROLLOUT_BUS_GPU_TIMINGS    a JSON-lines file the tests append timings to
"""

from __future__ import annotations

import gc
import importlib.util
import os
import time

import pytest

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not in the device bundle
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
# The test process touches CUDA (device count, HF references): vLLM must spawn, not fork.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not importable"
    return None


SKIP_REASON = _skip_reason()


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if not str(item.fspath).startswith(here):
            continue  # CPU tests of GPU code paths (fakes) live in tests/ and run in CI
        item.add_marker(pytest.mark.gpu)
        # vLLM and transformers warn a lot; the repo-wide "error" filter is for our code.
        item.add_marker(pytest.mark.filterwarnings("ignore"))
        if SKIP_REASON:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


def pytest_runtest_logreport(report):
    """Print a failure's traceback the moment it happens: a GPU run is often
    cut off by the device call's limit before pytest's summary, which is
    where the tracebacks would otherwise be (runs 1 and 3 of 2026-11-27 lost
    every failure's reason that way)."""
    if report.failed:
        print(f"\n==== FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n====", flush=True)


# Model shape for the tests: head_dim 64 so FlashAttention 3 runs (the CI tiny model's 16 does not).
TEST_MODEL = dict(hidden=256, layers=4, heads=4, kv_heads=2, inter=688, vocab=4096, max_pos=4096)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Two tiny Llamas with the same shape, different random weights (A: seed 0, B: seed 1)."""
    from engine_node.tiny_model import build_tiny_model

    root = os.environ.get("ROLLOUT_BUS_GPU_MODEL_DIR") or str(tmp_path_factory.mktemp("models"))
    out = {}
    for tag, seed in (("A", 0), ("B", 1)):
        d = os.path.join(root, f"tiny{tag}")
        if not os.path.isfile(os.path.join(d, "config.json")):
            build_tiny_model(d, seed=seed, **TEST_MODEL)
        out[tag] = d
    return out


@pytest.fixture(scope="session")
def llm_reference(model_dirs):
    """vLLM's own LLM.generate greedy on the same prompts (started and stopped first)."""
    from vllm import LLM
    from vllm import SamplingParams as VSP

    from tests.gpu.common import ENGINE_OPTS, N_NEW, PROMPTS, prompts, record_timing

    kw = {k: v for k, v in ENGINE_OPTS.items()}
    t0 = time.perf_counter()
    llm = LLM(model=model_dirs["A"], enable_sleep_mode=True, **kw)
    t_start = time.perf_counter() - t0
    sp = VSP(temperature=0, max_tokens=N_NEW, ignore_eos=True, detokenize=False, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    ref = [list(o.outputs[0].token_ids) for o in outs]
    # logprobs=0: each position's dict holds the sampled token's logprob
    REF_LOGPROBS[:] = [
        [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)] for o in outs
    ]
    ISSUE10_REF.update(issue10_reference(llm, ref))
    # throughput of LLM.generate (for the side-by-side with the backend)
    many = prompts(256, 32, seed=7)
    sp2 = VSP(temperature=1.0, max_tokens=128, ignore_eos=True, detokenize=False, seed=0)
    llm.generate([{"prompt_token_ids": p} for p in many[:8]], sp2, use_tqdm=False)
    t0 = time.perf_counter()
    o2 = llm.generate([{"prompt_token_ids": p} for p in many], sp2, use_tqdm=False)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in o2)
    record_timing(
        "llm_generate_throughput",
        engine_start_s=round(t_start, 2),
        new_tokens=ntok,
        seconds=round(dt, 3),
        tok_per_s=round(ntok / dt),
    )
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return ref


REF_LOGPROBS: list[list[float]] = []  # LLM.generate's chosen-token logprobs, filled by llm_reference
ISSUE10_REF: dict = {}  # issue 10's parameters through LLM.generate, filled by llm_reference


def issue10_cases(ref):
    """name -> (vLLM SamplingParams kwargs, prompt index). Greedy unless seeded."""
    from tests.gpu.common import N_NEW

    base = dict(max_tokens=N_NEW, ignore_eos=True)
    return {
        "penalties": (
            dict(base, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
            0,
        ),
        "min_tokens": (dict(max_tokens=N_NEW, temperature=0.0, stop_token_ids=[ref[1][2]], min_tokens=6), 1),
        "min_p_seeded": (dict(base, temperature=1.0, min_p=0.1, seed=1234), 2),
        "top_k_logprobs": (dict(base, temperature=0.0, logprobs=5), 3),
        "prompt_logprobs": (dict(base, temperature=0.0, max_tokens=2, prompt_logprobs=3), 4),
    }


def issue10_reference(llm, ref):
    """Outputs of LLM.generate for issue10_cases and for stop strings (text too)."""
    from vllm import SamplingParams as VSP

    from tests.gpu.common import N_NEW, PROMPTS

    out = {}
    for name, (kw, i) in issue10_cases(ref).items():
        o = llm.generate([{"prompt_token_ids": PROMPTS[i]}], VSP(detokenize=False, **kw), use_tqdm=False)[0]
        c = o.outputs[0]
        row = {"token_ids": list(c.token_ids), "finish": c.finish_reason}
        if c.logprobs is not None:
            # per position: [(token id, logprob)] by rank (the sampled one is in the dict too)
            row["top"] = [sorted(((t, lp.logprob) for t, lp in d.items()), key=lambda x: -x[1]) for d in c.logprobs]
            row["chosen"] = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)]
        if o.prompt_logprobs is not None:
            row["prompt"] = [None if d is None else {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs]
        out[name] = row
    # stop strings: the text of tokens 6..7 of prompt 5's greedy output, as vLLM detokenizes it
    full = llm.generate(
        [{"prompt_token_ids": PROMPTS[5]}], VSP(max_tokens=N_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    words = full.text.split()
    stop = " ".join(words[6:8]) if len(words) > 8 else full.text[len(full.text) // 2 :][:6]
    out["stop"] = {"stop": stop, "full_text": full.text}
    for include in (False, True):
        sp = VSP(max_tokens=N_NEW, temperature=0.0, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
        c = llm.generate([{"prompt_token_ids": PROMPTS[5]}], sp, use_tqdm=False)[0].outputs[0]
        out["stop"][include] = {
            "token_ids": list(c.token_ids),
            "text": c.text,
            "finish": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
    return out


# Fixtures whose processes (vLLM engine cores, engine nodes) outlive one test.
_LONG_LIVED = {"backend", "llm_reference", "e2e", "e2e_cluster"}


@pytest.fixture(autouse=True)
def no_leaked_processes(request):
    """Overrides tests/conftest.py's check for GPU tests: tests that use a
    long-lived engine fixture are not checked (its processes are torn down with
    the fixture); multiprocessing's resource tracker is not a leak."""
    import psutil

    from tests.cluster import live_children

    before = {p.pid for p in live_children()}
    yield
    if _LONG_LIVED & set(request.fixturenames):
        return
    leaked = []
    for p in live_children():
        if p.pid in before:
            continue
        try:
            if any("resource_tracker" in a for a in p.cmdline()):
                continue
        except psutil.Error:
            continue
        leaked.append(p)
    if leaked:
        desc = [(p.pid, " ".join(p.cmdline()[:4])) for p in leaked]
        for p in leaked:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        pytest.fail(f"leaked processes: {desc}")
