#!/usr/bin/env bash
# Create .venv (once) and install this project with its test extras. Idempotent and safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
# torch==2.13.0 (CPU) is pinned in the dev extra; pip takes it from this machine's local copy.
.venv/bin/pip install -q -e '.[dev,bench]'
