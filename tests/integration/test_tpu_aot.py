"""Every step program of the tpu backend compiled for real TPU topologies on this CPU host, through
libtpu (`jax-serve-aot`, run in .venv-tpu as a user runs it): the Pallas kernel for the topology's
generation, the weights split over the slice (one host and two), and the figures it reports
equal to the planner's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.generate.runner import memory_plan
from engine.tools import capacity

TPU_PYTHON = Path(__file__).parents[2] / ".venv-tpu" / "bin" / "python"

# A bf16 Llama of 2 layers, width 128, 8 heads of 16 over 2 KV heads (repeated 4x over 8 chips).
TINY = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=1)
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)
SAMPLERS = ("greedy", "random", "random+logprobs", "constrain", "random+constrain")


def aot(model_dir: Path, topology: str, tp: int, out: Path, *extra: str) -> dict:
    if not TPU_PYTHON.is_file():
        pytest.fail(f"{TPU_PYTHON} is missing: run scripts/setup.sh (it installs libtpu there)")
    command = [str(TPU_PYTHON), "-m", "engine.tools.aot", "--model", str(model_dir), "--topology", topology,
               "--tensor-parallel-size", str(tp), "--json", str(out), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
               "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
               "--max-model-len", str(ENGINE["max_model_len"]), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2],
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-shapes")
    (path / "config.json").write_text(json.dumps(TINY))
    return path


@pytest.fixture(scope="module")
def v5e_report(tiny_dir, tmp_path_factory):
    """The tiny model on a v5e 2x2 slice at TP 4: the report several tests read."""
    return aot(tiny_dir, "v5e:2x2", 4, tmp_path_factory.mktemp("v5e") / "report.json")


@pytest.mark.parametrize("topology, extra, tp, hosts, kind, memory", [
    ("v5e:2x2", (), 4, 1, "TPU v5 lite", capacity.TPU_CHIPS["v5e"].hbm_bytes),
    ("v5p:2x2x2", (), 8, 2, "TPU v5", capacity.TPU_CHIPS["v5p"].hbm_bytes),
    ("v6e:2x4", ("--chips-per-host", "2x4"), 8, 1, "TPU v6 lite", capacity.TPU_CHIPS["v6e"].hbm_bytes)])
def test_every_step_program_compiles_for_the_topology(tiny_dir, tmp_path, v5e_report, topology, extra, tp, hosts,
                                                      kind, memory):
    report = v5e_report if topology == "v5e:2x2" else aot(tiny_dir, topology, tp, tmp_path / "report.json", *extra)
    assert (report["device_kind"], report["hosts"], report["tensor_parallel_size"]) == (kind, hosts, tp)
    # the compile order (a full batch of decodes first), each new row count with its sampler variants
    names = [p["name"] for p in report["programs"]]
    assert names == (["forward T=8"] + [f"sample R=8 {s}" for s in SAMPLERS] + ["forward T=1"]
                     + [f"sample R=1 {s}" for s in SAMPLERS] + ["forward T=16", "forward T=32"])

    # weights per chip from the arrays' shardings: the planner's figure
    # a page per chip: 2 layers x 16 tokens x (key, value) x one KV head (repeated to one per chip) x
    # 128 lanes (the kernel's, heads of 16 stored padded) x 2 bytes
    page_bytes = 2 * 16 * 2 * 1 * 128 * 2
    plan = memory_plan.plan(EngineConfig(model=str(tiny_dir), **ENGINE), tp, memory, lambda shape: page_bytes * tp)
    assert report["weight_bytes"] == report["planned_weight_bytes"] == plan.weight_bytes
    assert (report["kv_pages"], report["kv_bytes"]) == (plan.pages, plan.kv_bytes)
    # memory_analysis: a forward program's arguments are the weights but the LM head (the sampling
    # program's), the KV pool and the step's inputs (a few KiB)
    lm_head = TINY["vocab_size"] * TINY["hidden_size"] * 2 // tp
    for program in report["programs"]:
        if program["name"].startswith("forward"):
            assert 0 <= program["argument_bytes"] - (plan.weight_bytes - lm_head) - plan.kv_bytes < 64 * 1024
    # an all-reduce after each layer's attention and MLP, one for the embedding split by vocabulary
    assert [p["collectives"] for p in report["programs"] if p["name"].startswith("forward")] == [
        {"all-reduce": 2 * TINY["num_hidden_layers"] + 1}] * 4
    assert report["fits"] is True and report["problem"] is None
    assert abs(report["planner_error"]) < 0.05


GEMMA = {**TINY, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32, "tie_word_embeddings": True,
         "hidden_activation": "gelu_pytorch_tanh"}


@pytest.mark.parametrize("config", [
    {**GEMMA, "model_type": "gemma2", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    {**GEMMA, "model_type": "gemma3_text", "rope_local_base_freq": 10000.0,
     "layer_types": ["sliding_attention", "full_attention"]}], ids=["gemma2", "gemma3"])
def test_gemma_sliding_layers_compile_for_a_tpu(tmp_path, config):
    """The kernel with a sliding window, chosen per layer of the scanned loop (and the layer's RoPE,
    Gemma 3's), with soft-capped scores (Gemma 2)."""
    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps(config))
    report = aot(tmp_path / "gemma", "v5e:2x2", 4, tmp_path / "report.json")
    assert len(report["programs"]) == 14 and report["fits"] is True


QWEN3_MOE = {**TINY, "model_type": "qwen3_moe", "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 128, "norm_topk_prob": True, "hidden_act": "silu"}


@pytest.mark.parametrize("expert_parallel_size", [None, 1], ids=["whole-experts", "split-expert-mlps"])
def test_a_mixture_of_experts_compiles_for_a_tpu_with_its_experts_split(tmp_path, expert_parallel_size):
    """A Qwen3-MoE of 8 experts over 4 chips. Whole experts (the planner's choice: an expert's 128
    split 4 ways would be 32 lanes): 2 per chip, each chip's rows through its own, the layer's sums
    in one all-reduce, the router whole on every chip. Each expert's MLP split: the same
    collectives. Both are a dense model's. The weights per chip are the planner's."""
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps(QWEN3_MOE))
    extra = () if expert_parallel_size is None else ("--expert-parallel-size", str(expert_parallel_size))
    report = aot(tmp_path / "moe", "v5e:2x2", 4, tmp_path / "report.json", *extra)
    assert len(report["programs"]) == 14 and report["fits"] is True
    layers = QWEN3_MOE["num_hidden_layers"]
    forwards = [p["collectives"] for p in report["programs"] if p["name"].startswith("forward")]
    assert forwards == [{"all-reduce": 2 * layers + 1}] * 4
    config = EngineConfig(model=str(tmp_path / "moe"), expert_parallel_size=expert_parallel_size, **ENGINE)
    plan = memory_plan.plan(config, 4, capacity.TPU_CHIPS["v5e"].hbm_bytes)
    assert report["weight_bytes"] == report["planned_weight_bytes"] == plan.weight_bytes


def test_int8_weights_compile_for_a_tpu_at_half_the_bytes(tiny_dir, tmp_path):
    """Every program compiles with int8 weights; per chip they take the planner's figure, half of
    bfloat16's plus a float32 scale per output channel."""
    report = aot(tiny_dir, "v5e:2x2", 4, tmp_path / "report.json", "--quantization", "int8")
    assert len(report["programs"]) == 14 and report["fits"] is True
    memory = capacity.TPU_CHIPS["v5e"].hbm_bytes
    bf16 = memory_plan.plan(EngineConfig(model=str(tiny_dir), **ENGINE), 4, memory)
    int8 = memory_plan.plan(EngineConfig(model=str(tiny_dir), quantization="int8", **ENGINE), 4, memory)
    assert report["weight_bytes"] == report["planned_weight_bytes"] == int8.weight_bytes
    assert 0.5 < int8.weight_bytes / bf16.weight_bytes < 0.56
    assert int8.loading_extra_bytes == 0  # quantized on the host: the chips hold only the int8 weights


def test_speculative_decoding_compiles_a_sampler_for_every_guess_slot(tiny_dir, tmp_path):
    """With 3 guesses per row, 8 rows sample up to 32 slots: each step size samples as many slots
    as it has tokens (R = T), and the programs still fit."""
    report = aot(tiny_dir, "v5e:2x2", 4, tmp_path / "report.json", "--speculative-tokens", "3")
    names = [p["name"] for p in report["programs"]]
    assert names == (["forward T=8"] + [f"sample R=8 {s}" for s in SAMPLERS] + ["forward T=1"]
                     + [f"sample R=1 {s}" for s in SAMPLERS] + ["forward T=16"] + [f"sample R=16 {s}" for s in SAMPLERS]
                     + ["forward T=32"] + [f"sample R=32 {s}" for s in SAMPLERS])
    assert report["fits"] is True


def test_a_draft_models_programs_compile_beside_the_served_models(tiny_dir, tmp_path, v5e_report):
    """With a draft model (one layer of the same shapes), its forward program per bucket and its
    propose program (its decode steps in a loop, the Pallas kernel inside) compile for the slice;
    weights per chip count both models, as the planner does, and each program's peak counts the
    other model's weights and pool."""
    draft_dir = tmp_path / "draft"
    draft_dir.mkdir()
    (draft_dir / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 1}))
    report = aot(tiny_dir, "v5e:2x2", 4, tmp_path / "report.json", "--speculative-tokens", "3",
                 "--draft-model", str(draft_dir))
    names = [p["name"] for p in report["programs"]]
    assert names[: 1 + len(SAMPLERS) + 2] == (["forward T=8"] + [f"sample R=8 {s}" for s in SAMPLERS]
                                              + ["draft forward T=8", "draft propose R=8 x3"])
    assert [n for n in names if n.startswith("draft")] == ["draft forward T=8", "draft propose R=8 x3",
                                                           "draft forward T=1", "draft propose R=1 x3",
                                                           "draft forward T=16", "draft forward T=32"]
    assert report["fits"] is True and report["weight_bytes"] == report["planned_weight_bytes"]
    assert report["weight_bytes"] > v5e_report["weight_bytes"]
    by_name = {p["name"]: p for p in report["programs"]}
    assert by_name["forward T=8"]["resident_bytes"] > 0 and by_name["draft propose R=1 x3"]["resident_bytes"] > 0


def test_a_slice_too_small_for_the_model_is_reported_not_fitting(tiny_dir, tmp_path):
    """Llama-3.1-70B's shapes on one v5e chip: the weights alone exceed its HBM. The planner says so
    (70.55 billion bfloat16 weights), and libtpu's compiler refuses the first program."""
    shapes = Path(__file__).parents[2] / "benchmarks" / "model_shapes" / "llama-3.1-70b"
    report = aot(shapes, "v5e:2x2", 1, tmp_path / "report.json")
    assert report["fits"] is False and report["programs"] == []
    assert report["problem"] == ("the weights take 131.42 GiB per device at tensor_parallel_size=1, more than "
                                 "the 15.75 GiB a device has")


HLO = """HloModule step

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %sum = f32[] add(%x, %y)
}

%layer (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0:T(128)} all-reduce(%h), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %ag-start = (f32[4]{0}, f32[8]{0}) all-gather-start(%g), channel_id=2, dimensions={0}
  %ag-done = f32[8]{0} all-gather-done(%ag-start)
}

%layers_left (p: (s32[], f32[8])) -> pred[] {
  %bound = s32[]{:T(128)} constant(12)
  ROOT %lt = pred[] compare(%i, %bound), direction=LT
}

%wide (p: f32[8]) -> f32[8] {
  %a1 = f32[8] all-reduce(%z), to_apply=%add
  %a2 = f32[8] all-reduce(%a1), to_apply=%add
}

%narrow (p: f32[8]) -> f32[8] {
  %cp = f32[8] collective-permute(%z), source_target_pairs={{0,1}}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %loop = (s32[], f32[8]) while(%t), condition=%layers_left, body=%layer
  %counted = (s32[], f32[8]) while(%t2), condition=%layers_left, body=%layer, backend_config={"known_trip_count":{"n":"3"}}
  %either = f32[8] conditional(%p, %a, %a), branch_computations={%wide, %narrow}
  %out = f32[8] all-reduce(%a), to_apply=%add
}
"""


def test_collectives_are_counted_per_run_of_the_program():
    """A loop's body once per iteration (the bound its condition compares with: 12; or the known
    trip count: 3), the conditional's costliest branch, the entry's own; -done halves not again."""
    from engine.tools.aot_compile import count_collectives

    assert count_collectives(HLO) == {"all-reduce": 12 + 3 + 2 + 1, "all-gather": 12 + 3}


def test_sampling_gathers_logits_not_a_tied_embedding(tmp_path):
    """Llama-3.2-1B ties its embedding as the LM head, split by vocabulary over 8 chips: the sampling
    programs compute each chip's slice of the logits and gather those (8 x 128256 floats), never the
    weight (128256 x 2048 bf16 = 501 MiB, which XLA gathered into a temporary when left to itself).
    Its shapes with one layer of 16: the sampling programs are the same, the forward ones compile
    faster."""
    config = json.loads((Path(__file__).parents[2] / "benchmarks" / "model_shapes" / "llama-3.2-1b"
                         / "config.json").read_text())
    (tmp_path / "shapes").mkdir()
    (tmp_path / "shapes" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    report = aot(tmp_path / "shapes", "v5e:2x4", 8, tmp_path / "report.json", "--chips-per-host", "2x4")
    samplers = [p for p in report["programs"] if p["name"].startswith("sample R=8")]
    assert len(samplers) == 5
    for program in samplers:
        assert program["collectives"] == {"all-gather": 1}
        assert program["temp_bytes"] < 16 * 2**20
