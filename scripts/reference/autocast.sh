#!/usr/bin/env bash
# Regenerates tests/data/autocast/*.json, PyTorch's side of the mixed-precision numerics check
# (kiln::autocast_reference, tests/autocast_numerics.rs): writes the starting weights and batches,
# trains them in PyTorch (f32, CPU autocast bf16, the CUDA autocast lists on the CPU) and keeps
# each run's losses and count sketch. PyTorch: $KILN_TORCH_PYTHON, else target/kiln/torch-venv
# (made here from PyPI's torch 2.15.0 and numpy when missing; about 5 GB).
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${KILN_TORCH_PYTHON:-target/kiln/torch-venv/bin/python}"
if ! "$python" -c "import torch, numpy" 2>/dev/null; then
  python3 -m venv target/kiln/torch-venv
  target/kiln/torch-venv/bin/pip install --quiet --disable-pip-version-check torch==2.15.0 numpy
  python=target/kiln/torch-venv/bin/python
fi
dir=target/kiln/autocast-reference
rm -rf "$dir"
cargo run --release --quiet --example autocast_reference -- inputs "$dir"
"$python" scripts/reference/autocast.py "$dir" 2 0.05
mkdir -p tests/data/autocast
cargo run --release --quiet --example autocast_reference -- references "$dir"
