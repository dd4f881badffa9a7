#!/usr/bin/env bash
# The GPU check as staged checks (scripts/gpu_check.py has the list): < 10 min on one H100 or H200,
# compiles and the full-size Qwen3-8B step included; OUTDIR/result.json and OUTDIR/gpu_check.md are
# rewritten after every stage, and a stage that fails or runs past its budget does not stop the next. Needs only what the GPU image has
# (jax, flax, optax, orbax, transformers); packages it lacks (tokamax, grain) travel as wheels in
# .whl/ (scripts/gpu_wheels.sh makes them) and are installed here into a scratch folder.
#
#   scripts/gpu_check.sh OUTDIR                # on a GPU machine
#   scripts/gpu_check.sh OUTDIR --cpu-smoke    # every stage at tiny sizes on CPU (< 5 min)
#   scripts/gpu_check.sh OUTDIR --stages compile,correctness --inject-failure compile
#   scripts/gpu_check.sh OUTDIR --stages env,train     # the reduced step, not in a plain run
set -uo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 OUTDIR [--cpu-smoke] [--stages a,b] [--inject-failure STAGE[:hang]]" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=$1
shift
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  SITE=${TMPDIR:-/tmp}/gpu_check_site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
case " $* " in
  *" --cpu-smoke "*) export JAX_PLATFORMS=cpu ;;
  *) nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/nvidia_smi.csv" 2>&1 || true ;;
esac
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# 590 s: inside the device machine's 600 s per command even if every stage uses its whole budget.
timeout 590 "$PY" scripts/gpu_check.py "$OUT" "$@" 2>&1 | tee -a "$OUT/gpu_check.out"
