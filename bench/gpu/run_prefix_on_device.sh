#!/bin/bash
# Issue 24 §2 on the device machine: bench/gpu/prefix_placement.py on 2 GPUs, rollout-bus
# least_loaded / prefix against vllm-router cache_aware (consistent_hash, power_of_two as references),
# every arm alive at once, one engine per GPU each, reps interleaved.
# Build the kit here first: bash bench/gpu/make_router_kit.sh (it prints the carry's sizes), then
#   run(command="taskset -c 0-15 bash bench/gpu/run_prefix_on_device.sh", kind="nvidia-h200-x2", timeout_s=420,
#       carry=[".device/vllm-bundle", ".device/bench-whl", ".device/router", ".device/make_tiny_model.py"])
# Env: DEADLINE (s, default 400: everything ends by then), BUDGET (s, the bench's --budget-s, default what is
#      left after the set-up minus 20), PP_ARGS (extra flags, e.g. "--vllm-router cache_aware --reps 3"),
#      MODEL (default /tmp/q05, built unless there), SITE (default /tmp/site).
# taskset: the whole bench (engines, servers, routers, client) inherits the caller's CPU set.
# Back in $OUT (8 files at most; logs stay in /tmp/pp_logs): run.log, pp/gpu_prefix_placement.{json,txt,png},
# phase_logs.txt (the tail of every server / engine / router log).
cd "$(dirname "$0")/../.." || exit 1   # the repository root
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/pp"
DEADLINE=${DEADLINE:-400}
SITE=${SITE:-/tmp/site}
LOGS=/tmp/pp_logs; mkdir -p $LOGS
exec > >(tee -a "$OUT/run.log") 2>&1
nvidia-smi -L; python3 -V; echo "cpus: $(taskset -pc $$ 2>/dev/null | cut -d: -f2)"

export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=$SITE/bin:$PATH
MODEL=${MODEL:-/tmp/q05}
# the model builds on GPU 0 with the image's torch + transformers (not $SITE, half unpacked meanwhile)
[ -f $MODEL/config.json ] || (CUDA_VISIBLE_DEVICES=0 python3 .device/make_tiny_model.py $MODEL --preset qwen05 \
    --device cuda > $LOGS/q05.log 2>&1 && echo "built qwen05 after $(el)s" || echo "qwen05 build FAILED") &
BUILD=$!   # waited for by pid: a bare `wait` would also wait for the tee above, forever
if [ ! -f $SITE/.prefix-unpacked ]; then
  mkdir -p $SITE/bin
  [ -f $SITE/.bench-unpacked ] || {
    xz -T0 -dc .device/vllm-bundle/vllm-0.24.0-sm90-py312.tar.xz | tar -x -C $SITE || { echo "bundle unpack FAILED"; exit 1; }
    for w in .device/bench-whl/*.whl; do python3 -m zipfile -e "$w" $SITE || echo "wheel $w FAILED"; done
    touch $SITE/.bench-unpacked; }
  xz -T0 -dc .device/router/vllm-router-*-stripped.tar.xz | tar -x -C $SITE || { echo "router unpack FAILED"; exit 1; }
  for w in .device/router/*.whl; do python3 -m zipfile -e "$w" $SITE || echo "wheel $w FAILED"; done
  # the wheel's console script (vllm_router.launch_router:main), as pip would write it
  printf '#!/usr/bin/env python3\nimport sys\nfrom vllm_router.launch_router import main\nsys.exit(main())\n' \
    > $SITE/bin/vllm-router
  chmod +x $SITE/bin/vllm-router $SITE/vllm_router_rs.abi3.so
  touch $SITE/.prefix-unpacked
fi
echo "unpacked after $(el)s"
wait $BUILD
[ -f $MODEL/config.json ] || { tail -20 $LOGS/q05.log; exit 1; }
python3 -c "import vllm, uvicorn, structlog, aiohttp, orjson, fastapi, setproctitle, vllm_router_rs; print('imports ok: vllm', vllm.__version__)" 2>&1 | tail -3
vllm-router --help > /dev/null 2>&1 && echo "vllm-router ok: $(command -v vllm-router)" || { echo "vllm-router FAILED:"; vllm-router --help 2>&1 | tail -5; }

B=${BUDGET:-$(( DEADLINE - $(el) - 20 ))}
echo "== gpu_prefix_placement (budget ${B}s) after $(el)s"
timeout -k 15 $(( B + 15 )) python3 -m bench.gpu.prefix_placement --model $MODEL --out-dir "$OUT/pp" --log-dir $LOGS \
    --budget-s $B $PP_ARGS > $LOGS/gpu_prefix_placement.out 2>&1
echo "gpu_prefix_placement rc=$? after $(el)s"
grep -E "^\[" $LOGS/gpu_prefix_placement.out
# every server / engine / router log, tailed into one file (the 8-file limit)
for f in $(find $LOGS -type f \( -name "*.log" -o -name "*.out" \) | sort); do
  echo "===== $f"; tail -c 3000 "$f"; echo
done > "$OUT/phase_logs.txt" 2>&1
echo "== done after $(el)s"
cat "$OUT/pp/gpu_prefix_placement.txt" 2>/dev/null || tail -40 $LOGS/gpu_prefix_placement.out
exit 0
