#!/usr/bin/env bash
# The GPU issue's checklist, run on the accelerator machine from the repository root with the
# bundle in .gpu/ (built here by `../shared/tools/gpu-bundle`, see README "GPU"):
#
#   bash scripts/gpu/checklist.sh [STAGE ...]     default: every stage, in this order
#
# Stages: env tests guard seed gpt policies bench sanitizer peers-torch peers-jax peers-compile gemm
#         torch-stream (PyTorch's real allocation stream of the zoo's training steps, replayed by
#         `kiln torch-stream`; the trace is kept as torch_stream.json in the logs)
#         test-gpu (the CUDA backend's tests alone)
#         realscale (the real-scale training steps: each model exported from PyTorch on the machine,
#         `kiln train --bench` against PyTorch eager, then torch.compile, on the GPU; f32, TF32 off;
#         REALSCALE="name:batch ..." picks them)
# KILN_GPU_DEADLINE=S: every stage ends by S seconds after the start (later ones are skipped), so
# that one call ends in time.
# Every stage writes its log under $OUT/r/ (or target/kiln/gpu-run/ without $OUT) and has a time
# limit; a failing stage is recorded and the next one runs. The logs are tarred into
# $OUT/results.tgz (the device tool brings back at most 8 files) and a summary is printed last.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
out=${OUT:-$root/target/kiln/gpu-run}
# Logs go beside $OUT, not in it: the device tool brings back at most 8 files (results.tgz).
r=/tmp/kiln-gpu-run/r
rm -rf "$r"
mkdir -p "$r"
export KILN_OUT_DIR=$r KILN_RESULTS_DIR=$r/records KILN_CACHE_DIR=/tmp/kiln-cache RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
export KILN_REQUIRE_GPU=1
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so'; then
  lib=$(find /usr/local /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | head -n 1)
  [ -n "$lib" ] && export LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# cudarc loads NCCL as `libnccl.so`; PyTorch's wheel (nvidia-nccl-cu13) ships `libnccl.so.2`: link it.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  nccl=$(find /usr/local/lib /usr/lib /opt -name 'libnccl.so.2' 2>/dev/null | head -n 1)
  if [ -n "$nccl" ]; then
    mkdir -p /tmp/kiln-nccl && ln -sf "$nccl" /tmp/kiln-nccl/libnccl.so
    export LD_LIBRARY_PATH="/tmp/kiln-nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi
bin=$root/.gpu/bin
# Tests that run the CLI find it in the bundle, not at the path it was built at.
export KILN_BIN=$bin/bin-kiln
summary=$r/summary.txt
: > "$summary"
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(env tests guard seed policies bench sanitizer peers-torch peers-jax peers-compile gemm torch-stream)

# run NAME LIMIT_S COMMAND...: runs with a time limit, logs to $r/NAME.log, records status and time
run() {
  local name=$1 limit=$2; shift 2
  if [ -n "${KILN_GPU_DEADLINE:-}" ]; then
    # A stage ends by the deadline (its kill grace of 10 s included), whatever its own limit.
    local left=$((KILN_GPU_DEADLINE - SECONDS - 10))
    if [ "$left" -le 0 ]; then
      printf '%-28s skipped (past the deadline)\n' "$name" | tee -a "$summary"
      return 124
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >> "$r/$name.log" 2>&1
  local rc=$?
  printf '%-28s rc=%-4s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$summary"
  return $rc
}

zoo_shapes="256,784,1024;256,1024,1024;256,1024,10;64,4096,128;1024,256,256;1024,256,1024;1024,1024,256;1024,256,1000;4096,4096,4096"

for s in "${stages[@]}"; do
  case $s in
    env)
      { nvidia-smi; nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm --format=csv
        nvcc --version; ldconfig -p | grep -E 'libcuda\.so|libnvrtc' ; echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
        python3 -c 'import torch, jax; print("torch", torch.__version__, "jax", jax.__version__)'
        which compute-sanitizer; nproc; free -g; } > "$r/env.log" 2>&1
      echo "env: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)" | tee -a "$summary" ;;
    tests)
      for t in "$bin"/test-*; do
        run "test-$(basename "$t" | sed "s/^test-//")" 180 "$t" --test-threads=1
      done ;;
    guard)
      KILN_GUARD=1 run guard-gpu 300 "$bin/test-gpu" --test-threads=1
      KILN_GUARD=1 run guard-seed 120 "$bin/bin-kiln" --quiet ;;
    seed)
      # The main job, with the driver's view of the process sampled beside it.
      nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv -lms 100 > "$r/seed-smi.log" 2>&1 &
      smi=$!
      run seed 180 "$bin/bin-kiln"
      kill $smi 2>/dev/null; wait $smi 2>/dev/null
      run example-seed 180 "$bin/example-seed" ;;
    gpt)
      # The GPT example (trains from token ids, samples, checkpoints) on the best device.
      [ -x "$bin/example-gpt" ] && run example-gpt 240 "$bin/example-gpt" ;;
    policies)
      run devices-default 120 "$bin/bin-kiln" devices --seed
      run devices-growth 120 "$bin/bin-kiln" devices --seed --growth gpu:0
      run devices-fraction 120 "$bin/bin-kiln" devices --seed --fraction gpu:0=0.5
      run devices-limit 120 "$bin/bin-kiln" devices --seed --limit gpu:0=300MB
      run devices-logical 120 "$bin/bin-kiln" devices --seed --logical gpu:0=1GB,2GB
      for e in memory_growth memory_limit virtual_devices several_devices monitor_memory; do
        [ -x "$bin/example-$e" ] && run "example-$e" 120 "$bin/example-$e"
      done ;;
    bench)
      run bench-gpu 420 "$bin/bin-kiln" bench-gpu ;;
    sanitizer)
      # The main job (the seed model), then every op and every zoo training step (tests/gpu.rs).
      # racecheck instruments every shared-memory access: over the whole test binary it runs
      # past any limit, so it checks every op's kernels (forward and backward, split-K too).
      for tool in ${SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck}; do
        run "sanitizer-$tool-seed" 240 compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 50 \
          "$bin/bin-kiln" --quiet
        filter=""
        [ "$tool" = racecheck ] && filter=gpu_every_op_forward_and_backward_matches_cpu
        run "sanitizer-$tool-gpu-tests" 400 compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 50 \
          "$bin/test-gpu" --test-threads=1 $filter
      done ;;
    test-gpu)
      run test-gpu 300 "$bin/test-gpu" --test-threads=1 ;;
    realscale)
      rs=/tmp/kiln-realscale
      models=${REALSCALE:-"resnet50:32 efficientnet_b0:32 vit_b_16:16 gpt2:4 bert:8"}
      # Exported side by side on the CPUs while the GPU runs the first model; a marker per
      # model and batch says an export ended (a run of an earlier call leaves none behind).
      rm -f "$rs"-*.exported
      for m in $models; do
        ( timeout 300 python3 scripts/realscale/export.py "$rs/b${m#*:}" "${m%%:*}" --batch "${m#*:}" \
            > "$r/export-${m%%:*}.log" 2>&1; echo done > "$rs-${m%%:*}-${m#*:}.exported" ) &
      done
      for m in $models; do
        name=${m%%:*} batch=${m#*:}
        while [ ! -e "$rs-$name-$batch.exported" ]; do
          if [ -n "${KILN_GPU_DEADLINE:-}" ] && [ "$SECONDS" -ge "$KILN_GPU_DEADLINE" ]; then break; fi
          sleep 1
        done
        run "kiln-train-$name" 200 "$bin/bin-kiln" train "$rs/b$batch/$name.onnx" --batch "$batch" --steps 3 --bench 10
        run "torch-eager-$name" 120 python3 scripts/peers/torch_speed.py --realscale --train-only \
          --models "$name" --batch "$batch" --steps 10 --device cuda
        run "torch-eager-tf32-$name" 120 python3 scripts/peers/torch_speed.py --realscale --train-only \
          --models "$name" --batch "$batch" --steps 10 --device cuda --tf32
      done
      for m in $models; do
        run "torch-compile-${m%%:*}" 240 python3 scripts/peers/torch_speed.py --realscale --train-only \
          --compile-only --models "${m%%:*}" --batch "${m#*:}" --steps 10 --device cuda
      done
      wait ;;
    torch-stream)
      run torch-stream-record 200 python3 scripts/peers/torch_stream.py "$r/torch_stream.json"
      run torch-stream-replay 60 "$bin/bin-kiln" torch-stream "$r/torch_stream.json" ;;
    peers-torch)
      run peers-torch 300 python3 scripts/gpu/peers.py torch "$r/torch.json" ;;
    peers-compile)
      run peers-compile 480 python3 scripts/gpu/peers.py compile "$r/torch_compile.json" ;;
    peers-jax)
      run peers-jax 300 python3 scripts/gpu/peers.py jax "$r/jax.json" ;;
    gemm)
      [ -n "${SKIP_TORCH_GEMM:-}" ] || run gemm-torch 120 python3 scripts/gpu/peers.py gemm "$r/gemm_torch.json" --steps 50 --shapes "$zoo_shapes"
      [ -x "$bin/bin-kiln" ] && run gemm-kiln 300 "$bin/bin-kiln" bench-gemm --shapes "$zoo_shapes"
      [ -x "$bin/bin-kiln" ] && run gemm-kiln-bf16 300 "$bin/bin-kiln" bench-gemm --precision bf16 --shapes "$zoo_shapes" ;;
    *) echo "unknown stage $s" | tee -a "$summary" ;;
  esac
done
mkdir -p "$out"
tar -C "$(dirname "$r")" -czf "$out/results.tgz" r 2>/dev/null
echo "=== summary"
cat "$summary"
# The end of each failing log, so that the reply's tail carries the failures.
for f in "$r"/*.log; do
  if grep -qE 'FAILED|panicked|error|ERROR|Error' "$f"; then
    echo "=== $(basename "$f")"; grep -E 'FAILED|panicked|error:|ERROR|test result' "$f" | head -12
  fi
done
