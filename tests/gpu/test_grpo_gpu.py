"""examples/grpo_learn.py on GPUs (issue 37 §1, §2): vLLM engines at the qwen05
preset's architecture with the vocabulary cut to its tokenizer's 4,096 entries
(make_tiny_model.py --preset qwen05 --vocab 4096, built here on the GPU next to
ROLLOUT_BUS_GPU_BENCH_MODEL, which run_on_device.sh BENCH=1 sets; or
ROLLOUT_BUS_GRPO_MODEL, a ready dir), the trainer (an fp32 master, its bf16
copy pushed every step) in the example's own process:

- colocated: 1 engine on the trainer's GPU, sleep(1) while the trainer works,
  wake_up(["weights"]) -> cuda_ipc zero-copy push -> wake_up(["kv_cache"]);
- nccl (2 GPUs): the trainer alone on GPU 0, 1 engine on GPU 1.

Each writes, next to $ROLLOUT_BUS_GPU_TIMINGS (run_on_device.sh: $OUT), the
example's per-step records (grpo_<variant>.json: reward, phases generate /
sleep / train / sync / wake / idle, mismatch) and grpo_<variant>.png (reward
curve + step time by phase), and records a TIMING row of medians. Asserts:
every step's tokens are of the trainer's version, the bf16-engine vs
fp32-trainer mismatch stays small (mean |Δ| < MEAN_ABS_BF16; the same against
the bf16 copy in transformers, what a bf16 trainer sees, is recorded), and the reward
rises (mean of the last 5 steps >= the first step's + RISE).
ROLLOUT_BUS_GRPO_LR / ROLLOUT_BUS_GRPO_STEPS override the example's lr and the steps.

Why 4,096 and not the preset's 151,936: the reward (ids divisible by 8) is learnt
token by token, a random-weight model shares nothing among the target ids, and
a step samples 16 x 8 x 16 = 2,048 tokens: at 151,936 ids a token is sampled
0.013 times a step, so no id is seen often enough in 40 steps to be learnt (the
device run at lr 1e-4: the reward flat at 0.11-0.15 for 30 steps); at 4,096 ids
each is sampled ~0.5 times a step, and bench/gpu/grpo_sim.py (the same Trainer
and loss on CPU, the preset's shape at hidden 112) learns at the example's GPU
lr 1e-3 (reward 0.13 -> 0.29 at step 10, 0.99 at step 20; 1e-4 stays at 0.13).
The preset's tokenizer has 4,096 entries anyway: ids above it decode to
nothing, and the example's prompts are drawn below it.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from tests.cluster import ROOT, run_module
from tests.gpu.common import gpu_count, record_timing

BENCH_MODEL = os.environ.get("ROLLOUT_BUS_GPU_BENCH_MODEL")
GRPO_MODEL = os.environ.get("ROLLOUT_BUS_GRPO_MODEL")
STEPS = int(os.environ.get("ROLLOUT_BUS_GRPO_STEPS", "40"))
VOCAB = int(os.environ.get("ROLLOUT_BUS_GRPO_VOCAB", "4096"))  # 151936: the bench model itself
LR = os.environ.get("ROLLOUT_BUS_GRPO_LR")
MEAN_ABS_BF16 = 0.05
RISE = 0.15

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        not (BENCH_MODEL or GRPO_MODEL),
        reason="set ROLLOUT_BUS_GPU_BENCH_MODEL (run_on_device.sh BENCH=1) or ROLLOUT_BUS_GRPO_MODEL",
    ),
]


def _out_dir(tmp_path: Path) -> Path:
    t = os.environ.get("ROLLOUT_BUS_GPU_TIMINGS")
    return Path(t).parent if t else tmp_path


def _tiny_model_script() -> str:
    for p in (os.environ.get("TINY_MODEL_SCRIPT"), ".device/make_tiny_model.py", "../shared/tools/make_tiny_model.py"):
        if p and (Path(ROOT) / p).is_file():
            return str(Path(ROOT) / p)
    pytest.fail("make_tiny_model.py not found: set TINY_MODEL_SCRIPT (run_on_device.sh's kit has .device/)")


@pytest.fixture(scope="module")
def model() -> str:
    """The qwen05 preset at the tokenizer's vocabulary, built once on the GPU (seconds)."""
    if GRPO_MODEL or VOCAB == 151936:
        return str(GRPO_MODEL or BENCH_MODEL)
    out = Path(str(BENCH_MODEL)).parent / f"{Path(str(BENCH_MODEL)).name}-v{VOCAB}"
    if not (out / "config.json").is_file():
        argv = [_tiny_model_script(), str(out), "--preset", "qwen05", "--vocab", str(VOCAB), "--device", "cuda"]
        rc, log = run_module(argv, 180)
        assert rc == 0, log[-3000:]
    return str(out)


def _run(tmp_path: Path, model: str, variant: str, *extra: str) -> list[dict]:
    out = _out_dir(tmp_path)
    js = out / f"grpo_{variant}.json"
    argv = ["examples/grpo_learn.py", "--backend", "vllm", "--model", model, "--steps", str(STEPS)]
    argv += ["--prompts", "16", "--group", "8", "--max-tokens", "16", "--out", str(js), *extra]
    argv += ["--lr", LR] if LR else []
    rc, log = run_module(argv, 400)
    print(log[-3000:])
    assert rc == 0, log[-6000:]
    steps = json.loads(js.read_text())["steps"]
    from bench.gpu.rl_loop import PHASES, plot_run

    plot_run(steps, out / f"grpo_{variant}.png", f"grpo_learn {variant}: {Path(model).name}")
    body = steps[1:] or steps
    med = {k: round(statistics.median(s.get(k) or 0.0 for s in body) * 1e3, 1) for k in ("wall_s", *PHASES)}
    rewards = [round(s["reward"], 3) for s in steps]
    record_timing(
        f"grpo_{variant}",
        steps=len(steps),
        median_ms=med,
        rewards=rewards,
        mismatch_mean_abs=[float(f"{s['mismatch_mean_abs']:.3g}") for s in steps],
        mismatch_k3_median=statistics.median(s["mismatch_k3"] for s in steps),
        mismatch_frac_over_median=statistics.median(s["mismatch_frac_over"] for s in steps),
        # the same rollouts against the served bf16 copy evaluated by transformers (a bf16 trainer)
        served_bf16_mean_abs_median=statistics.median(s["mismatch_served_mean_abs"] for s in steps),
        served_bf16_k3_median=statistics.median(s["mismatch_served_k3"] for s in steps),
    )
    assert all(s["mismatch_stale_frac"] == 0.0 for s in steps)
    assert max(s["mismatch_mean_abs"] for s in steps) < MEAN_ABS_BF16, [s["mismatch_mean_abs"] for s in steps]
    assert statistics.mean(rewards[-5:]) >= rewards[0] + RISE, rewards
    return steps


def test_grpo_colocated_cuda_ipc(tmp_path, model):
    steps = _run(tmp_path, model, "cuda_ipc", "--transport", "cuda_ipc", "--engines", "1")
    assert all(s["sleep_s"] > 0 and s["wake_s"] > 0 for s in steps)  # colocated: slept and woke every step


def test_grpo_nccl_trainer_gpu0_engine_gpu1(tmp_path, model):
    if gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs (trainer GPU 0, engine GPU 1); {gpu_count()} visible")
    steps = _run(tmp_path, model, "nccl", "--transport", "nccl", "--engines", "1", "--engine-gpus", "1")
    assert all("sleep_s" not in s for s in steps)
