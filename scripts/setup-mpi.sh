#!/usr/bin/env bash
# Installs what kiln-comm's `mpi` feature needs: OpenMPI (mpirun and its headers, from Debian's
# openmpi-bin and libopenmpi-dev), libclang (rsmpi's build script runs bindgen on mpi.h) and
# pkg-config (it finds OpenMPI's flags through ompi.pc). Idempotent: does nothing when mpirun,
# mpi.h, libclang and pkg-config are already there. Uses sudo only when not run as root.
set -euo pipefail

have_mpi_header() {
  # Debian puts mpi.h under /usr/lib/x86_64-linux-gnu/openmpi/include (found by pkg-config).
  pkg-config --exists ompi 2>/dev/null && [ -f "$(pkg-config --variable=includedir ompi)/mpi.h" ] && return 0
  compgen -G "/usr/lib/*/openmpi/include/mpi.h" >/dev/null || compgen -G "/usr/include/*/mpi.h" >/dev/null
}
have_libclang() {
  # The C library bindgen loads (libclang.so, libclang-14.so.1, …), not libclang-cpp.
  compgen -G "/usr/lib/llvm-*/lib/libclang.so*" >/dev/null \
    || compgen -G "/usr/lib/*/libclang.so*" >/dev/null || compgen -G "/usr/lib/*/libclang-[0-9]*.so*" >/dev/null
}

if command -v mpirun >/dev/null && command -v pkg-config >/dev/null && have_mpi_header && have_libclang; then
  echo "setup-mpi: OpenMPI, its headers, libclang and pkg-config are already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "setup-mpi: not root and no sudo: install openmpi-bin libopenmpi-dev libclang-dev pkg-config as root" >&2
    exit 1
  fi
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
echo "setup-mpi: installing openmpi-bin libopenmpi-dev libclang-dev pkg-config with apt-get"
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
  openmpi-bin libopenmpi-dev libclang-dev pkg-config
mpirun --version | head -n 1
