#!/usr/bin/env bash
# kiln-comm over MPI: installs OpenMPI when missing (scripts/setup-mpi.sh), builds the example
# comm/examples/mpi_check.rs with `--features mpi`, runs its checks on 2 and 3 ranks (rank 0
# prints one line per check), then checks that a rank dying, leaving or panicking mid-job ends
# the whole job with a non-zero status instead of a hang; then trains kiln's data-parallel
# step across processes (examples/mpi_train.rs). Extra arguments go to cargo build.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v mpirun >/dev/null || ! pkg-config --exists ompi 2>/dev/null; then
  scripts/setup-mpi.sh
fi
cargo build -p kiln-comm --features mpi --example mpi_check "$@"
BIN=target/debug/examples/mpi_check
for arg in "$@"; do
  if [ "$arg" = "--release" ]; then BIN=target/release/examples/mpi_check; fi
done
# Oversubscribe: the machine may have fewer cores than ranks. Root is allowed: CI runs as root.
MPIRUN=(mpirun --allow-run-as-root --oversubscribe)
for np in 2 3; do
  echo "== mpi_check on $np ranks"
  timeout 300 "${MPIRUN[@]}" -np "$np" "$BIN"
done

# A rank that exits non-zero, returns normally from main, or panics while the others wait in a
# collective: the job must end, non-zero, instead of hanging.
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
for mode in --die-rank --leave-rank --panic-rank; do
  echo "== mpi_check $mode 1 on 3 ranks: the job must end with a non-zero status, not hang"
  set +e
  start=$SECONDS
  timeout 120 "${MPIRUN[@]}" -np 3 "$BIN" "$mode" 1 >"$LOG" 2>&1
  status=$?
  set -e
  if [ "$status" -eq 124 ] || [ "$status" -eq 0 ]; then
    cat "$LOG"
    if [ "$status" -eq 124 ]; then
      echo "FAILED: the job hung (killed after 120 s)"
    else
      echo "FAILED: mpirun exited 0 although rank 1 left"
    fi
    exit 1
  fi
  echo "ok      mpirun ended the job with status $status after $((SECONDS - start)) s"
done

# kiln's data-parallel training step across processes, plain and with ZeRO stages 1 and 2 (the
# state sharded, uneven shards on 3 ranks): the zoo's mlp on 2 and 3 ranks, the
# ranks' weights bitwise identical after every step and within float tolerance of one process
# on the whole batch (examples/mpi_train.rs exits non-zero otherwise).
cargo build --features mpi --example mpi_train "$@"
DP=target/debug/examples/mpi_train
for arg in "$@"; do
  if [ "$arg" = "--release" ]; then DP=target/release/examples/mpi_train; fi
done
for np in 2 3; do
  for zero in 0 1 2; do
    echo "== mpi_train on $np ranks, ZeRO stage $zero"
    timeout 300 "${MPIRUN[@]}" -np "$np" "$DP" --zero "$zero"
  done
done
# The CUDA backend's data-parallel step across processes: each rank on an emulated CUDA device
# of its own (host memory; kernels built for the host), collectives staged through MPI; with
# ZeRO stage 2 on 3 ranks (uneven shards), reduce-scatters and all-gathers too.
echo "== mpi_train on 2 ranks, each on an emulated CUDA device"
timeout 600 "${MPIRUN[@]}" -x KILN_CUDA_EMULATE=1 -np 2 "$DP" --cuda
echo "== mpi_train on 3 ranks, each on an emulated CUDA device, ZeRO stage 2"
timeout 600 "${MPIRUN[@]}" -x KILN_CUDA_EMULATE=1 -np 3 "$DP" --cuda --zero 2
echo "mpi: all checks passed"
