#!/usr/bin/env bash
# Create .venv (once) and install this project with its test extras; create .venv-tpu (once) with
# libtpu for compiling TPU programs on this host (jax-serve-aot, its tests). Idempotent and safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
# torch==2.13.0 (CPU) is pinned in the dev extra; pip takes it from this machine's local copy.
.venv/bin/pip install -q -e '.[dev,bench]'
# libtpu lives apart: in .venv every JAX process would look for TPUs at start.
if [ ! -x .venv-tpu/bin/python ]; then
  "$PYTHON" -m venv .venv-tpu
  .venv-tpu/bin/pip install -q --upgrade pip
fi
.venv-tpu/bin/pip install -q -e '.[tpu-aot]'
