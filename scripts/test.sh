#!/usr/bin/env bash
# The tests, as CI runs them. Installs NVRTC (CUDA 13.0, from the PyPI package nvidia-cuda-nvrtc)
# into .nvrtc/ when it is not there yet, so that every CUDA kernel is compiled to PTX in the
# tests even without a GPU, then runs the whole workspace's tests, then the CUDA tests again on the
# emulated device. Installs ONNX's backend node tests (the data inside the PyPI package onnx) into
# .onnx/ for tests/onnx_conformance.rs. Then the MPI tests (scripts/test-mpi.sh, which installs
# Debian's OpenMPI when missing). Extra arguments go to cargo test.
set -euo pipefail
cd "$(dirname "$0")/.."
NVRTC_VERSION=13.0.88
if [ ! -f .nvrtc/nvidia/cu13/lib/libnvrtc.so.13 ]; then
  echo "installing NVRTC $NVRTC_VERSION into .nvrtc/"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target .nvrtc \
    "nvidia-cuda-nvrtc==$NVRTC_VERSION"
fi
export KILN_REQUIRE_NVRTC=1
ONNX_VERSION=1.17.0
if [ ! -d .onnx/onnx/backend/test/data/node ] || [ ! -d ".onnx/onnx-$ONNX_VERSION.dist-info" ]; then
  echo "installing onnx $ONNX_VERSION (its backend test data) into .onnx/"
  rm -rf .onnx
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target .onnx \
    "onnx==$ONNX_VERSION"
fi
export KILN_ONNX_DATA="$PWD/.onnx/onnx/backend/test/data" KILN_REQUIRE_ONNX_DATA=1
cargo test --workspace "$@"
# The CUDA backend end to end on the emulated device (generated kernels built for the host):
# the GPU tests, the device policies and the gradients' ::cuda variants, none of which may skip
# (the emulator's own tests, tests/emulated.rs, ran above: they start the emulated device
# themselves).
echo "CUDA tests on the emulated device (KILN_CUDA_EMULATE=1)"
KILN_CUDA_EMULATE=1 KILN_REQUIRE_GPU=1 cargo test --test gpu --test devices "$@"
KILN_CUDA_EMULATE=1 KILN_REQUIRE_GPU=1 cargo test --test gradients "$@" -- ::cuda
# Data parallelism across processes: OpenMPI (installed by scripts/setup-mpi.sh when missing),
# kiln-comm's checks and kiln's data-parallel step on 2 and 3 ranks.
scripts/test-mpi.sh
