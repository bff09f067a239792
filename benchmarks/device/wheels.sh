#!/usr/bin/env bash
# The wheels a lent GPU machine lacks for the engine, downloaded here into .whl/ (run from the
# repository root, once per session); benchmarks/device/gpu_targets.sh installs them there.
# That machine's image has JAX with CUDA, equinox, numpy and torch, but not levanter and what its
# modules import; its transformers is 5.x, which levanter refuses, so 4.57 travels with its
# tokenizers and huggingface_hub. datasets/dill/multiprocess are the versions that import with that
# huggingface_hub. About 27 MB, within the device tool's 64 MiB a call.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PYTHON:-.venv/bin/python}
WHEELS=(
  levanter==1.2.dev1644 haliax==1.4.dev453 llguidance==1.9.1
  draccus==0.11.6 mergedeep==1.3.4 aqtp==0.9.0 jmp==0.0.4 zstandard==0.25.0 humanfriendly==10.0
  tqdm-loggable==0.4.1 GitPython==3.2.1 gitdb==4.0.12 smmap==5.0.3 tblib==3.2.2 async-lru==2.4.0
  braceexpand==0.1.7 equinox==0.13.8
  transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.2
  datasets==3.6.0 dill==0.3.8 multiprocess==0.70.16
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
ls .whl | wc -l
du -sh .whl
