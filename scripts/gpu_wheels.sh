#!/usr/bin/env bash
# Wheels of what scripts/gpu_check.sh needs and the GPU image (Python 3.12, jax 0.11.2) lacks, into
# .whl/ (git-ignored), for the device tool to carry (carry: [".whl"]): tokamax and its pure-
# Python needs, grain + array_record + portpicker (the training stage's imports), tensorboardX.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "tokamax==0.0.12" "qwix==0.1.8" "einshape==1.0" "typeguard==2.13.3" "immutabledict==4.3.1" \
  "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5" \
  "grain==0.2.18" "array-record==0.8.6" "portpicker==1.6.0" "tensorboardX==2.6.5"
du -sh .whl
