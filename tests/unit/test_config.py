"""serve_app.config: builder args (flat or a models list, strings from the command line) and the
Serve config files in deploy/."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from engine.config import EngineConfig, ModelSource
from serve_app.config import (
    AppConfig,
    CorsConfig,
    ModelConfig,
    RequestLimits,
    default_model_id,
)

DEPLOY = Path(__file__).parents[2] / "deploy"


def test_flat_command_line_args_configure_one_model():
    config = AppConfig.from_args(
        {
            "model": "/ckpt/my-model/",
            "api_key": "k",
            "max_num_seqs": "8",
            "enable_prefix_caching": "false",
            "num_replicas": "2",
            "resources": '{"TPU": 4}',
        }
    )
    (model,) = config.models
    assert config.api_key.get_secret_value() == "k"
    assert (model.model_id, model.num_replicas, model.resources) == ("my-model", 2, {"TPU": 4.0})
    assert model.engine_config("/resolved") == EngineConfig(
        model="/resolved", source=ModelSource("/ckpt/my-model/"), max_num_seqs=8, enable_prefix_caching=False
    )
    assert model.deployment_name == "TextServer-my-model"


def test_remote_sources_name_their_models_and_travel_to_the_engine():
    config = AppConfig.from_args({"models": [
        {"model": "Qwen/Qwen3-0.6B", "revision": "v1"},
        {"model": "s3://bucket/team/llama-3b/"},
        {"model": "gs://bucket/run/checkpoints", "levanter_model": {"type": "llama"}, "tokenizer": "org/tok"},
    ]})
    hub, s3, levanter = config.models
    assert [m.model_id for m in config.models] == ["Qwen/Qwen3-0.6B", "llama-3b", "checkpoints"]
    assert hub.deployment_name == "TextServer-Qwen-Qwen3-0.6B"
    assert [m.source.describe() for m in config.models] == [
        "Qwen/Qwen3-0.6B@v1", "s3://bucket/team/llama-3b/", "levanter:gs://bucket/run/checkpoints"]
    assert hub.engine_config("/hf/snapshot").source == ModelSource("Qwen/Qwen3-0.6B", revision="v1")
    assert "source" not in hub.engine and "model" not in hub.engine
    assert levanter.source.tokenizer == "org/tok" and levanter.source.levanter_model == {"type": "llama"}


def test_a_levanter_checkpoint_needs_its_model_config_and_tokenizer():
    with pytest.raises(ValueError, match="a levanter checkpoint needs both levanter_model .* and tokenizer"):
        AppConfig.from_args({"model": "/ckpts/run", "levanter_model": {"type": "llama"}})
    with pytest.raises(ValueError, match="unknown engine fields \\['source'\\]"):
        AppConfig.from_args({"model": "/ckpt", "engine": {"source": "x"}})


def test_a_models_list_serves_several():
    config = AppConfig.from_args(
        {"models": [{"model": "a"}, {"model": "b", "model_id": "bee", "engine": {"dtype": "bfloat16"}}]}
    )
    assert [m.model_id for m in config.models] == ["a", "bee"]
    assert config.models[1].engine_config("/x").dtype == "bfloat16"


@pytest.mark.parametrize(
    "spec, model_id",
    [("smollm2-135m-instruct", "smollm2-135m-instruct"), ("/a/b/ckpt", "ckpt"), ("models/x.Q4.gguf", "x.Q4")],
)
def test_default_model_ids(spec, model_id):
    assert default_model_id(spec) == model_id


@pytest.mark.parametrize(
    "args, message",
    [
        ({"model": "m", "max_num_seqs": 0}, "max_num_seqs must be at least 1, got 0"),
        ({"model": "m", "kv_cache_dtype": "float16"}, "kv_cache_dtype\n  Input should be 'float32' or 'bfloat16'"),
        ({"model": "m", "engine": {"max_num_sequences": 8}}, "unknown engine fields ['max_num_sequences']"),
        ({"model": "m", "num_replica": 2}, "Extra inputs are not permitted"),
        ({"model": "m", "engine_cls": "engine.generate.engine.LLMEngine"}, "engine_cls must look like 'module:Class'"),
        ({"model": "m", "engine_cls": "engine.llm_engine:LLMEngine"},
         "engine_cls 'engine.llm_engine:LLMEngine' has moved: set engine_cls to 'engine.generate.engine:LLMEngine'"),
        ({"models": [{"model": "a"}, {"model": "/x/a"}]}, "model ids must be unique"),
        ({"models": [{"model": "a", "lora_modules": {"b": "/l"}}, {"model": "b"}]},
         "LoRA adapter names must be unique and differ from the model ids; ['b'] is used twice"),
        ({"models": [{"model": "a", "lora_modules": {"x": "/l"}}, {"model": "b", "lora_modules": {"x": "/m"}}]},
         "['x'] is used twice: rename it in lora_modules"),
        ({"model": "m", "task": "embed", "lora_modules": {"x": "/l"}}, "lora_modules adapt a text generation model"),
    ],
)
def test_bad_args_say_what_to_change(args, message):
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        AppConfig.from_args(args)


def test_defaults_are_small_and_every_field_is_documented():
    model = ModelConfig(model="m")
    assert (model.num_cpus, model.max_ongoing_requests, model.max_queued_requests) == (0.5, 64, 256)
    assert (model.task, model.engine_cls) == ("generate", "engine.generate.engine:LLMEngine")
    fields = {**ModelConfig.model_fields, **AppConfig.model_fields, **RequestLimits.model_fields,
              **CorsConfig.model_fields}
    assert [name for name, field in fields.items() if not field.description] == []


@pytest.mark.parametrize("name,models", [
    ("config.yaml", [("smollm2-135m-instruct", "generate"), ("all-minilm-l6-v2", "embed")]),
    ("tpu.yaml", [("smollm2-135m-instruct", "generate")]),
])
def test_deploy_configs_are_valid_serve_configs_for_the_default_model(name, models):
    schema = ServeDeploySchema.model_validate(yaml.safe_load((DEPLOY / name).read_text()))
    (app,) = schema.applications
    assert app.import_path == "serve_app:build_app"
    config = AppConfig.from_args(app.args)
    assert [(m.model_id, m.task) for m in config.models] == models


def test_limits_and_cors_are_app_keys_flat_or_nested():
    flat = AppConfig.from_args(
        {
            "model": "m",
            "max_n": "8",
            "max_request_body_bytes": "1000",
            "allowed_origins": "https://a.example, https://b.example",
        }
    )
    assert (flat.limits.max_n, flat.limits.max_request_body_bytes, flat.limits.max_stop_strings) == (8, 1000, 64)
    assert flat.cors.allowed_origins == ["https://a.example", "https://b.example"]
    nested = AppConfig.from_args(
        {"models": [{"model": "m"}], "limits": '{"max_logprobs": 5}', "cors": {"allowed_origins": '["*"]'}}
    )
    assert (nested.limits.max_logprobs, nested.cors.allowed_origins) == (5, ["*"])
    assert flat.models[0].engine == nested.models[0].engine  # none of them reached the model


def test_limit_and_cors_defaults():
    assert RequestLimits().model_dump() == {
        "max_request_body_bytes": 32 * 2**20,
        "max_prompts_per_request": 256,
        "max_n": 128,
        "max_choices_per_request": 256,
        "max_stop_strings": 64,
        "max_stop_string_chars": 1024,
        "max_stop_token_ids": 64,
        "max_logit_bias_entries": 300,
        "max_images_per_request": 8,
        "max_logprobs": 20,
    }
    assert CorsConfig().model_dump() == {
        "allowed_origins": [],
        "allowed_methods": ["GET", "POST"],
        "allowed_headers": ["*"],
    }
    with pytest.raises(ValidationError, match="max_logprobs\n  Input should be less than or equal to 20"):
        AppConfig.from_args({"model": "m", "max_logprobs": 21})


def test_lora_modules_turn_on_adapter_slots_unless_set():
    listed = AppConfig.from_args({"model": "m", "lora_modules": '{"a": "/l/a", "b": "/l/b"}'}).models[0]
    assert listed.lora_modules == {"a": "/l/a", "b": "/l/b"} and listed.engine["max_loras"] == 2
    assert AppConfig.from_args({"model": "m", "lora_modules": {"a": "/l"}, "max_loras": 3}).models[0].engine[
        "max_loras"] == 3
    assert AppConfig.from_args({"model": "m"}).models[0].engine["max_loras"] == 0


def test_replica_probe_and_shutdown_settings_reach_serves_deployment():
    """health_check_timeout_s decides how soon Serve replaces a frozen replica (three missed probes);
    Serve's own default would be 30 s a probe."""
    from serve_app.app import server_deployment

    model = ModelConfig.model_validate({"model": "/ckpt/m", "health_check_period_s": "1", "health_check_timeout_s": 2,
                                        "graceful_shutdown_timeout_s": 5})
    deployed = server_deployment(model)._deployment_config
    assert (deployed.health_check_period_s, deployed.health_check_timeout_s,
            deployed.graceful_shutdown_timeout_s) == (1.0, 2.0, 5.0)
    assert ModelConfig(model="/ckpt/m").health_check_timeout_s == 30.0


def test_a_failed_start_is_tried_as_often_as_asked():
    """max_constructor_retry_count reaches Serve's deployment; unset, Serve's default stays (20,
    which Serve caps at 3 per replica); 0 is refused with the field named."""
    from serve_app.app import server_deployment

    once = ModelConfig.model_validate({"model": "/ckpt/m", "max_constructor_retry_count": 1})
    assert server_deployment(once)._deployment_config.max_constructor_retry_count == 1
    assert server_deployment(ModelConfig(model="/ckpt/m"))._deployment_config.max_constructor_retry_count == 20
    with pytest.raises(ValueError, match="max_constructor_retry_count"):
        ModelConfig.model_validate({"model": "/ckpt/m", "max_constructor_retry_count": 0})
