"""The speech-to-text deployment: Whisper behind /v1/audio/transcriptions and /v1/audio/translations.

The path of one request: the ingress sends an `AudioRequest` (the form's fields and the file's
bytes); the file is decoded to 16 kHz mono and turned into log-mel features (serve_app.media.audio, on a
worker thread); the `AsyncTranscriber` decodes its 30-second windows in the engine's slots beside
other requests' windows; the segments' token ids become text here, and the answer is written in the
asked format (json, text, srt, vtt, verbose_json) or streamed as text deltas.

Features: audio up to 30 s is padded to 30 s before its log-mel is taken (what Whisper was trained
on); longer audio is taken whole and cut into windows, the last one padded with zero features
(transformers' long-form layout). A window ends where the audio does: no text is decoded from the
padding past the end of the audio.

Invariants: everything raised to the caller is an `APIError`; a file that is not audio, is empty or
is longer than `max_audio_seconds` is a 400 before anything is queued.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import numpy as np

from engine.config import EngineConfig
from engine.stats import EngineStats
from engine.transcribe.decoding import Segment, TranscriptionOptions, compression_ratio
from engine.transcribe.driver import AsyncTranscriber, Done, Language, Segments
from serve_app.config import ModelConfig
from serve_app.errors import BadRequest
from serve_app.media import audio
from serve_app.media.words import Word, group_words
from serve_app.protocol.audio import (
    AudioRequest,
    Transcription,
    TranscriptionSegment,
    TranscriptionUsage,
    TranscriptionWord,
    TranscriptTextDelta,
    TranscriptTextDone,
    VerboseTranscription,
)
from serve_app.protocol.context import RequestContext
from serve_app.replicas.base import Replica, api_errors
from serve_app.tasks import TRANSCRIBE

MEDIA_TYPES = {"json": "application/json", "verbose_json": "application/json", "text": "text/plain; charset=utf-8",
               "srt": "application/x-subrip; charset=utf-8", "vtt": "text/vtt; charset=utf-8"}


class SpeechServer(Replica):
    """One replica of a Whisper model: audio decoding + batched windows + text."""

    task = TRANSCRIBE
    driver_class = AsyncTranscriber
    driver: AsyncTranscriber

    def _set_up(self, config: ModelConfig, model_dir: Path, engine_config: EngineConfig, engine: Any) -> None:
        self._num_mel_bins: int = engine.num_mel_bins
        self._max_positions: int = engine.max_positions
        self._max_prompt_tokens: int = engine.tokens.max_prompt_tokens()
        self._eot: int = engine.tokens.eot
        self._compile_progress = engine.compile_progress
        self._max_audio_seconds = config.max_audio_seconds
        self._fallback = config.transcription_fallback

    def _engine_stats(self) -> EngineStats:
        compiled, programs = self._compile_progress()
        return EngineStats(max_model_len=self._max_positions, compiled_programs=compiled, step_programs=programs,
                           num_running=self.driver.busy_slots())

    @property
    def max_model_len(self) -> int:
        return self._max_positions

    # ---- called through deployment handles ----

    async def transcribe(self, request: AudioRequest, arrival_time: float) -> tuple[str, str]:
        """(body, media type) of the answer in the request's response_format."""
        with api_errors():
            result = await self._run(request, arrival_time, stream=None)
            return _render(request, result, self._language_name(result.language)), \
                MEDIA_TYPES[request.params.response_format]

    async def stream_chunks(self, request: AudioRequest, context: RequestContext) -> AsyncIterator[list[str]]:
        """Server-sent event payloads: `transcript.text.delta` as each window's text is final, then
        `transcript.text.done`."""
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self._run(request, context.arrival_time, stream=queue))
        try:
            with api_errors():
                while True:
                    getter = asyncio.ensure_future(queue.get())
                    done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                    if getter in done:
                        yield [TranscriptTextDelta(delta=getter.result()).model_dump_json()]
                        continue
                    getter.cancel()
                    result = task.result()  # raises what failed
                    while not queue.empty():
                        yield [TranscriptTextDelta(delta=queue.get_nowait()).model_dump_json()]
                    yield [TranscriptTextDone(text=result.text, usage=result.usage).model_dump_json()]
                    return
        finally:
            task.cancel()

    # ---- internals ----

    async def _run(self, request: AudioRequest, arrival_time: float, stream: asyncio.Queue | None) -> "_Result":
        params = request.params
        options = TranscriptionOptions(task=params.task, language=getattr(params, "language", None),
                                       timestamps=params.response_format in ("verbose_json", "srt", "vtt"),
                                       prompt=tuple(self._prompt_ids(params.prompt)), temperature=params.temperature,
                                       seed=params.seed, fallback=self._fallback,
                                       word_timestamps="word" in _granularities(params))
        self.driver.validate(options)  # a 400 before the audio is decoded
        samples, mel, frames = await asyncio.to_thread(self._features, request.audio)
        tracker = self.metrics.track(f"audio-{uuid.uuid4().hex}", arrival_time)
        result = _Result(duration=len(samples) / audio.SAMPLE_RATE)
        reason, generated = "abort", 0
        try:
            async for event in self.driver.transcribe(mel, frames, options):
                if isinstance(event, Language):
                    result.language = event.code
                elif isinstance(event, Segments):
                    result.segments += event.segments
                    tracker.on_tokens(sum(len(s.tokens) for s in event.segments))
                    if stream is not None:
                        delta = result.take_delta(self._decode)
                        if delta:
                            stream.put_nowait(delta)
                elif isinstance(event, Done):
                    generated, reason = event.tokens, "stop"
        finally:
            tracker.finish(reason, 0, generated, 0)
        result.text = self._decode([t for s in result.segments for t in s.text_tokens]).strip()
        texts = [self._decode(list(s.text_tokens)) for s in result.segments]
        kept = [i for i, text in enumerate(texts) if text.strip()]  # no segment without words
        result.segments, result.segment_texts = [result.segments[i] for i in kept], [texts[i] for i in kept]
        if options.word_timestamps:
            result.words = [word for segment in result.segments for word in self._words(segment, result.language)]
        return result

    def _words(self, segment: Segment, language: str | None) -> list[Word]:
        text = [(token, times) for token, times in zip(segment.tokens, segment.token_times) if token < self._eot]
        return group_words(self._decode, [t for t, _ in text], [times for _, times in text], language)

    def _features(self, data: bytes) -> tuple[np.ndarray, np.ndarray, int]:
        """(samples, log-mel [num_mel_bins, frames], the audio's frames) of an audio file."""
        samples = audio.decode_audio(data, self._max_audio_seconds)
        frames = len(samples) // audio.HOP_LENGTH
        if frames < 1:
            raise BadRequest(f"the audio lasts {len(samples) / audio.SAMPLE_RATE * 1000:.1f} ms; send at least 10 ms",
                             "file")
        if len(samples) <= audio.N_SAMPLES:
            return samples, audio.log_mel(samples, self._num_mel_bins, padding=audio.N_SAMPLES - len(samples)), frames
        mel = audio.log_mel(samples, self._num_mel_bins)
        return samples, mel, mel.shape[1]

    def _prompt_ids(self, prompt: str | None) -> list[int]:
        if not prompt or not prompt.strip():
            return []
        ids = self.prompts.hf.encode(" " + prompt.strip(), add_special_tokens=False)
        return ids[-self._max_prompt_tokens:]

    def _decode(self, ids: list[int]) -> str:
        return self.prompts.hf.decode([t for t in ids if t < self._eot])

    def _language_name(self, code: str | None) -> str:
        # transformers is heavy: loaded on a replica with its tokenizer, never by the app builder
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        return LANGUAGES.get(code or "", code or "")


class _Result:
    """What a transcription came to: segments, language, text and duration."""

    def __init__(self, duration: float):
        self.duration = duration
        self.language: str | None = None
        self.segments: list[Segment] = []
        self.text = ""
        self.segment_texts: list[str] = []
        self.words: list[Word] = []
        self._sent = ""

    @property
    def usage(self) -> TranscriptionUsage:
        return TranscriptionUsage(seconds=math.ceil(self.duration))

    def take_delta(self, decode) -> str:
        """The text decoded since the last delta. Deltas add up to the final text exactly: leading
        whitespace is dropped, trailing whitespace and a partial character wait for what follows."""
        text = decode([t for s in self.segments for t in s.text_tokens]).lstrip().rstrip().rstrip("\ufffd")
        if not text.startswith(self._sent):
            return ""
        delta, self._sent = text[len(self._sent):], text
        return delta


def _render(request: AudioRequest, result: _Result, language_name: str) -> str:
    params = request.params
    fmt = params.response_format
    if fmt == "json":
        return Transcription(text=result.text, usage=result.usage).model_dump_json()
    if fmt == "text":
        return result.text + "\n"
    segments = [_segment(i, s, text, result.duration)
                for i, (s, text) in enumerate(zip(result.segments, result.segment_texts))]
    if fmt == "verbose_json":
        granularities = _granularities(params)
        words = [TranscriptionWord(word=w.text.strip(), start=_clamp(w.start, result.duration),
                                   end=_clamp(w.end, result.duration)) for w in result.words]
        return VerboseTranscription(
            task=params.task, language=language_name, duration=round(result.duration, 2), text=result.text,
            segments=segments if "segment" in granularities else None, words=words if "word" in granularities else None,
            usage=result.usage).model_dump_json(exclude_none=True)
    if fmt == "srt":
        return "".join(f"{i + 1}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n\n"
                       for i, s in enumerate(segments))
    return "WEBVTT\n\n" + "".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n\n"
                                  for s in segments)


def _granularities(params) -> list[str]:
    """What verbose_json times: a translation's segments, a transcription's asked granularities."""
    return getattr(params, "timestamp_granularities", ["segment"])


def _clamp(seconds: float, duration: float) -> float:
    """Seconds rounded to 10 ms, no later than the audio's end."""
    return round(min(seconds, duration), 2)


def _segment(index: int, segment: Segment, text: str, duration: float) -> TranscriptionSegment:
    return TranscriptionSegment(id=index, seek=segment.seek, start=_clamp(segment.start, duration),
                                end=_clamp(segment.end, duration), text=text, tokens=list(segment.tokens),
                                temperature=segment.temperature, avg_logprob=segment.avg_logprob,
                                compression_ratio=compression_ratio(text), no_speech_prob=segment.no_speech_prob)


def _clock(seconds: float, separator: str) -> str:
    """HH:MM:SS,mmm (srt) or HH:MM:SS.mmm (vtt)."""
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"
