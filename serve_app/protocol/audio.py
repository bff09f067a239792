"""/v1/audio/transcriptions and /v1/audio/translations: the form fields and the responses."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    Field,
    field_validator,
    model_validator,
)

from serve_app.protocol.base import OpenAIModel, invalid


class TranslationRequest(OpenAIModel):
    """POST /v1/audio/translations: a multipart form; the audio is its `file` part. The speech is
    translated into English."""

    model: str
    prompt: Optional[str] = None
    """Text in the audio's style or the words before it: fed before every 30-second window (its
    last tokens, up to half the decoder's context)."""
    response_format: Literal["json", "text", "srt", "verbose_json", "vtt"] = "json"
    temperature: float = Field(0.0, ge=0.0, le=1.0)
    """0: greedy decoding; above 0: sampling. A window whose text repeats or is unlikely is decoded
    again hotter, up to 1.0, and silence is dropped (the model's `transcription_fallback`)."""
    seed: Optional[int] = None
    """This server's extension: makes sampling at temperature > 0 repeatable."""

    @property
    def task(self) -> str:
        return "translate"


class TranscriptionRequest(TranslationRequest):
    """POST /v1/audio/transcriptions: a multipart form; the audio is its `file` part."""

    language: Optional[str] = None
    """The audio's language as an ISO-639-1 code ("en"); default: detected from its first 30 s."""
    timestamp_granularities: list[Literal["segment", "word"]] = ["segment"]
    """With verbose_json: "segment" (the answer's `segments`), "word" (its `words`, timed from the
    model's alignment heads), or both."""
    stream: bool = False
    """Server-sent events: `transcript.text.delta` as each window's text is final, then
    `transcript.text.done` (response_format json or text)."""

    @field_validator("language", mode="before")
    @classmethod
    def _language(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) and value.strip() else None

    @model_validator(mode="after")
    def _supported(self) -> "TranscriptionRequest":
        if "word" in self.timestamp_granularities and self.response_format != "verbose_json":
            raise invalid("timestamp_granularities", f"word timestamps come in verbose_json; set response_format "
                          f"verbose_json, not {self.response_format}")
        if self.stream and self.response_format not in ("json", "text"):
            raise invalid("stream", f"streaming sends text deltas; it takes response_format json or text, "
                          f"not {self.response_format}")
        return self

    @property
    def task(self) -> str:
        return "transcribe"


@dataclasses.dataclass(frozen=True)
class AudioRequest:
    """A transcription or translation with its audio file's bytes: what the ingress hands a speech
    replica (the form's fields validated, the file not yet decoded)."""

    params: Union[TranscriptionRequest, TranslationRequest]
    audio: bytes

    @property
    def model(self) -> str:
        return self.params.model

    @property
    def stream(self) -> bool:
        return getattr(self.params, "stream", False)


class TranscriptionUsage(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: int
    """The audio's duration, rounded up to whole seconds."""


class TranscriptionSegment(BaseModel):
    id: int
    seek: int
    """The first 10 ms frame of the 30-second window the segment was decoded in."""
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class TranscriptionWord(BaseModel):
    word: str
    start: float
    end: float


class Transcription(BaseModel):
    """response_format json."""

    text: str
    usage: TranscriptionUsage


class VerboseTranscription(BaseModel):
    """response_format verbose_json."""

    task: Literal["transcribe", "translate"]
    language: str
    """The language's English name ("english"), as OpenAI reports it."""
    duration: float
    text: str
    segments: Optional[list[TranscriptionSegment]] = None
    """With the "segment" granularity (the default)."""
    words: Optional[list[TranscriptionWord]] = None
    """With the "word" granularity."""
    usage: TranscriptionUsage


class TranscriptTextDelta(BaseModel):
    type: Literal["transcript.text.delta"] = "transcript.text.delta"
    delta: str


class TranscriptTextDone(BaseModel):
    type: Literal["transcript.text.done"] = "transcript.text.done"
    text: str
    usage: TranscriptionUsage
