#!/bin/bash
# The GPU benchmarks (bench/gpu/) on the device machine, on the qwen05 preset (494M params, bf16).
# Sent with carry=[".device/vllm-bundle", ".device/bench-whl", ".device/make_tiny_model.py"] (NOT
# ".device": its vllm-bundle.stage folder is far over the 64 MiB limit):
#   .device/vllm-bundle/vllm-0.24.0-sm90-py312.tar.xz  (python3 ../shared/tools/vllm_bundle.py .device/vllm-bundle)
#   .device/bench-whl/*.whl  what the OpenAI api_server and launch.py import that the image and the
#                            bundle lack: uvicorn, watchfiles, model-hosting-container-standards,
#                            jmespath, prometheus-fastapi-instrumentator, structlog (bench/README.md)
#   .device/make_tiny_model.py  cp ../shared/tools/make_tiny_model.py .device/ (the presets' builder;
#                            only when MODEL is not built yet; TINY_MODEL_SCRIPT: another path)
# Env: WHAT=throughput (default) | weights | all | interleaved (IL_ARGS: its extra flags) | first_step (FS_ARGS) | prefix (PP_ARGS); MODEL (default /tmp/q05, built unless there);  NCCL=1: weights also on 2 GPUs (trainer 0, engine 1);
#      DEADLINE (s, default 540: everything ends by then); TP_ARGS / WU_ARGS: extra flags;
#      CHECK=0: weights without --check (on by default: the fast write path == load_weights, bit for bit).
# The weights run prints, per update, a TIMING line (control round trips, trainer pack/send, the engine's
# commit from its Stats timings: path load_weights+record|plan, copy/fallback/sync) and the medians; NCCL sets its group up at
# init first (warm_up_nccl) and reports that apart.
# Back in $OUT (8 files at most): run.log, setup.log, gpu_throughput.{json,png},
# gpu_weight_update.{json,png}, phase_logs.txt (tails of every phase / server log).
cd "$(dirname "$0")/../.." || exit 1   # the repository root
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE=${DEADLINE:-540}
WHAT=${WHAT:-throughput}
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
LOGS=/tmp/bench-logs; mkdir -p $LOGS
exec > >(tee -a "$OUT/run.log") 2>&1
{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -V; } > "$OUT/setup.log" 2>&1
cat "$OUT/setup.log"

export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
MODEL=${MODEL:-/tmp/q05}   # kept when already built (a warm machine keeps /tmp)
# the model builds on the GPU (torch + transformers of the image: not /tmp/site, half unpacked meanwhile)
[ -f $MODEL/config.json ] || (python3 ${TINY_MODEL_SCRIPT:-.device/make_tiny_model.py} $MODEL --preset qwen05 --device cuda > $LOGS/q05.log 2>&1 && echo "built qwen05 after $(( $(date +%s) - T0 ))s" || echo "qwen05 build FAILED") &
BUILD=$!   # waited for by pid: a bare `wait` would also wait for the tee above, forever
if [ ! -f /tmp/site/.bench-unpacked ]; then
  mkdir -p /tmp/site
  xz -T0 -dc .device/vllm-bundle/vllm-0.24.0-sm90-py312.tar.xz | tar -x -C /tmp/site || { echo "bundle unpack FAILED"; exit 1; }
  for w in .device/bench-whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site || echo "wheel $w FAILED"; done
  touch /tmp/site/.bench-unpacked
fi
echo "unpacked after $(( $(date +%s) - T0 ))s"
wait $BUILD
[ -f $MODEL/config.json ] || { tail -20 $LOGS/q05.log; exit 1; }
python3 -c "import vllm, uvicorn, structlog, prometheus_fastapi_instrumentator, model_hosting_container_standards.sagemaker, watchfiles, aiohttp; print('imports ok: vllm', vllm.__version__)" 2>&1 | tail -3

# PROFILE=1: the head, the engine nodes and the bench client's streams mode sample their Python stacks
# (bus/profiler.py; no ptrace needed) into $OUT/profiles.txt. Compare profiled runs with profiled runs only.
[ -n "$PROFILE" ] && export ROLLOUT_BUS_PROFILE_DIR=$LOGS/prof ROLLOUT_BUS_PROFILE_INTERVAL_S=${PROFILE_INTERVAL_S:-0.003}
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
tp_budget() { if [ "$WHAT" = all ]; then echo $(( ($(left) - 30) * 3 / 5 )); else echo $(( $(left) - 30 )); fi; }
if [ "$WHAT" = throughput ] || [ "$WHAT" = all ]; then
  B=$(tp_budget)
  echo "== gpu_throughput (budget ${B}s)"
  timeout -k 15 $(( B + 20 )) python3 -m bench.gpu.throughput --model $MODEL --out-dir "$OUT" --log-dir $LOGS/tp \
      --budget-s $B $TP_ARGS > $LOGS/gpu_throughput.out 2>&1
  echo "gpu_throughput rc=$? after $(( $(date +%s) - T0 ))s"; grep -E "^\[|^wrote" $LOGS/gpu_throughput.out
fi
if [ "$WHAT" = weights ] || [ "$WHAT" = all ]; then
  B=$(( $(left) - 30 ))
  N=""; [ -n "$NCCL" ] && [ "$NGPU" -ge 2 ] && N=--nccl
  [ "${CHECK:-1}" = 1 ] && N="$N --check"
  echo "== gpu_weight_update $N (budget ${B}s, $NGPU GPU(s))"
  timeout -k 15 $(( B + 20 )) python3 -m bench.gpu.weight_update --model $MODEL --out-dir "$OUT" --log-dir $LOGS/wu \
      --budget-s $B $N $WU_ARGS > $LOGS/gpu_weight_update.out 2>&1
  echo "gpu_weight_update rc=$? after $(( $(date +%s) - T0 ))s"; grep -E "^\[|^wrote|TIMING|CHECK" $LOGS/gpu_weight_update.out
fi
if [ "$WHAT" = interleaved ]; then
  # every path alive on the one GPU, reps interleaved, paired ratios (bench/gpu/interleaved.py)
  B=$(( $(left) - 30 ))
  echo "== gpu_interleaved (limit ${B}s)"
  timeout -k 15 $(( B + 20 )) python3 -m bench.gpu.interleaved --model $MODEL --out-dir "$OUT" --limit-s $B \
      $IL_ARGS > $LOGS/gpu_interleaved.out 2>&1
  echo "gpu_interleaved rc=$? after $(( $(date +%s) - T0 ))s"; cat "$OUT/gpu_interleaved.txt" 2>/dev/null
fi
if [ "$WHAT" = prefix ]; then
  # two vLLM engines on the one GPU, --policy prefix vs least_loaded (bench/gpu/prefix_placement.py; PP_ARGS: extra flags)
  B=$(( $(left) - 30 ))
  echo "== gpu_prefix_placement (budget ${B}s)"
  timeout -k 15 $(( B + 20 )) python3 -m bench.gpu.prefix_placement --model $MODEL --out-dir "$OUT" --budget-s $B \
      $PP_ARGS > $LOGS/gpu_prefix_placement.out 2>&1
  echo "gpu_prefix_placement rc=$? after $(( $(date +%s) - T0 ))s"; cat "$OUT/gpu_prefix_placement.txt" 2>/dev/null
fi
if [ "$WHAT" = first_step ]; then
  # vLLM's engine core in-process, stepped by hand: where a resume's first token goes (bench/gpu/first_step.py)
  B=$(( $(left) - 30 ))
  echo "== gpu_first_step (limit ${B}s)"
  timeout -k 15 $B python3 -m bench.gpu.first_step --model $MODEL --out-dir "$OUT" $FS_ARGS > $LOGS/gpu_first_step.out 2>&1
  echo "gpu_first_step rc=$? after $(( $(date +%s) - T0 ))s"; grep -vE "^(INFO|DEBUG|WARNING) " $LOGS/gpu_first_step.out | tail -60
fi
# every phase / server / engine log, tailed into one file (the 8-file limit)
for f in $(find $LOGS -type f -name "*.log" -o -type f -name "*.out" | sort); do
  echo "===== $f"; tail -c 4000 "$f"; echo
done > "$OUT/phase_logs.txt" 2>&1
[ -d $LOGS/prof ] && for f in $LOGS/prof/*.txt; do echo "===== $f"; head -c 6000 "$f"; echo; done > "$OUT/profiles.txt" 2>&1
echo "== done after $(( $(date +%s) - T0 ))s"
# the tables last
[ -f "$OUT/gpu_throughput.json" ] && python3 -m bench.gpu.throughput --plot-from "$OUT/gpu_throughput.json" 2>&1 | grep -v "^wrote"
[ -f "$OUT/gpu_weight_update.json" ] && python3 -m bench.gpu.weight_update --plot-from "$OUT/gpu_weight_update.json" 2>&1 | grep -v "^wrote"
exit 0
