"""Placing a replica's workers on one TPU slice, on a simulated Ray cluster as Ray's own TPU tests
build it: two v4-16 slices (2x2x2: 2 hosts of 4 chips), each host a Ray node with the TPU
resources and slice labels, the slice's worker 0 with the `TPU-v4-16-head` resource. The workers
themselves run on CPU (2 host devices each)."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from engine.config import EngineConfig
from engine.generate.engine import LLMEngine
from engine.generate.request import SamplingParams
from tests.support.parity import make_prompts, run_to_completion, tokens_of

POD, TOPOLOGY = "v4-16", "2x2x2"
WORKER_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1",
              "USE_TORCH": "0"}  # as deploy/config.yaml: the workers run no torch model


@pytest.fixture(scope="module")
def tpu_cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for slice_name in ("slice-a", "slice-b"):
        for worker_id in range(2):
            resources = {"TPU": 4, "accelerator_type:TPU-V4": 1}
            if worker_id == 0:
                resources[f"TPU-{POD}-head"] = 1
            cluster.add_node(num_cpus=1, resources=resources,
                             labels={"ray.io/tpu-slice-name": slice_name, "ray.io/tpu-worker-id": str(worker_id),
                                     "ray.io/tpu-pod-type": POD},
                             env_vars={"TPU_NAME": slice_name, "TPU_WORKER_ID": str(worker_id),
                                       "TPU_ACCELERATOR_TYPE": POD, "TPU_TOPOLOGY": TOPOLOGY})
    ray.init(address=cluster.address, runtime_env={"env_vars": WORKER_ENV})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_the_workers_take_one_host_each_of_one_slice(tpu_cluster, llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_hosts=2, tensor_parallel_size=4, tpu_version="v4",
                                    tpu_topology=TOPOLOGY, max_model_len=64, warmup=False, compilation_cache_dir=None))
    try:
        labels = engine.executor.worker_labels
        assert len({label["ray.io/tpu-slice-name"] for label in labels}) == 1
        assert sorted(label["ray.io/tpu-worker-id"] for label in labels) == ["0", "1"]
        prompt = make_prompts([6], seed=1)[0]
        tokens = tokens_of(run_to_completion(engine, {"a": (prompt, SamplingParams(max_tokens=4, ignore_eos=True))})["a"])
        assert len(tokens) == 4
    finally:
        engine.shutdown()


def test_a_slice_of_another_size_is_refused_with_the_host_count(tpu_cluster, llama_dir):
    with pytest.raises(ValueError, match="a v4 2x2x2 slice has 2 hosts; set num_hosts: 2"):
        LLMEngine(EngineConfig(model=str(llama_dir), num_hosts=3, tensor_parallel_size=2, tpu_version="v4",
                               tpu_topology=TOPOLOGY, max_model_len=64, warmup=False, compilation_cache_dir=None))
