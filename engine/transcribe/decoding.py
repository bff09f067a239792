"""Whisper's decoding rules, host side: what one 30-second window feeds, which tokens it may
sample, and how its tokens become timed segments and the next window's start. Pure numpy.

The rules are transformers' `WhisperForConditionalGeneration.generate` (OpenAI's `whisper.transcribe`),
so greedy output is its output token for token:
  * prefix: [<|startofprev|>, prompt...] + [<|startoftranscript|>, language, task] + [<|notimestamps|>
    unless timestamps are asked]. Without a language, a multilingual model's first window picks the
    likeliest language token after <|startoftranscript|> (once per audio).
  * every step: `suppress_tokens` never; `begin_suppress_tokens` not as the first token; with
    timestamps, `WhisperTimeStampLogitsProcessor`'s rules (pairs of timestamps, never decreasing,
    the first one at most `max_initial_timestamp_index`, a timestamp whenever their total
    probability beats every text token's).
  * a window stops at <|endoftext|> or when prefix + tokens reach
    min(max_length + min(max_target_positions // 2 - 1, len(prefix) - 1), max_target_positions).
  * windows: audio longer than 30 s is read window after window; a window ends at its last
    complete segment (two timestamps in a row) and the next starts there (`split_window`); one
    without such a pair takes its whole 30 s. (Without timestamps a model rarely emits them.)
  * fallback (`Fallback`, `verdict`): a finished window whose tokens repeat too much or are too
    unlikely is decoded again at a higher temperature; one that is likely silence is dropped.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import NamedTuple, Optional

import numpy as np

FRAMES_PER_WINDOW = 3000
"""Log-mel frames of one 30-second window (10 ms each)."""
TIME_PRECISION = 0.02
"""Seconds per timestamp token step."""
FRAMES_PER_TIMESTAMP = 2
"""Mel frames per timestamp step (the encoder halves the frame rate)."""
SECONDS_PER_FRAME = 0.01


@dataclasses.dataclass(frozen=True)
class WhisperTokens:
    """The special token ids and rules of a checkpoint, from its generation_config.json."""

    eot: int
    sot: int
    prev: Optional[int]
    no_timestamps: int
    languages: dict[str, int]
    """Language code ("en") -> its token id."""
    tasks: dict[str, int]
    """"transcribe" / "translate" -> token id ({} for an English-only model without task tokens)."""
    suppress: tuple[int, ...]
    begin_suppress: tuple[int, ...]
    max_initial_timestamp_index: Optional[int]
    max_length: int
    max_target_positions: int
    multilingual: bool
    vocab_size: int
    alignment_heads: tuple[tuple[int, int], ...] = ()
    """(decoder layer, head) pairs whose cross-attention follows the audio: word timings read them
    (none: the checkpoint cannot time words)."""

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @property
    def nospeech(self) -> int:
        """<|nospeech|> (<|nocaptions|>): the token just before <|notimestamps|>."""
        return self.no_timestamps - 1

    @classmethod
    def from_generation_config(cls, generation: dict, max_target_positions: int, vocab_size: int) -> "WhisperTokens":
        missing = [key for key in ("decoder_start_token_id", "eos_token_id", "no_timestamps_token_id")
                   if generation.get(key) is None]
        if missing:
            raise ValueError(f"generation_config.json lacks {', '.join(missing)}: not a Whisper generation config")
        eos = generation["eos_token_id"]
        languages = {code.strip("<|>"): int(i) for code, i in (generation.get("lang_to_id") or {}).items()}
        return cls(
            eot=int(eos[0] if isinstance(eos, list) else eos), sot=int(generation["decoder_start_token_id"]),
            prev=generation.get("prev_sot_token_id"), no_timestamps=int(generation["no_timestamps_token_id"]),
            languages=languages, tasks={k: int(v) for k, v in (generation.get("task_to_id") or {}).items()},
            suppress=tuple(generation.get("suppress_tokens") or ()),
            begin_suppress=tuple(generation.get("begin_suppress_tokens") or ()),
            max_initial_timestamp_index=generation.get("max_initial_timestamp_index"),
            max_length=int(generation.get("max_length") or max_target_positions),
            max_target_positions=max_target_positions,
            multilingual=bool(generation.get("is_multilingual", len(languages) > 1)),
            vocab_size=vocab_size,
            alignment_heads=tuple((int(layer), int(head)) for layer, head in generation.get("alignment_heads") or ()),
        )

    def max_prompt_tokens(self) -> int:
        """Prompt tokens kept (the last ones): half the decoder's context, as Whisper keeps."""
        return self.max_target_positions // 2 - 1


class Feed(NamedTuple):
    """What one decoding slot feeds the engine in one call."""

    start: int
    """The position of its first token (the tokens it has fed before)."""
    tokens: list[int]
    probe: int = -1
    """Index in `tokens` after which to report log P(<|nospeech|>) (-1: none asked)."""


@dataclasses.dataclass(frozen=True)
class Fallback:
    """When a finished window is decoded again, hotter, or dropped as silence: OpenAI whisper's
    `transcribe` rules as transformers' `generate` applies them (a None threshold is not checked).

    A window *fails* when its compression ratio is above `compression_ratio_threshold` or its
    average log-probability below `logprob_threshold`; a failed window is decoded again at the next
    temperature (the request's, then `temperature_increment` hotter each time, up to 1.0), and the
    last try is kept whatever it scored. A window whose P(<|nospeech|>) is above
    `no_speech_threshold` and whose average log-probability is below `logprob_threshold` is
    silence: it gives no segments and is not retried."""

    temperature_increment: Optional[float] = 0.2
    """None: a window is decoded once."""
    compression_ratio_threshold: Optional[float] = 1.35
    """On the zlib ratio of the window's token ids as bytes (transformers' gauge; 1.35 there is
    what 2.4 is to OpenAI's ratio of the text's bytes)."""
    logprob_threshold: Optional[float] = -1.0
    no_speech_threshold: Optional[float] = 0.6
    """Needs `logprob_threshold`: silence is judged by both."""

    def __post_init__(self):
        if self.temperature_increment is not None and not 0.0 < self.temperature_increment <= 1.0:
            raise ValueError(f"temperature_increment must be in (0, 1] or null, not {self.temperature_increment}")
        if self.no_speech_threshold is not None and self.logprob_threshold is None:
            raise ValueError("no_speech_threshold needs logprob_threshold: silence is judged by both (set it, "
                             "or set no_speech_threshold to null)")

    def temperatures(self, first: float) -> tuple[float, ...]:
        """The temperatures a window may be decoded at, starting at the request's."""
        if self.temperature_increment is None:
            return (first,)
        count = int(math.floor((1.0 - first) / self.temperature_increment + 1e-6))
        return tuple(round(first + i * self.temperature_increment, 6) for i in range(count + 1))


@dataclasses.dataclass(frozen=True)
class TranscriptionOptions:
    """What one request asks (validated by the caller: `check_options`)."""

    task: str = "transcribe"
    language: Optional[str] = None
    """A code of `WhisperTokens.languages`; None: detected from the first window (multilingual)."""
    timestamps: bool = False
    prompt: tuple[int, ...] = ()
    """Text token ids of the request's prompt (without <|startofprev|>), fed before every window."""
    temperature: float = 0.0
    seed: Optional[int] = None
    word_timestamps: bool = False
    """Time each token of the kept windows (`Segment.token_times`) from the alignment heads."""
    fallback: Optional[Fallback] = None
    """None: every window is decoded once at `temperature` and kept."""

    def temperatures(self) -> tuple[float, ...]:
        return self.fallback.temperatures(self.temperature) if self.fallback else (self.temperature,)


def check_options(tokens: WhisperTokens, options: TranscriptionOptions) -> Optional[tuple[str, str]]:
    """(problem, parameter) if the model cannot honour `options`, else None."""
    if options.task not in ("transcribe", "translate"):
        return f"task must be transcribe or translate, not {options.task!r}", "task"
    if options.task == "translate" and "translate" not in tokens.tasks:
        return "this model is English-only and cannot translate; use /v1/audio/transcriptions", "model"
    if options.language is not None:
        if not tokens.multilingual and options.language != "en":
            return f"this model is English-only; it cannot transcribe language {options.language!r}", "language"
        if tokens.multilingual and options.language not in tokens.languages:
            known = ", ".join(sorted(tokens.languages))
            return f"unknown language {options.language!r}; send an ISO-639-1 code, one of: {known}", "language"
    if options.word_timestamps and not tokens.alignment_heads:
        return ("this model cannot time words: its generation_config.json has no alignment_heads; ask for "
                "timestamp_granularities ['segment']"), "timestamp_granularities"
    if not 0.0 <= options.temperature <= 1.0:
        return f"temperature must be between 0 and 1, not {options.temperature}", "temperature"
    return None


def window(mel: np.ndarray, seek: int) -> np.ndarray:
    """float32 [n_mels, FRAMES_PER_WINDOW]: frames seek .. seek + FRAMES_PER_WINDOW of `mel`, zero-padded
    at the end where the audio runs short (how transformers pads the last window of long audio)."""
    frames = mel[:, seek: seek + FRAMES_PER_WINDOW]
    if frames.shape[1] < FRAMES_PER_WINDOW:
        frames = np.pad(frames, ((0, 0), (0, FRAMES_PER_WINDOW - frames.shape[1])))
    return np.ascontiguousarray(frames, np.float32)


def prefix(tokens: WhisperTokens, options: TranscriptionOptions, language: Optional[str]) -> list[int]:
    """The tokens a window feeds before its first sampled token. `language` None: the prefix
    stops after <|startoftranscript|> (its logits pick the language; see `detect_language`)."""
    head = [tokens.prev, *options.prompt[-tokens.max_prompt_tokens():]] if options.prompt and tokens.prev else []
    if tokens.multilingual and language is None:
        return head + [tokens.sot]
    rest = [tokens.sot]
    if tokens.multilingual:
        rest.append(tokens.languages[language])
    if tokens.tasks:
        rest.append(tokens.tasks[options.task])
    if not options.timestamps:
        rest.append(tokens.no_timestamps)
    return head + rest


def detect_language(tokens: WhisperTokens, logits: np.ndarray) -> str:
    """The language whose token is likeliest after <|startoftranscript|>."""
    codes = list(tokens.languages)
    ids = np.fromiter(tokens.languages.values(), np.int64, len(codes))
    return codes[int(np.argmax(logits[ids]))]


def length_limit(tokens: WhisperTokens, prefix_length: int) -> int:
    """The most tokens (prefix included) a window's decoder sequence may hold."""
    initial = min(tokens.max_target_positions // 2 - 1, prefix_length - 1)
    return min(tokens.max_length + initial, tokens.max_target_positions)


class WindowRules:
    """The logits rules of one window: `scores(logits, sampled)` for the next token."""

    def __init__(self, tokens: WhisperTokens, timestamps: bool):
        self.tokens = tokens
        self.timestamps = timestamps
        self._suppress = np.asarray(tokens.suppress, np.int64)
        self._begin = np.asarray(tokens.begin_suppress, np.int64)

    def scores(self, logits: np.ndarray, sampled: list[int]) -> np.ndarray:
        """float32 scores [vocab] for the token after `sampled` (the window's tokens after its prefix):
        -inf where a rule forbids a token."""
        scores = np.array(logits, np.float32)
        if not sampled and self._begin.size:
            scores[self._begin] = -np.inf
        if self._suppress.size:
            scores[self._suppress] = -np.inf
        if self.timestamps:
            self._timestamp_rules(scores, sampled)
        return scores

    def _timestamp_rules(self, scores: np.ndarray, sampled: list[int]) -> None:
        begin, eot = self.tokens.timestamp_begin, self.tokens.eot
        scores[self.tokens.no_timestamps] = -np.inf
        last = len(sampled) >= 1 and sampled[-1] >= begin
        penultimate = len(sampled) < 2 or sampled[-2] >= begin
        if last:
            if penultimate:  # a pair just closed: text (or the end) comes next
                scores[begin:] = -np.inf
            else:  # an open timestamp: another one, or the end
                scores[:eot] = -np.inf
        stamps = [t for t in sampled if t >= begin]
        if stamps:
            floor = stamps[-1] if last and not penultimate else stamps[-1] + 1
            scores[begin:floor] = -np.inf
        if not sampled:
            scores[:begin] = -np.inf
            if self.tokens.max_initial_timestamp_index is not None:
                scores[begin + self.tokens.max_initial_timestamp_index + 1:] = -np.inf
        logprobs = log_softmax(scores)
        if _logsumexp(logprobs[begin:]) > logprobs[:begin].max():
            scores[:begin] = -np.inf


def log_softmax(scores: np.ndarray) -> np.ndarray:
    top = scores.max()
    shifted = scores.astype(np.float64) - top
    return (shifted - np.log(np.exp(shifted).sum())).astype(np.float32)


def _logsumexp(values: np.ndarray) -> float:
    top = values.max()
    if not np.isfinite(top):
        return float(top)
    return float(top + np.log(np.exp(values.astype(np.float64) - top).sum()))


def choose(scores: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0, else a sample of softmax(scores / temperature)."""
    if temperature <= 0.0:
        return int(np.argmax(scores))
    probs = np.exp(log_softmax(scores / temperature).astype(np.float64))
    return int(rng.choice(probs.size, p=probs / probs.sum()))


@dataclasses.dataclass(frozen=True)
class Segment:
    """A stretch of speech with its times (seconds from the audio's start) and text token ids
    (timestamps removed). The statistics are its window's, as Whisper reports them."""

    seek: int
    """The window's first mel frame."""
    start: float
    end: float
    tokens: tuple[int, ...]
    """Every token of the segment as decoded, timestamps included (OpenAI's `tokens`)."""
    text_tokens: tuple[int, ...]
    temperature: float
    avg_logprob: float
    no_speech_prob: float
    token_times: tuple[tuple[float, float], ...] = ()
    """With word timestamps, one (start, end) per token of `tokens`, in seconds from the audio's
    start: a token ends where the alignment moves on to the token after it, and starts where the
    token before it in its window ended (the first at the window's start). Empty otherwise."""


def split_window(tokens: WhisperTokens, sampled: list[int], seek: int, window_frames: int
                 ) -> tuple[list[tuple[float, float, list[int]]], int]:
    """([(start, end, tokens)] of a finished window (its sampled tokens without <|endoftext|>), the
    mel frames it consumed), as transformers' `_retrieve_segment` splits it. `window_frames`: the
    window's real frames (fewer than 3000 at the end of the audio)."""
    begin = tokens.timestamp_begin
    offset = seek * SECONDS_PER_FRAME
    if not sampled:
        return [(offset, offset, [])], window_frames
    is_stamp = [t >= begin for t in sampled]
    single_ending = is_stamp[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(sampled) - 1) if is_stamp[i] and is_stamp[i + 1]]
    if cuts:
        if single_ending:
            cuts.append(len(sampled))
        else:
            cuts[-1] += 1
        segments, last = [], 0
        for i, cut in enumerate(cuts):
            piece = sampled[last:cut]
            end_index = -1 if i < len(cuts) - 1 or single_ending else -2
            segments.append((offset + (piece[0] - begin) * TIME_PRECISION,
                             offset + (piece[end_index] - begin) * TIME_PRECISION, piece))
            last = cut
        consumed = window_frames if single_ending else (sampled[last - 2] - begin) * FRAMES_PER_TIMESTAMP
        return segments, consumed
    stamps = [t for t in sampled if t >= begin]
    end_pos = int(window_frames * SECONDS_PER_FRAME / TIME_PRECISION)
    if stamps and stamps[-1] != begin:
        end_pos = stamps[-1] - begin
    return [(offset, offset + end_pos * TIME_PRECISION, sampled)], window_frames


def verdict(tokens: WhisperTokens, fallback: Optional[Fallback], sampled: list[int], avg_logprob: float,
            no_speech_prob: float) -> str:
    """"keep", "retry" (decode the window again, hotter, if a temperature is left) or "skip"
    (silence) for a finished window: `sampled` its tokens, <|endoftext|> included
    (transformers' `_need_fallback`)."""
    if fallback is None:
        return "keep"
    low_logprob = fallback.logprob_threshold is not None and avg_logprob < fallback.logprob_threshold
    if fallback.no_speech_threshold is not None and low_logprob and no_speech_prob > fallback.no_speech_threshold:
        return "skip"
    repetitive = (fallback.compression_ratio_threshold is not None
                  and token_compression_ratio(sampled, tokens.vocab_size) > fallback.compression_ratio_threshold)
    return "retry" if repetitive or low_logprob else "keep"


def token_compression_ratio(ids: list[int], vocab_size: int) -> float:
    """len(ids as little-endian bytes) / len(zlib of them): transformers' repetition gauge."""
    width = int(math.log2(vocab_size) / 8) + 1
    data = b"".join(t.to_bytes(width, "little") for t in ids)
    return len(data) / len(zlib.compress(data)) if data else 0.0


def compression_ratio(text: str) -> float:
    """len(text bytes) / len(zlib of them): Whisper's repetition gauge."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0
