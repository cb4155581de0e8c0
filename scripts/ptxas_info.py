#!/usr/bin/env python3
"""ptxas's register, spill and shared-memory figures for generated CUDA C files, no GPU needed.

Compiles each file with NVRTC (the one scripts/test.sh installs into .nvrtc/, or $NVRTC) to a
cubin for sm_90 with kiln's options (runtime/src/cuda/nvrtc.rs) plus --ptxas-options=-v, and
prints ptxas's lines. The GEMM figures in kernels/src/cuda/gemm.rs's module doc came from:

    KILN_DUMP_CUDA=/tmp/k cargo test -p kiln-kernels --release --test cuda_ops dump_for_device_checks
    python3 scripts/ptxas_info.py /tmp/k/bench_matmul_*.cu

(KILN_GEMM_VARIANT and KILN_GEMM_TILE, set for the cargo command, choose the kernels dumped.)
"""
import ctypes
import os
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
lib_dir = os.path.join(root, ".nvrtc", "nvidia", "cu13", "lib")
path = os.environ.get("NVRTC", os.path.join(lib_dir, "libnvrtc.so.13"))
# NVRTC loads its builtins library from the same directory.
ctypes.CDLL(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.13.0"), mode=ctypes.RTLD_GLOBAL)
nvrtc = ctypes.CDLL(path)
options = [
    b"--gpu-architecture=sm_90",
    b"--std=c++17",
    b"--fmad=true",
    b"--prec-div=true",
    b"--prec-sqrt=true",
    b"--ftz=false",
    b"--ptxas-options=-v",
]
for file in sys.argv[1:]:
    source = open(file, "rb").read()
    program = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, file.encode(), 0, None, None) != 0:
        sys.exit(f"{file}: nvrtcCreateProgram failed")
    status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    print(f"{os.path.basename(file)}:" + ("" if status == 0 else f" compile failed ({status})"))
    for line in log.value.decode(errors="replace").splitlines():
        if "ptxas" in line and ("Used" in line or "spill" in line) or status != 0:
            print("  " + line.strip())
