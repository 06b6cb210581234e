#!/bin/bash
# Issue 33 §2/§5 on the device machine: bench/gpu/scale_out.py (qwen05 preset), one engine per GPU,
# N = 1, 2, 4 limited by the GPUs this job sees (CUDA_VISIBLE_DEVICES counts: launch.py maps --gpus through it).
# Build the kit here first: bash bench/gpu/make_router_kit.sh (vllm-router; the vllm-router arm is a row
# with the reason without it), then e.g.
#   run(command="bash bench/gpu/run_scale_on_device.sh", kind="nvidia-h200-x4", timeout_s=600,
#       carry=[".device/vllm-bundle", ".device/bench-whl", ".device/router", ".device/make_tiny_model.py"])
# Env: DEADLINE (s, default 570), BUDGET (the bench's --budget-s, default what is left after the set-up
#      minus 20), SO_ARGS (extra flags: "--engines 1" smoke on one GPU, "--engines 4 --kill-one" for §5,
#      "--arms rb,vllm-dp --workloads grpo" to split a run over calls), MODEL (default /tmp/q05), SITE.
# Back in $OUT: run.log, so/gpu_scale_out.{json,png}, so/tables.txt, phase_logs.txt.
cd "$(dirname "$0")/../.." || exit 1   # the repository root
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/so"
DEADLINE=${DEADLINE:-570}
SITE=${SITE:-/tmp/site}
LOGS=/tmp/so_logs; mkdir -p $LOGS
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
if [ ! -f $SITE/.scale-unpacked ]; then
  mkdir -p $SITE/bin
  [ -f $SITE/.bench-unpacked ] || {
    xz -T0 -dc .device/vllm-bundle/vllm-0.24.0-sm90-py312.tar.xz | tar -x -C $SITE || { echo "bundle unpack FAILED"; exit 1; }
    for w in .device/bench-whl/*.whl; do python3 -m zipfile -e "$w" $SITE || echo "wheel $w FAILED"; done
    touch $SITE/.bench-unpacked; }
  if ls .device/router/vllm-router-*-stripped.tar.xz > /dev/null 2>&1; then  # optional: its arm says why without
    xz -T0 -dc .device/router/vllm-router-*-stripped.tar.xz | tar -x -C $SITE || echo "router unpack FAILED"
    for w in .device/router/*.whl; do python3 -m zipfile -e "$w" $SITE || echo "wheel $w FAILED"; done
    # the wheel's console script (vllm_router.launch_router:main), as pip would write it
    printf '#!/usr/bin/env python3\nimport sys\nfrom vllm_router.launch_router import main\nsys.exit(main())\n' \
      > $SITE/bin/vllm-router
    chmod +x $SITE/bin/vllm-router $SITE/vllm_router_rs.abi3.so
  fi
  touch $SITE/.scale-unpacked
fi
echo "unpacked after $(el)s"
wait $BUILD
[ -f $MODEL/config.json ] || { tail -20 $LOGS/q05.log; exit 1; }
python3 -c "import vllm, uvicorn, structlog, aiohttp, fastapi, setproctitle; print('imports ok: vllm', vllm.__version__)" 2>&1 | tail -3
vllm-router --help > /dev/null 2>&1 && echo "vllm-router ok: $(command -v vllm-router)" || echo "no vllm-router: its arm is a row with the reason"

B=${BUDGET:-$(( DEADLINE - $(el) - 20 ))}
echo "== gpu_scale_out (budget ${B}s) after $(el)s"
timeout -k 15 $(( B + 15 )) python3 -m bench.gpu.scale_out --model $MODEL --out-dir "$OUT/so" --log-dir $LOGS \
    --budget-s $B --phase-limit-s $B $SO_ARGS > $LOGS/gpu_scale_out.out 2>&1
echo "gpu_scale_out rc=$? after $(el)s"
grep -E "^\[" $LOGS/gpu_scale_out.out
for f in $(find $LOGS -type f \( -name "*.log" -o -name "*.out" \) | sort); do
  echo "===== $f"; tail -c 3000 "$f"; echo
done > "$OUT/phase_logs.txt" 2>&1
sed -n '/^Scale-out/,$p' $LOGS/gpu_scale_out.out > "$OUT/so/tables.txt"
echo "== done after $(el)s"
cat "$OUT/so/tables.txt" 2>/dev/null || tail -40 $LOGS/gpu_scale_out.out
exit 0
