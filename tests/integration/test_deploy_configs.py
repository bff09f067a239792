"""The Serve configs in deploy/ pass Ray Serve's own schema and build this app's configuration
(every engine field checked), so `serve deploy` does not fail on a typo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app.config import AppConfig

DEPLOY = Path(__file__).parents[2] / "deploy"


@pytest.mark.parametrize("name", ["config.yaml", "tpu.yaml", "tpu-slice.yaml"])
def test_passes_serves_schema_and_builds_the_app_config(name):
    raw = yaml.safe_load((DEPLOY / name).read_text())
    ServeDeploySchema.model_validate(raw)  # raises on any schema violation
    (app,) = raw["applications"]
    assert app["import_path"] == "serve_app:build_app"
    assert app["runtime_env"]["env_vars"]["USE_TORCH"] == "0"
    AppConfig.from_args(app["args"])


def test_with_use_torch_off_no_serving_process_loads_torch():
    """What the configs' runtime_env buys: the modules every replica, the ingress and the app
    builder import (transformers and levanter's included) leave torch unloaded, so none of them
    spends its start-up importing it; torch is only the tests' reference."""
    modules = ("serve_app.app", "serve_app.replicas.generate", "serve_app.replicas.embed", "serve_app.replicas.transcribe",
               "engine.generate.engine", "engine.models.loading", "levanter.models.llama", "levanter.compat.hf_checkpoints")
    code = f"import sys; import {', '.join(modules)}; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "USE_TORCH": "0"}, capture_output=True,
                         text=True, cwd=DEPLOY.parent, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_the_slice_example_splits_one_replica_over_every_chip_of_a_v4_16():
    args = yaml.safe_load((DEPLOY / "tpu-slice.yaml").read_text())["applications"][0]["args"]
    engine = AppConfig.from_args(args).models[0].engine
    assert (engine["num_hosts"], engine["tensor_parallel_size"]) == (2, 8)
    assert (engine["tpu_version"], engine["tpu_topology"]) == ("v4", "2x2x2")
    cluster = yaml.safe_load((Path(__file__).parents[2] / "cluster.yaml").read_text())
    assert cluster["available_node_types"]["ray_tpu"]["node_config"]["acceleratorType"] == "v4-16"
