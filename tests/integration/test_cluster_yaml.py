"""cluster.yaml (GCP TPU pod) passes Ray's own cluster-config validation and installs this project."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray._private.accelerators import TPUAcceleratorManager
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).parents[2] / "cluster.yaml"


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_passes_rays_validator_after_filling_defaults(config):
    prepared = prepare_config(config)
    validate_config(prepared)  # raises on any schema violation
    assert prepared["provider"]["type"] == "gcp"
    assert prepared["head_node_type"] == "ray_head_default"


def test_tpu_worker_node_type(config):
    nodes = config["available_node_types"]
    assert set(nodes) == {"ray_head_default", "ray_tpu"}
    tpu = nodes["ray_tpu"]
    assert TPUAcceleratorManager.is_valid_tpu_accelerator_type(tpu["node_config"]["acceleratorType"])
    assert tpu["node_config"]["runtimeVersion"]
    assert tpu["resources"] == {"TPU": 4}
    assert tpu["min_workers"] >= 1
    assert "acceleratorType" not in nodes["ray_head_default"]["node_config"]


def test_every_node_installs_this_project_and_runs_its_ray(config):
    assert config["file_mounts"] == {"~/jax-serve": "."}
    assert any("scripts/setup.sh" in command for command in config["setup_commands"])
    assert any("jax[tpu]" in command for command in config["worker_setup_commands"])
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all(command.lstrip().startswith(("~/jax-serve/.venv/bin/ray", "ulimit")) for command in starts)
    assert any("--head" in command for command in config["head_start_ray_commands"])
