"""The routes beside the APIs: /v1/models, /tokenize and /detokenize, LoRA adapters loaded at run time."""

from __future__ import annotations

import time
from typing import Literal, Optional, Union

from pydantic import (
    BaseModel,
    Field,
    model_validator,
)

from engine.tasks import GENERATE, TASK_NAMES
from serve_app.protocol.base import OpenAIModel, invalid
from serve_app.protocol.chat import ChatMessage, Tool


class TokenizeRequest(OpenAIModel):
    """POST /tokenize (vLLM's shape): a `prompt` as /v1/completions tokenizes it, or `messages`
    (and `tools`) as /v1/chat/completions renders them."""

    model: str
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    tools: list[Tool] = []
    add_generation_prompt: bool = True
    """With messages: end with the assistant's turn (as chat completions do)."""
    add_special_tokens: Optional[bool] = None
    """Add the tokenizer's special tokens (BOS): default true for a prompt, false for messages
    (the template writes them)."""
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise invalid("prompt", "send either 'prompt' or 'messages'")
        return self


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize (vLLM's shape)."""

    model: str
    tokens: list[int]


class LoadLoraAdapterRequest(OpenAIModel):
    """POST /v1/load_lora_adapter (vLLM's shape)."""

    lora_name: str = Field(min_length=1)
    """The name clients then send as `model`."""
    lora_path: str = Field(min_length=1)
    """A PEFT adapter directory on the replicas' hosts."""
    load_inplace: bool = False
    """Replace an adapter already loaded under this name (requests running with it keep it)."""
    base_model_name: Optional[str] = None
    """This server's extension: the served model the adapter adapts (needed only when it serves
    several text generation models)."""


class UnloadLoraAdapterRequest(OpenAIModel):
    """POST /v1/unload_lora_adapter (vLLM's shape)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None
    """vLLM's field; accepted and not used (adapters are known by name)."""


# ---- responses ----

class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(BaseModel):
    prompt: str

Task = Literal[TASK_NAMES]
"""What a model serves: text (/v1/completions, /v1/chat/completions), embeddings (/v1/embeddings)
or speech to text (/v1/audio/transcriptions, /v1/audio/translations)."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jax-serve"
    root: Optional[str] = None
    """vLLM's field: where the model came from, e.g. a Hub repo id at its revision
    ("Qwen/Qwen3-0.6B@main"), an s3:// or gs:// URI, a local path, a builtin alias."""
    task: Task = GENERATE
    """This server's extension: which routes serve the model."""
    state: Literal["ready", "starting", "failed"] = "ready"
    """This server's extension: whether the model takes requests now (starting: its replicas are
    loading or compiling, or retrying a failed start; failed: Serve gave up starting them)."""
    error: Optional[str] = None
    """This server's extension: why the model failed to start (or the last failed start while retrying)."""
    parent: Optional[str] = None
    """vLLM's field: for a LoRA adapter, the model it adapts (its `root` is the adapter's path)."""
    max_model_len: Optional[int] = None
    """vLLM's field: the most tokens (prompt and output) one sequence may have; null while no replica
    of the model is up."""
    sampling_defaults: Optional[dict[str, Union[int, float]]] = None
    """This server's extension, for a text generation model: the sampling values its requests get
    when they leave them unset (the checkpoint's generation_config.json, or the model config's
    `sampling_defaults`); {}: OpenAI's."""
    dimensions: Optional[int] = None
    """This server's extension, for an embedding model: the size of its vectors."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
