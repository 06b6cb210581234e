#!/bin/bash
# Ray for a REAL Ray cluster on the device machine (tests/gpu/test_ray_gpu.py, issue 33 §4): the
# second strip variant of ray 2.60.0. make_device_kit.sh's strip (12 MB) drops gcs_server and raylet, so
# `ray start` cannot work from it; this one KEEPS gcs_server, raylet, _raylet.so, ray/_private,
# ray/autoscaler, ray/dashboard's Python (the raylet starts its agents from there) and the `ray` CLI
# (python -m ray.scripts.scripts), and drops the Java jars, the dashboard's web build and
# ray.data/serve/tune/train/llm/rllib.
#
#   tests/gpu/make_ray_kit.sh build   .device-ray/ray-2.60.0-cluster.tar.xz from the cp312 wheel (PyPI)
#                                     (26.5 MiB measured: with the ~45 MiB vLLM kit it is over one call's 64 MiB carry:
#                                     it goes in its OWN call to the warm machine, unpacked under /tmp,
#                                     which stays while the machine is warm: tests/gpu/README.md)
#   tests/gpu/make_ray_kit.sh check   the same strip applied to THIS machine's installed ray (its
#                                     Python's build), then `ray start --head`, `ray status`,
#                                     `ray stop` with PYTHONPATH=<the stripped tree> only (~30 s)
set -euo pipefail
cd "$(dirname "$0")/../.."
strip_ray() {  # $1: a folder holding ray/ (an unpacked wheel or a copy of site-packages/ray)
  rm -rf "$1"/ray/jars "$1"/ray/dashboard/client/build "$1"/ray/rllib "$1"/ray/data "$1"/ray/serve \
         "$1"/ray/tune "$1"/ray/train "$1"/ray/llm
  find "$1"/ray -name __pycache__ -type d -prune -exec rm -rf {} +
}
case "${1:-build}" in
build)
  ex=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$ex")"
  grep -qx '/.device-ray/' "$ex" 2>/dev/null || echo /.device-ray/ >> "$ex"
  mkdir -p .device-ray /tmp/ray-whl
  ls /tmp/ray-whl/ray-2.60.0-cp312-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps \
    --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
    -d /tmp/ray-whl ray==2.60.0
  rm -rf /tmp/ray-cluster-strip && mkdir -p /tmp/ray-cluster-strip
  (cd /tmp/ray-cluster-strip && unzip -q /tmp/ray-whl/ray-2.60.0-cp312-*.whl)
  strip_ray /tmp/ray-cluster-strip
  test -x /tmp/ray-cluster-strip/ray/core/src/ray/gcs/gcs_server && test -x /tmp/ray-cluster-strip/ray/core/src/ray/raylet/raylet
  (cd /tmp/ray-cluster-strip && tar -cf - . | xz -T2 -6 > "$OLDPWD/.device-ray/ray-2.60.0-cluster.tar.xz")
  # ray's own requirements that the device image and the vLLM bundle lack (the rest: click, msgpack,
  # protobuf, pyyaml, requests, filelock, packaging come with them)
  mkdir -p .device-ray/whl && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d .device-ray/whl jsonschema jsonschema-specifications referencing rpds-py
  du -sh .device-ray/*
  ;;
check)
  src=$(python3 -c 'import os, ray; print(os.path.dirname(os.path.dirname(ray.__file__)))')
  tmp=$(mktemp -d /tmp/ray-strip-check.XXXX)
  trap 'PYTHONPATH=$tmp python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
  cp -a "$src/ray" "$tmp/" && strip_ray "$tmp"
  echo "stripped tree: $(du -sm "$tmp" | cut -f1) MiB unpacked"
  # RAY_AUTH_MODE=disabled: ray 2.60 turns token auth on at `ray start` and `ray status` then wants the
  # token file; this check is about the stripped tree, on loopback
  export PYTHONPATH=$tmp RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
  python3 -c "import ray, sys; assert ray.__file__.startswith('$tmp'), ray.__file__; print('ray from', ray.__file__)"
  python3 -m ray.scripts.scripts start --head --port 6390 --num-cpus 1 --include-dashboard=false \
    --node-ip-address 127.0.0.1 --disable-usage-stats
  python3 -m ray.scripts.scripts status
  python3 -m ray.scripts.scripts stop --force
  echo "OK: ray start / status / stop from the stripped tree"
  ;;
*) echo "usage: $0 build|check" >&2; exit 2 ;;
esac
