#!/bin/bash
# Issue 24 §1's router benches on the device host, beside a GPU bench: bench.router_overhead
# (max_tokens 1 and 64 streamed tokens at c=1/64/256; rollout-bus head, the same head spinning
# with --busy-poll-us, vllm-router consistent_hash and power_of_two, each against its own direct
# twin) and bench.stream_latency (emit -> client lag, 1 and 256 streams), one after the other,
# pinned with taskset to CORES (default 16-31: the GPU bench keeps 0-15).
#
# Assumes (another kit sets these up; nothing here installs anything):
#   - the `vllm-router` launcher on PATH, its Python package and deps (orjson, setproctitle)
#     importable by the launcher's python: bench/gpu/run_prefix_on_device.sh unpacks
#     bench/gpu/make_router_kit.sh's kit into $SITE (/tmp/site) with the launcher in $SITE/bin
#     (added to PATH here when it exists). Missing or not starting: a clear line, and both benches
#     run without the vllm-router rows (their JSON says why in `vllm_router_skipped`).
#   - python3 with msgspec, pyzmq, aiohttp, psutil, structlog, numpy (the image, or $SITE on
#     PYTHONPATH: kept, and $SITE added when it exists and is not there yet).
#   Started beside the script that unpacks the kit: WAIT_FOR=/tmp/site/.prefix-unpacked waits (at most
#   WAIT_S, default 240 s) until that file exists before anything else.
# Env: OUT (default /tmp/out) -> results in $OUT/router/ only: router.txt (this script's output, the
#      tables included), router_overhead.json, stream_latency.json; PNG=1 adds the two PNGs (else draw
#      them later: python -m bench.router_overhead --plot-from router_overhead.json, same for
#      stream_latency); logs.tgz only when a bench failed.  At most 6 files; PACK=1: all of them
#      in ONE file, $OUT/router.tgz, instead (the device returns 8 files at most, a GPU bench's
#      included).
#      CORES (taskset list, default 16-31; CORES= runs unpinned), SPIN_US (one spinning head per
#      value, started with --busy-poll-us N: default "50 200"; 0: no spin arm), RO_SECONDS /
#      SL_SECONDS (each bench's --max-seconds: measuring stops there, the case running keeps its
#      complete repetitions, later ones are skipped, the JSON is written; default 230 / 80),
#      RO_ARGS / SL_ARGS (replace the size flags, e.g. for a dry run), PYTHON (default python3).
# Wall: 246 s on the 2-core VM with router_overhead at --reps 5 (194 s; stream_latency 51 s, paced by
# its 5 ms steps), so ~215 s at the --reps 4 below; 180-230 s expected on a 16-core host (the c=1
# cases, most of the time, run about as fast there);
# never more than RO_SECONDS + SL_SECONDS + ~30 s (start-up, tear-down, JSON), unless a bench hangs
# (then `timeout` ends it 90 s past its --max-seconds).
cd "$(dirname "$0")/.." || exit 1   # the repository root
T0=$(date +%s)
OUT=${OUT:-/tmp/out}
R=$OUT/router
mkdir -p "$R"
exec 3>&1 4>&2   # the caller's stdout/stderr, back once the tee below is closed
exec > >(tee -a "$R/router.txt") 2>&1
TEE=$!
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
if [ -n "$WAIT_FOR" ]; then
  W0=$(date +%s)
  while [ ! -e "$WAIT_FOR" ] && [ $(( $(date +%s) - W0 )) -lt "${WAIT_S:-240}" ]; do sleep 2; done
  [ -e "$WAIT_FOR" ] && echo "waited $(( $(date +%s) - W0 ))s for $WAIT_FOR" \
    || echo "$WAIT_FOR still missing after ${WAIT_S:-240}s: going on without it"
fi
CORES=${CORES-16-31}
SPIN_US=${SPIN_US:-50 200}
RO_SECONDS=${RO_SECONDS:-230}
SL_SECONDS=${SL_SECONDS:-80}
RO_ARGS=${RO_ARGS:-"--concurrency 1 64 256 --requests 400 --reps 4 --stream-tokens 64"}
SL_ARGS=${SL_ARGS:-"--streams 1 256 --step-delay-ms 5 --min-streams 8 --max-tokens 32 --reps 4"}
PLOT=--no-plot; [ "${PNG:-0}" = 1 ] && PLOT=
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ROLLOUT_BUS_BENCH_OUT=$R
if [ -d "$SITE" ]; then
  case ":$PYTHONPATH:" in *":$SITE:"*) ;; *) export PYTHONPATH=$PYTHONPATH:$SITE ;; esac
  [ -d "$SITE/bin" ] && export PATH=$SITE/bin:$PATH
fi
BENCH_LOGS=${TMPDIR:-/tmp}/rollout-bus-bench   # bench.procs: every child's log, /<bench pid>/<name>.log

echo "== router benches: $(date -u +%FT%TZ), $(nproc) CPUs visible, cores ${CORES:-all}, $($PY -V 2>&1), git $(git rev-parse --short HEAD 2>/dev/null)"
$PY -c "import msgspec, zmq, aiohttp, psutil, structlog, numpy" || {
  echo "router benches NOT RUN: $PY lacks one of msgspec, pyzmq, aiohttp, psutil, structlog, numpy (PYTHONPATH=$PYTHONPATH)"
  exit 2
}
if ! command -v vllm-router >/dev/null; then
  echo "vllm-router NOT on PATH: the vllm-router rows are left out (the benches' JSON says why)"
elif ! VR_ERR=$(timeout 30 vllm-router --help 2>&1 >/dev/null); then
  echo "vllm-router on PATH ($(command -v vllm-router)) but its launcher fails; the benches try it and leave its rows out if it does not start:"
  echo "$VR_ERR" | tail -5
else
  echo "vllm-router: $(command -v vllm-router)"
fi
PIN=()
if [ -n "$CORES" ]; then
  if taskset -c "$CORES" true 2>/dev/null; then PIN=(taskset -c "$CORES"); else echo "taskset -c $CORES failed: running unpinned"; fi
fi

FAILED=0
bench() {  # name, --max-seconds, args...: bounded by `timeout` as well (a hung tear-down ends too)
  local name=$1 secs=$2; shift 2
  echo "== $name (--max-seconds $secs) $*"
  local t=$(date +%s)
  timeout -k 10 $(( ${secs%.*} + 90 )) "${PIN[@]}" $PY -m bench.$name --max-seconds "$secs" $PLOT "$@"
  local rc=$?
  echo "$name rc=$rc after $(( $(date +%s) - t ))s"
  [ $rc = 0 ] || FAILED=1
}
bench router_overhead "$RO_SECONDS" $RO_ARGS --spin-us $SPIN_US
bench stream_latency "$SL_SECONDS" $SL_ARGS

if [ $FAILED = 1 ] && [ -d "$BENCH_LOGS" ]; then
  tar -czf "$R/logs.tgz" -C "$BENCH_LOGS" . 2>/dev/null && echo "a bench failed: its processes' logs in $R/logs.tgz"
fi
echo "== router benches done after $(( $(date +%s) - T0 ))s; in $R: $(ls "$R" | tr '\n' ' ')"
exec 1>&3 2>&4   # router.txt complete: the tee reads to its end and exits
wait $TEE 2>/dev/null || sleep 1
if [ "${PACK:-0}" = 1 ]; then
  tar -czf "$OUT/router.tgz" -C "$OUT" router && rm -rf "$R" && echo "packed into $OUT/router.tgz: $(tar -tzf "$OUT/router.tgz" | tr '\n' ' ')"
fi
exit $FAILED
