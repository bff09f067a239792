#!/usr/bin/env bash
# Issue 24's GPU figures in one call of the device tool (the repository root is the working
# directory there; name .whl in `carry`, made here by benchmarks/device/wheels.sh):
#   1. the engine on Llama-3.2-1B's shape (bf16, random weights, a 2048-token budget, 128 in /
#      128 out) at batch 1, 16 and 64 on one engine: output tok/s against batch / decode step (the
#      issue asks >= 70% at 16 and 64), and the batch-1 step against the copy-measured bandwidth
#      bound (the issue asks <= 1.5x);
#   2. compile time of a 4- and a 32-layer model of one width, xla and tpu backends (<= 1.5x).
# `gpu_targets.sh engine` runs part 1, `gpu_targets.sh compile` part 2, no argument both (one
# device call allows 600 s: run them as two calls if the machine is slow to start). Each part runs
# under its own time limit, so what it printed returns; all of it is also under $OUT.
# A smoke run on a CPU host: SHAPE=bench-110m BATCH=1,2 LAYERS=2,4 BACKENDS=xla benchmarks/device/gpu_targets.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-targets}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  # levanter's __init__ imports its training stack (ray, wandb, ...); the engine needs only its models
  echo '__version__ = "1.2"' > /tmp/site/levanter/__init__.py
  # haliax 1.4.dev453 calls jax.core.is_constant_dim, which newer JAX keeps only under jax._src
  cat > /tmp/site/sitecustomize.py <<'PY'
import jax.core
import jax._src.core
if not hasattr(jax.core, "is_constant_dim"):
    jax.core.is_constant_dim = jax._src.core.is_constant_dim
PY
  export PYTHONPATH=/tmp/site
fi
python3 -c "import jax, levanter.models.llama, engine.generate.engine; print(jax.__version__, jax.devices())" || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>/dev/null | tee "$OUT/gpu.txt"

PARTS=${1:-engine compile}
[[ $PARTS == *engine* ]] && timeout 400 python3 -m benchmarks.engine_bench --shape "${SHAPE:-llama-3.2-1b}" --one-engine --batch "${BATCH:-1,16,64}" \
  --max-num-batched-tokens 2048 --prompt-len 128 --new-tokens 128 --repeats 3 --bandwidth-bound --replay \
  2>&1 | grep -v "^WARNING\|Warning" | tee "$OUT/engine_bench.txt"

[[ $PARTS == *compile* ]] && timeout 400 python3 -m benchmarks.compile_bench --layers "${LAYERS:-4,32}" --backend "${BACKENDS:-xla,tpu}" --dtype bfloat16 \
  2>&1 | grep -v "^WARNING\|Warning" | tee "$OUT/compile_bench.txt"
