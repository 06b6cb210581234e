#!/bin/bash
# Builds what bench/gpu/run_prefix_on_device.sh needs on the device machine (no network there) beside
# the vLLM bundle, under the repository's .device/ (git-ignored):
#   .device/router/vllm-router-0.1.17-stripped.tar.xz  the vllm-router wheel's files (python package, its
#        Rust extension vllm_router_rs.abi3.so with its symbols stripped: 62 -> ~50 MB, and the
#        OpenSSL/PCRE libraries it links), xz-packed (~13 MB); unpacked into /tmp/site on the device
#   .device/router/orjson-*.whl  (cp312 manylinux) the one Python dependency of vllm-router's launcher
#        that neither the device image (aiohttp, requests) nor the vLLM bundle (fastapi, setproctitle)
#        nor .device/bench-whl (uvicorn) carries
#   .device/bench-whl/*.whl  uvicorn, watchfiles, model-hosting-container-standards, jmespath,
#        prometheus-fastapi-instrumentator, structlog (bench/README.md), when not there yet
# and prints the size of each path the device call carries (64 MiB in all at most).
# Needs: pip (registry access), unzip, strip, xz. Usage (from anywhere): bash bench/gpu/make_router_kit.sh
set -euo pipefail
cd "$(dirname "$0")/../.."   # the repository root
VR_VERSION=${VR_VERSION:-0.1.17}
ORJSON_VERSION=${ORJSON_VERSION:-3.11.5}
DEV=.device
KIT=$DEV/router
WORK=$(mktemp -d /tmp/router-kit.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
PIP_DL=(python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64)

mkdir -p "$KIT"
TAR=$KIT/vllm-router-$VR_VERSION-stripped.tar.xz
if [ ! -f "$TAR" ]; then
  "${PIP_DL[@]}" -d "$WORK/whl" "vllm-router==$VR_VERSION" >/dev/null
  mkdir -p "$WORK/x"
  unzip -q "$WORK"/whl/vllm_router-*.whl -d "$WORK/x"
  # symbols only: the dynamic table (PyInit_vllm_router_rs, the libraries' imports) stays
  strip --strip-unneeded "$WORK/x/vllm_router_rs.abi3.so"
  tar -C "$WORK/x" -cf - . | xz -T0 -9 > "$TAR.tmp"
  mv "$TAR.tmp" "$TAR"
fi
ls "$KIT"/orjson-*.whl >/dev/null 2>&1 || "${PIP_DL[@]}" -d "$KIT" "orjson==$ORJSON_VERSION" >/dev/null
if ! ls $DEV/bench-whl/uvicorn-*.whl >/dev/null 2>&1; then
  "${PIP_DL[@]}" -d $DEV/bench-whl uvicorn==0.54.0 watchfiles==1.3.0 model-hosting-container-standards==0.1.16 \
      jmespath==1.1.0 prometheus-fastapi-instrumentator==8.1.0 structlog==26.1.0 >/dev/null
fi
[ -f $DEV/make_tiny_model.py ] || cp ../shared/tools/make_tiny_model.py $DEV/ 2>/dev/null \
  || cp /work/shared/tools/make_tiny_model.py $DEV/ 2>/dev/null || echo "WARNING: no .device/make_tiny_model.py"
[ -f $DEV/vllm-bundle/vllm-0.24.0-sm90-py312.tar.xz ] \
  || echo "WARNING: no .device/vllm-bundle (python3 ../shared/tools/vllm_bundle.py .device/vllm-bundle)"
echo "carry (64 MiB at most in all):"
du -sh $DEV/vllm-bundle $DEV/bench-whl $DEV/router $DEV/make_tiny_model.py 2>/dev/null || true
du -sch $DEV/vllm-bundle $DEV/bench-whl $DEV/router $DEV/make_tiny_model.py 2>/dev/null | tail -1
