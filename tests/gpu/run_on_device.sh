#!/bin/bash
# Run tests/gpu on the device machine (see tests/gpu/RESULTS.md). Needs, sent with carry=[".device"]
# (tests/gpu/make_device_kit.sh builds all of it):
#   .device/vllm-bundle/ (python3 ../shared/tools/vllm_bundle.py .device/vllm-bundle)
#   .device/whl/structlog-*.whl (pip download --no-deps --only-binary=:all: --python-version 3.12 structlog -d .device/whl)
#   .device/whl/compressed_tensors-0.17.0 + loguru wheels (test_vllm_fp8.py: vLLM's fp8 config imports them;
#     pip download --no-deps --only-binary=:all: --python-version 3.12 compressed-tensors==0.17.0 loguru -d .device/whl)
#   .device/make_tiny_model.py (only for BENCH=1; copy of ../shared/tools/make_tiny_model.py)
# Env: BENCH=1 (0.5B benchmark), TESTS (default tests/gpu), TESTS_GPU1 (x2: run TESTS on GPU 0 and
#      these on GPU 1 at once), DEADLINE (s), PYTEST_ARGS,
#      ROLLOUT_BUS_BUNDLE_DIR / WHL_DIR / TINY_MODEL_SCRIPT: where those are when this tree is not the
#      one carried (e.g. a worktree copied to .device/wt-x: ROLLOUT_BUS_BUNDLE_DIR=../vllm-bundle WHL_DIR=../whl).
cd "$(dirname "$0")/../.." || exit 1
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L > "$OUT/setup.log" 2>&1
BUNDLE=${ROLLOUT_BUS_BUNDLE_DIR:-.device/vllm-bundle}; WHL=${WHL_DIR:-.device/whl}
mkdir -p /tmp/site && xz -T0 -dc "$BUNDLE"/vllm-0.24.0-sm90-py312.tar.xz | tar -x -C /tmp/site || exit 1
for w in "$WHL"/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
# ray, stripped (tests/gpu/make_device_kit.sh): SkyRL's weight_sync imports it
RAY_TAR=${RAY_TAR:-$(dirname "$WHL")/ray-2.60.0-stripped.tar.xz}
[ -f "$RAY_TAR" ] && xz -T0 -dc "$RAY_TAR" | tar -x -C /tmp/site
echo "unpacked after $(( $(date +%s) - T0 ))s"
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export ROLLOUT_BUS_GPU_TIMINGS=$OUT/timings.jsonl ROLLOUT_BUS_GPU_MODEL_DIR=/tmp/models
if [ -n "$BENCH" ]; then
  (python3 ${TINY_MODEL_SCRIPT:-.device/make_tiny_model.py} /tmp/q05 --preset qwen05 --device cuda > "$OUT/q05.log" 2>&1 && echo built q05) &
  export ROLLOUT_BUS_GPU_BENCH_MODEL=/tmp/q05
fi
wait
LEFT=$(( ${DEADLINE:-570} - ($(date +%s) - T0) ))
summary() {  # $1: a pytest log
  echo "---- $1"
  grep -E "^TIMING" "$1" | cut -c1-600
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$1" | cut -c1-220 | tail -40
  grep -nE "^E  |Error:|error:" "$1" | grep -v "TIMING" | head -40 | cut -c1-300
}
if [ -n "$TESTS_GPU1" ]; then
  # Two pytest processes at once, one per GPU (x2): TESTS on GPU 0, TESTS_GPU1 on GPU 1. Never two
  # on one GPU: vLLM's start-up memory profiling fails when another process frees memory meanwhile.
  CUDA_VISIBLE_DEVICES=0 ROLLOUT_BUS_GPU_MODEL_DIR=/tmp/models0 ROLLOUT_BUS_GPU_TIMINGS=$OUT/timings0.jsonl \
    timeout -k 10 $LEFT python3 -m pytest ${TESTS:-tests/gpu} -v -s -rA --timeout 300 -p no:unraisableexception \
    ${PYTEST_ARGS} > "$OUT/pytest.log" 2>&1 &
  P0=$!
  CUDA_VISIBLE_DEVICES=1 ROLLOUT_BUS_GPU_MODEL_DIR=/tmp/models1 ROLLOUT_BUS_GPU_TIMINGS=$OUT/timings1.jsonl \
    timeout -k 10 $LEFT python3 -m pytest $TESTS_GPU1 -v -s -rA --timeout 300 -p no:unraisableexception \
    ${PYTEST_ARGS} > "$OUT/pytest_gpu1.log" 2>&1 &
  P1=$!
  wait $P0; R0=$?; wait $P1; R1=$?
  echo "pytest rc=$R0 (GPU 0) rc=$R1 (GPU 1) after $(( $(date +%s) - T0 ))s"
  summary "$OUT/pytest.log"; summary "$OUT/pytest_gpu1.log"
else
  timeout -k 10 $LEFT python3 -m pytest ${TESTS:-tests/gpu} -v -s -rA --timeout 300 -p no:unraisableexception ${PYTEST_ARGS} > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? after $(( $(date +%s) - T0 ))s"
  summary "$OUT/pytest.log"
fi
ls /tmp/pytest-of-root/*/ 2>/dev/null | head -3
for f in $(ls -d /tmp/rbt-* 2>/dev/null | head -3); do tail -c 3000 $f/e0.log > "$OUT/$(basename $f)_e0.log" 2>/dev/null; done
