#!/usr/bin/env bash
# The Pallas kernel on an NVIDIA GPU, in one go (< 5 min on an H200): kernel vs the dense reference
# (values and gradients, two shapes), kernel vs xla fwd+bwd time and memory at T in {2048, 8192},
# A in {256, 512}, B=16, 32 q / 8 kv heads, d=128, bf16, and 20 steps of configs/tiny.yaml with
# attention_impl=pallas (against xla). Writes OUTDIR/gpu_check.md and OUTDIR/gpu_check.json.
#
#   scripts/gpu_check.sh OUTDIR               # on a GPU machine (after scripts/setup.sh + jax[cuda12])
#   scripts/gpu_check.sh OUTDIR --cpu-smoke   # tiny sizes on CPU, to check the script itself
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 OUTDIR [--cpu-smoke]" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=$1
shift
mkdir -p "$OUT"
if [ "${1:-}" != "--cpu-smoke" ]; then
  "$PY" -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.devices())"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia_smi.csv" || true
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 900 "$PY" scripts/gpu_check.py "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
