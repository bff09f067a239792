"""Runs a speech engine on a background thread: requests' windows decode together in its slots.

`AsyncTranscriber.transcribe(mel, frames, options)` is an async iterator of events for one audio:
`Language` (once, when the language is known), `Segments` (each finished window's segments: a
window's tokens are final only when it ends, since a window that stops mid-speech gives its tail
to the next one) and `Done`.

The worker loop (one thread; the only caller of the engine):
  1. new requests take free slots (first come, first served); a request keeps its slot until its
     last window ends;
  2. every slot starting a window runs the encoder (one batched call) and feeds its prefix;
  3. one `decode` call feeds every busy slot (a prefix or its last token); each slot's logits go
     through Whisper's rules (engine.transcribe.decoding) and a token is chosen;
  4. a window that ends is judged (`rules.verdict`): kept, it is split into segments and the
     request's next window starts where it ended; failed, it is decoded again in its slot at the
     next temperature (its encoder output is still there); silent, it is dropped.
Audio longer than one window is always decoded with timestamps: they say where a window's speech
ends and the next begins (as transformers and OpenAI's whisper do).

Failure is final and reaches every caller (engine.worker: an engine call raising, a call past
`watchdog_s`, `shutdown()`). A caller that stops iterating frees its slot at the next step.
Pure Python + numpy: importing this module does not import jax.
"""

from __future__ import annotations

import dataclasses
import queue
from typing import AsyncIterator, Optional, Protocol, Union

import numpy as np

from engine.errors import InvalidRequestError
from engine.transcribe import alignment
from engine.transcribe import decoding as rules
from engine.transcribe.decoding import (
    FRAMES_PER_WINDOW,
    Feed,
    Segment,
    TranscriptionOptions,
    WhisperTokens,
)
from engine.worker import Inbox, Worker


class SpeechEngineProtocol(Protocol):
    tokens: WhisperTokens
    num_slots: int
    num_mel_bins: int
    median_filter_width: int

    def encode(self, windows: list[tuple[int, np.ndarray]]) -> None: ...

    def decode(self, feeds: dict[int, Feed]) -> dict[int, tuple[np.ndarray, float]]: ...

    def align(self, slot: int, tokens: list[int]) -> np.ndarray: ...

    def compile_progress(self) -> tuple[int, int]: ...

    def describe(self) -> dict[str, str]: ...


@dataclasses.dataclass(frozen=True)
class Language:
    code: str
    detected: bool


@dataclasses.dataclass(frozen=True)
class Segments:
    segments: tuple[Segment, ...]


@dataclasses.dataclass(frozen=True)
class Done:
    windows: int
    """Windows decoded."""
    tokens: int
    """Tokens sampled, <|endoftext|> included."""


Event = Union[Language, Segments, Done]


@dataclasses.dataclass(eq=False)
class _Window:
    """One window being decoded in a slot (worker thread only)."""

    seek: int
    frames: int
    """Real frames of audio in it (FRAMES_PER_WINDOW but at the audio's end)."""
    prefix: list[int]
    pending: list[int]
    """Tokens to feed at the next step."""
    probe: int
    """Index in `pending` of <|startoftranscript|> (its logits give P(nospeech)); -1: none."""
    attempt: int = 0
    """Index in the request's temperatures of the one this decode samples at."""
    position: int = 0
    sampled: list[int] = dataclasses.field(default_factory=list)
    logprob_sum: float = 0.0
    no_speech_prob: float = float("nan")


@dataclasses.dataclass(eq=False)
class _Job:
    """One audio: its features, what it asks, and where the caller waits."""

    mel: np.ndarray
    frames: int
    options: TranscriptionOptions
    inbox: Inbox[Event]
    """Where the caller reads its events."""
    cancelled: bool = False
    slot: Optional[int] = None
    seek: int = 0
    language: Optional[str] = None
    window: Optional[_Window] = None
    windows: int = 0
    sampled: int = 0
    rng: Optional[np.random.Generator] = None
    rules: Optional[rules.WindowRules] = None
    """The logits rules of its windows (fixed by its options)."""
    temperatures: tuple[float, ...] = (0.0,)


class AsyncTranscriber(Worker):
    """Owns the worker thread over `engine`. `transcribe()` is the whole request-facing API."""

    def __init__(self, engine: SpeechEngineProtocol, *, watchdog_s: float = 600.0):
        super().__init__("speech worker", thread="speech-loop", call="a speech engine call", calls="calls",
                         stopped="the speech worker was shut down", watchdog_s=watchdog_s)
        self.engine = engine
        self.tokens = engine.tokens
        self._waiting: list[_Job] = []
        self._slots: list[Optional[_Job]] = [None] * engine.num_slots
        self._description = engine.describe()
        self.num_steps = 0
        """Decode calls made so far."""
        self._start()

    # ---- request-facing API ----

    def validate(self, options: TranscriptionOptions) -> None:
        problem = rules.check_options(self.tokens, options)
        if problem is not None:
            raise InvalidRequestError(*problem)

    async def transcribe(self, mel: np.ndarray, frames: int, options: TranscriptionOptions) -> AsyncIterator[Event]:
        """Events of one audio's transcription. `mel`: float32 [num_mel_bins, >= frames] log-mel
        features; `frames`: the audio's real frames (its length in 10 ms). Raises
        InvalidRequestError before anything is queued, EngineDeadError if the worker died."""
        self._raise_if_dead()
        self.validate(options)
        if mel.ndim != 2 or mel.shape[0] != self.engine.num_mel_bins or frames < 1:
            raise InvalidRequestError(f"features must be [{self.engine.num_mel_bins}, frames] with at least one "
                                      f"frame; got {list(mel.shape)}", "file")
        if frames > FRAMES_PER_WINDOW and not options.timestamps:
            options = dataclasses.replace(options, timestamps=True)
        known = options.language or (None if self.tokens.multilingual else "en")
        job = _Job(mel, frames, options, Inbox(), language=known,
                   rng=np.random.default_rng(options.seed), rules=rules.WindowRules(self.tokens, options.timestamps),
                   temperatures=options.temperatures())
        self._submit(job, job.inbox, job)
        try:
            while True:
                event = await job.inbox.get()
                yield event
                if isinstance(event, Done):
                    return
        finally:
            job.cancelled = True
            self._settled(job, job.inbox)

    def describe(self) -> dict[str, str]:
        return self._description

    def busy_slots(self) -> int:
        return sum(job is not None for job in self._slots)

    # ---- worker thread ----

    def _work(self) -> None:
        self._admit()
        if any(self._slots):
            self._step()

    def _admit(self) -> None:
        """Take arrivals (blocking while there is nothing to do), free the slots of cancelled
        jobs and give free slots to waiting jobs."""
        block = not any(self._slots) and not self._waiting
        while True:
            try:
                job = self._queue.get(block=block)
            except queue.Empty:
                break
            if job is None:
                return
            self._waiting.append(job)
            block = False
        for slot, job in enumerate(self._slots):
            if job is not None and job.cancelled:
                self._slots[slot] = None
        self._waiting = [job for job in self._waiting if not job.cancelled]
        for slot in range(len(self._slots)):
            if self._slots[slot] is None and self._waiting:
                job = self._waiting.pop(0)
                job.slot, self._slots[slot] = slot, job

    def _step(self) -> None:
        starting = [job for job in self._slots if job is not None and job.window is None]
        if starting:
            for job in starting:
                job.window = self._new_window(job)
            self._call(self.engine.encode, [(job.slot, rules.window(job.mel, job.seek)) for job in starting])
        busy = [job for job in self._slots if job is not None]
        feeds = {job.slot: Feed(job.window.position, job.window.pending, job.window.probe) for job in busy}
        results = self._call(self.engine.decode, feeds)
        self.num_steps += 1
        for job in busy:
            logits, nospeech_logprob = results[job.slot]
            self._advance(job, logits, nospeech_logprob)

    def _new_window(self, job: _Job) -> _Window:
        if job.windows == 0 and job.language is not None:
            job.inbox.put(Language(job.language, detected=False))
        prefix = rules.prefix(self.tokens, job.options, job.language)
        probe = prefix.index(self.tokens.sot)
        frames = min(FRAMES_PER_WINDOW, job.frames - job.seek)
        return _Window(job.seek, frames, prefix, list(prefix), probe)

    def _advance(self, job: _Job, logits: np.ndarray, nospeech_logprob: float) -> None:
        window = job.window
        window.position += len(window.pending)
        if window.probe >= 0:
            window.no_speech_prob = float(np.exp(nospeech_logprob))
            window.probe = -1
        if job.language is None:  # the prefix stopped at <|startoftranscript|>: pick the language
            job.language = rules.detect_language(self.tokens, logits)
            job.inbox.put(Language(job.language, detected=True))
            rest = rules.prefix(self.tokens, job.options, job.language)[len(window.prefix):]
            window.prefix += rest
            window.pending = rest
            return
        scores = job.rules.scores(logits, window.sampled)
        token = rules.choose(scores, job.temperatures[window.attempt], job.rng)
        window.logprob_sum += float(rules.log_softmax(scores)[token])
        window.sampled.append(token)
        job.sampled += 1
        limit = rules.length_limit(self.tokens, len(window.prefix))
        if token == self.tokens.eot or len(window.prefix) + len(window.sampled) >= limit:
            self._finish_window(job)
        else:
            window.pending = [token]

    def _finish_window(self, job: _Job) -> None:
        window = job.window
        avg_logprob = window.logprob_sum / len(window.sampled)
        verdict = rules.verdict(self.tokens, job.options.fallback, window.sampled, avg_logprob, window.no_speech_prob)
        if verdict == "retry" and window.attempt + 1 < len(job.temperatures):
            job.window = _Window(window.seek, window.frames, window.prefix, list(window.prefix), probe=-1,
                                 attempt=window.attempt + 1, no_speech_prob=window.no_speech_prob)
            return
        job.windows += 1
        job.window = None
        job.seek += window.frames if verdict == "skip" else self._keep(job, window, avg_logprob)
        if job.seek >= job.frames:
            job.inbox.put(Done(job.windows, job.sampled))
            self._slots[job.slot] = None
            self._settled(job, job.inbox)

    def _token_times(self, job: _Job, window: _Window) -> list[tuple[float, float]]:
        """(start, end) in seconds from the audio's start of each token the window sampled."""
        fed = window.prefix + window.sampled[:-1]
        weights = self._call(self.engine.align, job.slot, fed)
        ends = alignment.token_times(weights, len(window.prefix), len(window.sampled), window.frames,
                                     self.engine.median_filter_width)
        offset = window.seek * rules.SECONDS_PER_FRAME
        return [(offset + float(start), offset + float(end)) for start, end in zip([0.0, *ends[:-1]], ends)]

    def _keep(self, job: _Job, window: _Window, avg_logprob: float) -> int:
        """Send a finished window's segments; the mel frames it consumed (at least one)."""
        sampled = window.sampled[:-1] if window.sampled[-1] == self.tokens.eot else window.sampled
        pieces, consumed = rules.split_window(self.tokens, sampled, window.seek, window.frames)
        times = self._token_times(job, window) if job.options.word_timestamps else None
        segments, first = [], 0
        for start, end, tokens in pieces:  # consecutive slices of `sampled`
            segments.append(Segment(
                window.seek, start, end, tuple(tokens), tuple(t for t in tokens if t < self.tokens.eot),
                job.temperatures[window.attempt], avg_logprob, window.no_speech_prob,
                tuple(times[first: first + len(tokens)]) if times is not None else ()))
            first += len(tokens)
        job.inbox.put(Segments(tuple(segments)))
        return consumed if consumed > 0 else window.frames  # a window always moves on
