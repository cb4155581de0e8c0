#!/usr/bin/env bash
# The tests, as CI runs them. Installs NVRTC (CUDA 13.0, from the PyPI package nvidia-cuda-nvrtc)
# into .nvrtc/ when it is not there yet, so that every CUDA kernel is compiled to PTX in the
# tests even without a GPU, then runs the whole workspace's tests. Extra arguments go to cargo test.
set -euo pipefail
cd "$(dirname "$0")/.."
NVRTC_VERSION=13.0.88
if [ ! -f .nvrtc/nvidia/cu13/lib/libnvrtc.so.13 ]; then
  echo "installing NVRTC $NVRTC_VERSION into .nvrtc/"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target .nvrtc \
    "nvidia-cuda-nvrtc==$NVRTC_VERSION"
fi
export KILN_REQUIRE_NVRTC=1
exec cargo test --workspace "$@"
