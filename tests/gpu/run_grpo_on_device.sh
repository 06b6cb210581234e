#!/bin/bash
# Issue 37 on one GPU machine, one device call (at most 250 + 290 + 20 s = 9.3 minutes on one H200; sent
# with carry=[".device"], the kit of tests/gpu/make_device_kit.sh + .device/make_tiny_model.py):
#   1. tests/gpu/test_grpo_gpu.py: examples/grpo_learn.py on a vLLM engine at the qwen05 preset with the
#      tokenizer's 4,096-id vocabulary (the test builds it; why: its docstring), 40 steps, colocated
#      (sleep / wake by tags, cuda_ipc zero-copy); on 2+ GPUs also trainer GPU 0 -> engine GPU 1 over nccl.
#      Writes $OUT/grpo_<variant>.json (per step: reward, phases, mismatch) and .png, TIMING rows.
#   2. bench/gpu/rl_loop.py: the same loop's step, rollout-bus colocated (rb1) against vLLM's LLM inside
#      the trainer (inproc); rb_nccl too with 2+ GPUs. Writes $OUT/gpu_rl_loop.{json,png} and the table.
# Env: GRPO_DEADLINE (s, step 1 incl. unpacking and the model build; default 250:
#      ~30 s unpacking, then the test ~190 s),
#      LOOP_BUDGET (s, step 2; default 290: rb1 starts in ~95 s, inproc's LLM in 60-90 s, then 2 arms x
#      4 rounds x 5 steps at ~1-2 s; with less, the second arm's readiness wait is cut by the budget),
#      LOOP_ARMS (default rb1,inproc; rb1,inproc,rb_nccl on 2 GPUs).
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BENCH=1 TESTS=tests/gpu/test_grpo_gpu.py DEADLINE=${GRPO_DEADLINE:-250} bash tests/gpu/run_on_device.sh
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=${LOOP_BUDGET:-290}
timeout -k 10 $((B + 20)) python3 -m bench.gpu.rl_loop --model /tmp/q05 --arms "${LOOP_ARMS:-rb1,inproc}" \
  --budget-s "$B" --out-dir "$OUT" > "$OUT/rl_loop.log" 2>&1
echo "rl_loop rc=$?"
grep -E "^\[|^\|" "$OUT/rl_loop.log" | cut -c1-400
for f in "$OUT"/gpu_rl_loop_logs/arm-*.log; do echo "---- $f"; tail -5 "$f" | cut -c1-300; done
