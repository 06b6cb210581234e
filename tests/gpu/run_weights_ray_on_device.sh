#!/bin/bash
# Issue 33 §3 (bench/gpu/fanout.py) and §4 (tests/gpu/test_ray_gpu.py) on the device machine (x4).
# Two kits, two carries (together over one call's 64 MiB):
#   call A (only for WHAT=ray, ~1 min): carry=[".device-ray"] (tests/gpu/make_ray_kit.sh build: ray with
#     gcs_server + raylet, 26.5 MiB, + 0.5 MiB of jsonschema wheels); run `bash tests/gpu/run_weights_ray_on_device.sh
#     unpack-ray`: it lands in /tmp/site-ray, which stays while the machine is warm (idle < its release time).
#   call B: carry=[".device/vllm-bundle", ".device/bench-whl", ".device/make_tiny_model.py"] and
#     WHAT=fanout  bench.gpu.fanout --nccl --colocated at 7B (trainer GPU 0 -> engines 1..3; 4 ranks -> 4 engines)
#     WHAT=ray     pytest tests/gpu/test_ray_gpu.py (two Ray nodes, 4 qwen05 engines over CURVE, kill one
#                  under load, the rb arm vs a local launch; one 7B NCCL update into 3 Ray-placed engines)
# Env: DEADLINE (s, default 570), PHASES (fanout: default "--nccl --colocated"; one per call on a warm machine
#      keeps each under the limit), FO_ARGS (extra fanout flags), NCCL_MODEL (default /tmp/q7b; /tmp/q05 to save
#      the 7B build's ~40 s), PYTEST_ARGS. Back in $OUT: run.log, gpu_fanout.{json,png} | pytest.log, timings.jsonl.
cd "$(dirname "$0")/../.." || exit 1
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WHAT=${WHAT:-${1:-fanout}}
DEADLINE=${DEADLINE:-570}
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
exec > >(tee -a "$OUT/run.log") 2>&1
if [ "$WHAT" = unpack-ray ]; then
  mkdir -p /tmp/site-ray && xz -T0 -dc .device-ray/ray-2.60.0-cluster.tar.xz | tar -x -C /tmp/site-ray || exit 1
  for w in .device-ray/whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site-ray; done
  PYTHONPATH=/tmp/site-ray python3 -c "import ray.scripts.scripts, ray; print('ray', ray.__version__, 'CLI ok')"
  ls -la /tmp/site-ray/ray/core/src/ray/raylet/raylet /tmp/site-ray/ray/core/src/ray/gcs/gcs_server
  echo "unpacked ray after $(( $(date +%s) - T0 ))s"; exit 0
fi
nvidia-smi -L; python3 -V
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_MODEL=${NCCL_MODEL:-/tmp/q7b}
build() {  # $1 dir, $2 preset, $3 GPU: the image's torch + transformers (not /tmp/site, half unpacked meanwhile)
  [ -f $1/config.json ] || (CUDA_VISIBLE_DEVICES=$3 PYTHONPATH= python3 .device/make_tiny_model.py $1 --preset $2 \
    --device cuda > /tmp/build-$2.log 2>&1 && echo "built $2 after $(( $(date +%s) - T0 ))s" || echo "$2 build FAILED")
}
build /tmp/q05 qwen05 1 & B1=$!
[ "$NCCL_MODEL" = /tmp/q7b ] && { build /tmp/q7b qwen7b 0 & B2=$!; }
if [ ! -f /tmp/site/.bench-unpacked ]; then
  mkdir -p /tmp/site
  xz -T0 -dc .device/vllm-bundle/vllm-0.24.0-sm90-py312.tar.xz | tar -x -C /tmp/site || { echo "bundle unpack FAILED"; exit 1; }
  for w in .device/bench-whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site || echo "wheel $w FAILED"; done
  touch /tmp/site/.bench-unpacked
fi
wait $B1 ${B2:-}
echo "set up after $(( $(date +%s) - T0 ))s"
case "$WHAT" in
fanout)
  timeout -k 10 $(left) python3 -m bench.gpu.fanout --model $NCCL_MODEL ${PHASES:---nccl --colocated} --out-dir "$OUT" \
    --log-dir /tmp/fanout-logs --budget-s $(( $(left) - 20 )) --gpu-memory-utilization 0.6 --streams 32 \
    --stream-max-tokens 512 --updates 3 ${FO_ARGS}
  echo "fanout rc=$? after $(( $(date +%s) - T0 ))s"
  for f in /tmp/fanout-logs/*.log; do echo "---- $f"; tail -n 25 "$f"; done > "$OUT/phase_logs.txt" 2>&1
  ;;
ray)
  [ -x /tmp/site-ray/ray/core/src/ray/raylet/raylet ] || { echo "no /tmp/site-ray: run call A (unpack-ray) first"; exit 1; }
  export PYTHONPATH=/tmp/site-ray:$PYTHONPATH ROLLOUT_BUS_GPU_BENCH_MODEL=/tmp/q05 ROLLOUT_BUS_GPU_NCCL_MODEL=$NCCL_MODEL
  export ROLLOUT_BUS_GPU_TIMINGS=$OUT/timings.jsonl
  timeout -k 10 $(left) python3 -m pytest tests/gpu/test_ray_gpu.py -v -s -rA --timeout 540 \
    -p no:unraisableexception ${PYTEST_ARGS} > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? after $(( $(date +%s) - T0 ))s"
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E " "$OUT/pytest.log" | tail -30
  PYTHONPATH=/tmp/site-ray python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
  ;;
esac
