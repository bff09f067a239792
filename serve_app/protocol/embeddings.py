"""/v1/embeddings: the request and the response."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    Field,
    field_validator,
)

from serve_app.protocol.base import (
    OpenAIModel,
    Prompt,
    PromptInput,
    check_prompts,
    prompt_batch,
)


class EmbeddingRequest(OpenAIModel):
    """POST /v1/embeddings."""

    input: PromptInput
    """Text, a batch of texts, token ids, or a batch of token-id lists (token ids are used as
    given: the model's special tokens are not added)."""
    model: str
    dimensions: Optional[int] = Field(None, ge=1)
    """Only for models trained to be truncated (Matryoshka); otherwise their own size or nothing."""
    encoding_format: Literal["float", "base64"] = "float"
    """base64: each vector as little-endian float32 bytes, base64-encoded (as OpenAI sends it)."""
    user: Optional[str] = None
    """Accepted and not used."""

    @field_validator("input", mode="plain", json_schema_input_type=PromptInput)
    @classmethod
    def _input(cls, value: Any) -> Any:
        return check_prompts(value, "input")

    @property
    def inputs(self) -> list[Prompt]:
        return prompt_batch(self.input)

class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: Union[list[float], str]
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
