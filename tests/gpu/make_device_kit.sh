#!/bin/bash
# Build .device/ here (a machine with PyPI) for tests/gpu/run_on_device.sh and bench/gpu/run_on_device.sh
# on the device machine (no network there). Run from the repository root; takes ~2 minutes. What it holds
# (54 MiB with the tree's ~4 MiB: under the device's 64 MiB per call; send it with carry=[".device"]):
#   .device/vllm-bundle/   vLLM 0.24.0 for sm_90 + pyzmq, msgspec, ... (../shared/tools/vllm_bundle.py)
#   .device/whl/           structlog; compressed-tensors + loguru (test_vllm_fp8.py); skyrl 0.3.0, skyrl-gym 0.4.0,
#                          omegaconf 2.4.0, jsonschema & co (test_skyrl_gpu.py); pandas/dateutil/six/pyyaml are
#                          in the device image already
#   .device/ray-2.60.0-stripped.tar.xz
#                          ray without its Java jars, gcs_server/raylet binaries, dashboard build and
#                          ray.data/serve/tune/train/llm/rllib (79 -> 12 MB): SkyRL's weight_sync imports ray and
#                          its broadcast strategy calls ray._private.services.get_node_ip_address(); both work,
#                          a ray cluster cannot start (nothing here needs one)
#   .device/make_tiny_model.py   the presets' builder (qwen05, qwen7b), from ../shared/tools
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo /.device/ >> .git/info/exclude
mkdir -p .device/whl /tmp/vllm-wheel
[ -f .device/vllm-bundle/vllm-0.24.0-sm90-py312.tar.xz ] || {
  ls /tmp/vllm-wheel/vllm-0.24.0-*.whl >/dev/null 2>&1 || pip download -q --no-deps vllm==0.24.0 -d /tmp/vllm-wheel
  python3 ../shared/tools/vllm_bundle.py .device/vllm-bundle --wheel /tmp/vllm-wheel/vllm-0.24.0-*.whl
}
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$1" "${@:2}"; }
dl .device/whl structlog compressed-tensors==0.17.0 loguru==0.7.3 skyrl==0.3.0 skyrl-gym==0.4.0 omegaconf==2.4.0 \
  jsonschema jsonschema-specifications referencing rpds-py
if [ ! -f .device/ray-2.60.0-stripped.tar.xz ]; then
  rm -rf /tmp/ray-whl /tmp/ray-strip && mkdir -p /tmp/ray-whl /tmp/ray-strip
  dl /tmp/ray-whl ray==2.60.0
  (cd /tmp/ray-strip && unzip -q /tmp/ray-whl/ray-2.60.0-*.whl \
    && rm -rf ray/jars ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet ray/dashboard/client/build \
              ray/rllib ray/data ray/serve ray/tune ray/train ray/llm \
    && tar -cf - . | xz -T2 -6 > "$OLDPWD/.device/ray-2.60.0-stripped.tar.xz")
fi
cp ../shared/tools/make_tiny_model.py .device/
du -sh .device
